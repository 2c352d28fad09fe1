"""Vision-language models in the engine: images in the forward, mrope positions through packing, strategies.

The reference is the plain HF model (``AutoModelForImageTextToText``) on each unpacked row with its own
mrope positions (``mm_token_type_ids``); the engine packs rows with images and must agree to fp32 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText

from tests.data.test_vision_balancing import BALANCE_SIZES, balance_on_rank, check_balanced
from verl_trainer.data.packing import next_token_log_probs_and_entropy, pack_batch
from verl_trainer.data.vision import model_vision_inputs
from verl_trainer.engine.heads import LanguageModel
from verl_trainer.models.attention import packed_forward
from verl_trainer.models.loading import load_causal_lm
from verl_trainer.models.tiny_vlm import make_tiny_vlm
from verl_trainer.models.vlm import token_types
from verl_trainer.testing.ranks import run_distributed
from verl_trainer.testing.vlm_batch import hf_reference_log_probs, vlm_batch

from .common import OPTIM, build_engine, nll_loss, rank_shard

TOL = 1e-5


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture(scope="module")
def reference(vlm_path):
    batch = vlm_batch(8)
    model = AutoModelForImageTextToText.from_pretrained(vlm_path).eval()
    return batch, hf_reference_log_probs(model, batch), model


def _used(batch):
    return batch["response_mask"].bool()


def test_packed_equals_padded_equals_hf(vlm_path, reference):
    batch, ref, hf_model = reference
    assert int(batch["image_grid_thw"].prod(-1).gt(0).sum()) >= 6  # rows with 0, 1 and 2 images
    with torch.no_grad():  # padded: the HF model on the whole right-padded batch, its own positions
        vision = model_vision_inputs(batch)
        ids = batch["input_ids"]
        logits = hf_model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False,
                          mm_token_type_ids=token_types(ids, hf_model.config), **vision).logits
        padded = torch.zeros_like(ref)
        padded[:, 1:] = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    model = load_causal_lm(vlm_path, attn_implementation="verl_varlen").eval()
    part = LanguageModel()
    packed = pack_batch(batch, keys=())
    with torch.no_grad():
        out = part.outputs(part.forward_packed(model, packed), packed)
    assert packed.mrope_position_ids.shape == (3, 1, packed.num_tokens)
    engine_lp = packed.unpack(out["log_probs"])
    used = _used(batch)
    assert (padded - ref)[used].abs().max() < TOL
    assert (engine_lp - ref)[used].abs().max() < TOL
    # the silent fallback: the same row with 1-D positions (no mrope) is measurably different
    plain = pack_batch(batch, keys=())
    with torch.no_grad():
        wrong, _ = next_token_log_probs_and_entropy(packed_forward(model, plain).logits, plain.input_ids,
                                                    plain.cu_seqlens)
    assert (plain.unpack(wrong) - ref)[used].abs().max() > 100 * TOL


VARIANTS = {
    "fsdp2": ("fsdp2", {}),
    "fsdp": ("fsdp", {}),
    "frozen": ("fsdp2", {"freeze_vision_tower": True}),
    "lora": ("fsdp2", {"lora_rank": 4, "lora_alpha": 8}),
}
"""Engines one spawn builds in turn: name -> (backend, EngineConfig fields)."""


def _engine_rank(vlm_path, batch, export_dir):
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = rank_shard(batch, rank, world)
    out = {"balanced": balance_on_rank(BALANCE_SIZES)}  # images through balancing (tests/data), same spawn
    for name, (backend, fields) in VARIANTS.items():
        engine = build_engine(backend, "language_model", vlm_path, OPTIM, micro_batch_size_per_gpu=2,
                              **fields)
        before = dict(engine.get_per_tensor_param())
        with engine.eval_mode():
            infer = engine.infer_batch(shard, calculate_entropy=True)["model_output"]
        with engine.train_mode():
            result = engine.train_batch(shard, nll_loss)
        after = dict(engine.get_per_tensor_param())
        changed = {k for k in after if not torch.equal(after[k], before[k])}
        trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
        out[name] = {"log_probs": infer["log_probs"], "entropy": infer["entropy"], "loss": result["loss"],
                     "grad_norm": result["grad_norm"], "changed": changed, "trainable": trainable}
        if name == "fsdp2":  # the trained policy: exported, and its tensors as a rollout would receive them
            engine.save_hf(export_dir)
            out[name]["policy"] = after if rank == 0 else None
    return out


def test_engine_forward_with_images_matches_hf(vlm_path, reference, tmp_path):
    """fsdp2 and fsdp (dp=2, 2 rows per micro-batch) equal the HF rows; the vision tower trains, or is
    frozen (``freeze_vision_tower``: no update), or gets no adapters (LoRA: only the language model's).
    The trained fsdp2 policy's HF export loads with ``AutoModelForImageTextToText`` (+ its image processor
    and tokenizer) and generates the policy's greedy tokens from image prompts."""
    batch, ref, _ = reference
    export_dir = str(tmp_path / "export")
    results = run_distributed(_engine_rank, 2, vlm_path, batch, export_dir, env={"OMP_NUM_THREADS": "1"})
    check_balanced([results[r]["balanced"] for r in range(2)])
    used = _used(batch)
    for name in VARIANTS:
        lp = torch.cat([results[r][name]["log_probs"] for r in range(2)])
        assert (lp - ref)[used].abs().max() < TOL, name
    full, frozen = results[0]["fsdp2"], results[0]["frozen"]
    assert any(".visual." in k for k in full["changed"])
    assert any("language_model" in k for k in full["changed"])
    assert abs(results[0]["fsdp"]["loss"] - full["loss"]) < TOL
    assert abs(results[0]["fsdp"]["grad_norm"] - full["grad_norm"]) < 1e-4
    assert not any(".visual." in k for k in frozen["changed"] | set(frozen["trainable"]))
    assert any("language_model" in k for k in frozen["changed"])
    _check_export(export_dir, full["policy"], batch)
    lora = results[0]["lora"]
    assert lora["trainable"] and all("lora_" in n for n in lora["trainable"])
    assert not any("visual" in n for n in lora["trainable"]), "adapters on the language model only"
    assert any("language_model" in n for n in lora["trainable"])
    assert any("language_model" in k for k in lora["changed"])
    assert not any(".visual." in k for k in lora["changed"])


