"""Router replay: a near-tie router whose top-k a 1-ulp change of the logits flips.

The rollout's model has two experts of layer 0 with the same router row (an exact tie for every token);
the trainer's model scales one of the two rows by ``1 + 2^-23`` (one float32 ulp of each logit), which
flips the tie wherever that logit is positive. With ``router_replay=rollout`` the trainer's log-probs
equal the rollout's (to float32 round-off); with it off they do not.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.moe_common import tiny_moe
from verl_trainer.data import schema
from verl_trainer.engine import EngineConfig, EngineRegistry
from verl_trainer.models.loading import load_causal_lm
from verl_trainer.models.moe_config import MoEConfig
from verl_trainer.models.moe_routers import ROUTED_EXPERTS, capture_routers, find_routers
from verl_trainer.rollout import RolloutConfig
from verl_trainer.rollout.hf import HFRollout
from verl_trainer.testing.ranks import run_distributed

PROMPTS = [{"input_ids": [5 + i, 9, 12 + i, 7, 30 + i], "index": i} for i in range(4)]


def tied_models(base: str, tie: str, nudged: str) -> None:
    """Write the rollout's model (experts 1 and 2 of layer 0 tied) and the trainer's (one ulp apart)."""
    model = load_causal_lm(base)
    weight = find_routers(model)[0].module.weight
    with torch.no_grad():
        weight[2] = weight[1]
    model.save_pretrained(tie)
    with torch.no_grad():
        weight[2] = weight[1] * (1 + 2.0 ** -23)
    model.save_pretrained(nudged)


def replay_run(tie: str, nudged: str) -> dict[str, float]:
    """Rollout on the tied model, then the trainer's log-probs on the nudged one, replay on and off."""
    rollout = HFRollout(RolloutConfig(n=2, max_new_tokens=12, temperature=1.0, seed=3), tie)
    rollout.record_routing = True
    batch = schema.tensor_only(rollout.generate(PROMPTS, step=0))
    mask = batch[schema.RESPONSE_MASK].bool()
    out: dict[str, float] = {"recorded": float((batch[ROUTED_EXPERTS] >= 0).all(-1).all(-1).sum())}
    for mode in ("off", "rollout"):
        engine = EngineRegistry.new("language_model", "fsdp2", EngineConfig(
            model_path=nudged, micro_batch_size_per_gpu=3, moe=MoEConfig(router_replay=mode)))
        engine.initialize()
        with engine.eval_mode():
            result = engine.infer_batch(batch)["model_output"]
        diff = (result["log_probs"] - batch[schema.ROLLOUT_LOG_PROBS]).abs()[mask]
        out[mode] = float(diff.max())
        routed = result[ROUTED_EXPERTS]
        recorded = batch[ROUTED_EXPERTS]
        same = (routed == recorded).all(-1) | (recorded < 0).any(-1)
        out[f"{mode}_routing_equal"] = float(same[batch[schema.ATTENTION_MASK].bool()].all())
    out["tokens"] = float(mask.sum())
    return out


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("replay")
    base = tiny_moe(str(root / "base"))
    tied_models(base, str(root / "tie"), str(root / "nudged"))
    return str(root / "tie"), str(root / "nudged")


def test_replay_makes_trainer_log_probs_equal_the_rollouts(tied) -> None:
    result = run_distributed(replay_run, 1, *tied)[0]
    assert result["recorded"] > 0
    assert result["rollout"] < 1e-5, result  # replayed: the rollout's routing and log-probs
    assert result["rollout_routing_equal"] == 1.0
    assert result["off"] > 1e-3, result  # free: the 1-ulp nudge flips the tie, log-probs move
    assert result["off_routing_equal"] == 0.0


def test_replayed_router_still_gets_gradients(tied) -> None:
    """Replay fixes which experts run; the router's weights get gradients through their probabilities."""
    model = load_causal_lm(tied[1])
    routers = find_routers(model)
    ids = torch.tensor([[5, 9, 12, 7, 30, 8]])
    with capture_routers(routers) as free:
        model(input_ids=ids).logits.sum().backward()
    free_grad = routers[0].module.weight.grad.clone()
    model.zero_grad()
    forced = torch.stack([torch.cat(s) for s in free.selected], 1).flip(-1)  # the same experts, other order
    forced[:, 0] = torch.tensor([3, 0])                                       # layer 0: other experts
    with capture_routers(routers, replay=forced) as replayed:
        model(input_ids=ids).logits.sum().backward()
    grad = routers[0].module.weight.grad
    assert torch.equal(torch.cat(replayed.selected[0]), forced[:, 0])
    assert grad is not None and float(grad.abs().sum()) > 0
    assert not torch.allclose(grad, free_grad)
    assert math.isfinite(float(grad.sum()))
