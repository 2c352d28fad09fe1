"""Vision-language models in the engine: images in the forward, mrope positions through packing, strategies.

The reference is the plain HF model (``AutoModelForImageTextToText``) on each unpacked row with its own
mrope positions (``mm_token_type_ids``); the engine packs rows with images and must agree to fp32 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText

from verl_trainer.data.packing import next_token_log_probs_and_entropy, pack_batch
from verl_trainer.data.vision import model_vision_inputs
from verl_trainer.engine.heads import LanguageModel
from verl_trainer.models.attention import packed_forward
from verl_trainer.models.loading import load_causal_lm
from verl_trainer.models.tiny_vlm import make_tiny_vlm
from verl_trainer.models.vlm import mm_token_type_ids
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
                          mm_token_type_ids=mm_token_type_ids(ids, hf_model.config), **vision).logits
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


def _engine_rank(backends, vlm_path, batch):
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = rank_shard(batch, rank, world)
    out = {}
    for backend in backends:
        engine = build_engine(backend, "language_model", vlm_path, OPTIM, micro_batch_size_per_gpu=2)
        with engine.eval_mode():
            infer = engine.infer_batch(shard, calculate_entropy=True)["model_output"]
        with engine.train_mode():
            result = engine.train_batch(shard, nll_loss)
        grads_seen = {name for name, p in engine.module.named_parameters() if p.grad is not None}
        out[backend] = {"log_probs": infer["log_probs"], "entropy": infer["entropy"],
                        "loss": result["loss"], "grad_norm": result["grad_norm"],
                        "vision_grads": any(".visual." in n for n in grads_seen)}
    return out


def test_engine_forward_with_images_matches_hf(vlm_path, reference):
    batch, ref, _ = reference
    backends = ("fsdp2", "fsdp", "deepspeed")
    env = {"OMP_NUM_THREADS": "1"}
    results = run_distributed(_engine_rank, 2, backends, vlm_path, batch, env=env)
    used = _used(batch)
    for backend in backends:
        lp = torch.cat([results[r][backend]["log_probs"] for r in range(2)])
        assert (lp - ref)[used].abs().max() < TOL, backend
        assert results[0][backend]["vision_grads"], backend
    for backend in backends[1:]:
        assert abs(results[0][backend]["loss"] - results[0]["fsdp2"]["loss"]) < TOL
        assert abs(results[0][backend]["grad_norm"] - results[0]["fsdp2"]["grad_norm"]) < 1e-4