def test_vlm_settings_refused_at_config_build(vlm_path, tmp_path):
    from verl_trainer.engine import EngineConfig
    from verl_trainer.models.tiny import make_tiny_model

    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=2 with the vision-language model"):
        EngineConfig(model_path=vlm_path, ulysses_sequence_parallel_size=2)
    text = make_tiny_model(str(tmp_path / "text"), arch="llama", hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="freeze_vision_tower=True but .* is not a vision-language model"):
        EngineConfig(model_path=text, freeze_vision_tower=True)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 / pipeline_model_parallel_size=1"):
        EngineConfig(model_path=vlm_path, tensor_model_parallel_size=2)
    EngineConfig(model_path=vlm_path, freeze_vision_tower=True)  # accepted
    from verl_trainer.models.loading import load_value_model

    with pytest.raises(ValueError, match="a value model \\(critic\\) of it is not supported"):
        load_value_model(vlm_path)


def _check_export(export_dir, policy, batch):
    from transformers import AutoImageProcessor, AutoTokenizer

    exported = AutoModelForImageTextToText.from_pretrained(export_dir).eval()
    assert type(AutoImageProcessor.from_pretrained(export_dir)).__name__ == "Qwen2VLImageProcessorPil"
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == exported.config.image_token_id
    live = AutoModelForImageTextToText.from_config(exported.config).eval()
    live.load_state_dict(policy)  # the engine's policy, as a rollout receives its tensors
    exported_tensors = exported.state_dict()
    assert set(exported_tensors) == set(policy)  # both towers, every tensor
    assert all(torch.equal(exported_tensors[k], policy[k]) for k in policy)
    for i in (1, 2, 5):  # one image, two images
        row = batch[i : i + 1]
        n = int(row["prompt_len"][0])
        ids = row["input_ids"][:, :n]
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  "mm_token_type_ids": token_types(ids, exported.config), **model_vision_inputs(row)}
        with torch.no_grad():
            want = live.generate(**inputs, max_new_tokens=6, do_sample=False)
            got = exported.generate(**inputs, max_new_tokens=6, do_sample=False)
        assert torch.equal(got, want), (i, got, want)
