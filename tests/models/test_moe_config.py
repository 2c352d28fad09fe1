"""MoE settings refused when the config is built; LoRA on a MoE model (attention trains; experts off fsdp2
refused)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.common import nll_loss, random_batch
from tests.models.moe_common import tiny_moe
from verl_trainer.algorithms.config import ActorConfig, GRPOConfig
from verl_trainer.core_algos import RolloutCorrectionConfig
from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig
from verl_trainer.models.moe_config import MoEConfig
from verl_trainer.models.moe_lora import ATTENTION_TARGETS, EXPERT_TARGETS
from verl_trainer.rollout import RolloutConfig
from verl_trainer.testing.ranks import run_distributed


def test_bad_moe_settings_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"router_replay='R3'.*off, rollout, old_policy"):
        MoEConfig(router_replay="R3")
    with pytest.raises(ValueError, match=r"aux_loss_coeff must be a number >= 0.*-0.1"):
        MoEConfig(aux_loss_coeff=-0.1)


@pytest.mark.parametrize(("rollout", "match"), [
    (RolloutConfig(name="vllm", n=2), "rollout.name='vllm'.*Set rollout.name=hf"),
    (RolloutConfig(n=2, max_staleness=1), "max_staleness=1 is not supported"),
])
def test_rollout_replay_refused_where_the_rollout_cannot_record(rollout: RolloutConfig, match: str) -> None:
    correction = RolloutCorrectionConfig(level="token")
    for mode in ("old_policy", "off"):  # accepted
        GRPOConfig(actor=ActorConfig(engine=EngineConfig(moe=MoEConfig(router_replay=mode))), rollout=rollout,
                   rollout_correction=correction)
    actor = ActorConfig(engine=EngineConfig(moe=MoEConfig(router_replay="rollout")))
    with pytest.raises(ValueError, match=match):
        GRPOConfig(actor=actor, rollout=rollout, rollout_correction=correction)


def lora_runs(path: str) -> dict[str, object]:
    """LoRA on attention trains with the router losses; 'all-linear' (experts, router) is refused on fsdp."""
    moe = MoEConfig(aux_loss_coeff=0.01, z_loss_coeff=0.001)
    engine = EngineRegistry.new("language_model", "fsdp2", EngineConfig(
        model_path=path, lora_rank=4, target_modules=list(ATTENTION_TARGETS), moe=moe),
        OptimConfig(lr=1e-2, weight_decay=0.0))
    engine.initialize()
    before = {n: t.clone() for n, t in engine.get_per_tensor_param(adapters_only=True)}
    with engine.train_mode():
        out = engine.train_batch(random_batch(4, seed=1), nll_loss)
    after = dict(engine.get_per_tensor_param(adapters_only=True))
    moved = sum(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n)  # A: 0 grad (B = 0)
    names = sorted({k for m in out["metrics"] for k in m})
    refused = ""
    try:
        EngineRegistry.new("language_model", "fsdp", EngineConfig(model_path=path, lora_rank=4, moe=moe),
                           OptimConfig()).initialize()
    except ValueError as err:
        refused = str(err)
    try:  # refused when the engine is built, before the model loads
        EngineRegistry.new("language_model", "deepspeed", EngineConfig(
            model_path=path, lora_rank=4, target_parameters=list(EXPERT_TARGETS)), OptimConfig())
    except ValueError as err:
        refused += "\n" + str(err)
    adapters = sum("lora_B" in n for n in before)
    return {"moved": moved, "adapters": adapters, "names": names, "refused": refused}


def test_lora_on_attention_trains_and_expert_lora_off_fsdp2_is_refused(tmp_path) -> None:
    result = run_distributed(lora_runs, 1, tiny_moe(str(tmp_path / "model")))[0]
    assert result["adapters"] > 0 and result["moved"] == result["adapters"]
    assert "moe/aux_loss" in result["names"] and "moe/z_loss" in result["names"]
    fsdp, deepspeed = result["refused"].split("\n")
    assert "'fsdp' backend" in fsdp and "experts.gate_up_proj" in fsdp and "gate.weight" in fsdp
    assert "'deepspeed' backend" in deepspeed and "target_parameters=['mlp.experts.gate_up_proj'" in deepspeed
    assert all("strategy='fsdp2'" in r and "target_modules=['q_proj'" in r for r in (fsdp, deepspeed))


def test_old_policy_routing_is_kept_only_in_old_policy_mode() -> None:
    from tensordict import TensorDict

    from verl_trainer.models.moe_routers import ROUTED_EXPERTS
    from verl_trainer.models.router_replay import keep_old_policy_routing, record_rollout_routing

    routed = torch.randint(0, 4, (2, 5, 2, 2))
    for mode, kept in (("old_policy", True), ("rollout", False), ("off", False)):
        batch = TensorDict({"input_ids": torch.zeros(2, 5, dtype=torch.long)}, batch_size=[2])
        keep_old_policy_routing(MoEConfig(router_replay=mode), {ROUTED_EXPERTS: routed}, batch)
        assert (ROUTED_EXPERTS in batch.keys()) == kept
    with pytest.raises(ValueError, match="only the HF rollout does"):
        record_rollout_routing(object(), MoEConfig(router_replay="rollout"))


def test_router_losses_or_replay_under_sequence_parallel_are_refused(tmp_path) -> None:
    from verl_trainer.models.loading import load_causal_lm
    from verl_trainer.models.moe_routers import find_routers, refuse_under_sequence_parallel

    routers = find_routers(load_causal_lm(tiny_moe(str(tmp_path / "model"))))
    refuse_under_sequence_parallel(routers, 2, MoEConfig())  # metrics only: not logged under SP
    refuse_under_sequence_parallel(routers, 1, MoEConfig(aux_loss_coeff=0.1))
    for moe in (MoEConfig(aux_loss_coeff=0.1), MoEConfig(router_replay="old_policy")):
        with pytest.raises(NotImplementedError, match="ulysses_sequence_parallel_size=2"):
            refuse_under_sequence_parallel(routers, 2, moe)
