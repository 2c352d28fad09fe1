"""Rollout log-probs against the trainer's: the HF rollout sharing the actor's weights has no mismatch
(and the correction is the identity); a perturbed rollout policy gives the hand-computed TIS weights."""

import pytest
import torch

from verl_trainer.core_algos import (
    RolloutCorrectionConfig,
    compute_rollout_is_weights,
    rollout_mismatch_metrics,
)
from verl_trainer.core_algos.losses import PPOLossConfig, ppo_loss
from verl_trainer.data import schema
from verl_trainer.engine import OptimConfig
from verl_trainer.metrics import reduce_metrics
from verl_trainer.rollout import HFRollout, RolloutConfig
from verl_trainer.testing.ranks import run_distributed

TEMPERATURE = 0.7
PROMPTS = [{"input_ids": [5, 6, 7], "index": 0}, {"input_ids": [9, 8], "index": 1},
           {"input_ids": [11, 4, 12, 13], "index": 2}]
SCALE = 1.3  # the rollout policy's lm_head is the actor's times this
CAP = 1.05  # the truncation threshold (the tiny model's ratios lie within about 0.85 .. 1.2)


def _on_rank(model_path: str) -> dict:
    from tests.engine.common import padded_log_probs
    from verl_trainer.engine import EngineConfig, EngineRegistry
    from verl_trainer.models import load_causal_lm

    engine = EngineRegistry.new("language_model", "fsdp2", EngineConfig(model_path=model_path,
                                temperature=TEMPERATURE), OptimConfig(lr=1e-2))
    engine.initialize()
    config = RolloutConfig(n=4, max_new_tokens=8, temperature=TEMPERATURE)
    shared = HFRollout(config, model_path)
    shared.share_weights(engine.get_shareable_params())
    batch = shared.generate(PROMPTS, step=0)
    with engine.eval_mode():
        old = engine.infer_batch(batch)["model_output"]["log_probs"]
    mask = batch[schema.RESPONSE_MASK].bool()
    mismatch = rollout_mismatch_metrics(old, batch[schema.ROLLOUT_LOG_PROBS], mask)
    same = {"mismatch": reduce_metrics([mismatch])}
    weights, _ = compute_rollout_is_weights(old, batch[schema.ROLLOUT_LOG_PROBS], mask,
                                            RolloutCorrectionConfig(level="sequence"))
    same["weight_error"] = float((weights - 1.0)[mask].abs().max())
    batch[schema.OLD_LOG_PROBS] = old
    batch[schema.ADVANTAGES] = torch.randn(batch.batch_size[0], 1).expand_as(old) * mask
    out = {"log_probs": old.clone()}
    plain, _ = ppo_loss(PPOLossConfig())(out, batch)
    corrected, _ = ppo_loss(PPOLossConfig(), RolloutCorrectionConfig(level="token"))(out, batch)
    same["loss_diff"] = float((plain - corrected).abs())

    perturbed = HFRollout(config, model_path)  # a private copy, with other weights
    full = {n: t.clone() for n, t in engine.get_per_tensor_param()}
    full["lm_head.weight"] = full["lm_head.weight"] * SCALE
    perturbed.update_weights(full.items())
    batch2 = perturbed.generate(PROMPTS, step=1)
    with engine.eval_mode():
        p = engine.infer_batch(batch2)["model_output"]["log_probs"]
    model = load_causal_lm(model_path)
    with torch.no_grad():
        model.lm_head.weight.mul_(SCALE)
        logits = model(input_ids=batch2[schema.INPUT_IDS],
                       attention_mask=batch2[schema.ATTENTION_MASK]).logits
    mask2 = batch2[schema.RESPONSE_MASK].bool()
    q_hand = padded_log_probs(logits / TEMPERATURE, batch2[schema.INPUT_IDS]) * mask2
    hand = torch.where(mask2, torch.exp(p - q_hand).clamp(max=CAP), torch.zeros(()))
    got, _ = compute_rollout_is_weights(p, batch2[schema.ROLLOUT_LOG_PROBS], mask2,
                                        RolloutCorrectionConfig(level="token", threshold=CAP))
    return {**same, "q_error": float((batch2[schema.ROLLOUT_LOG_PROBS] - q_hand)[mask2].abs().max()),
            "weights": got, "hand": hand, "mask": mask2}


@pytest.mark.slow  # one spawned rank with an fsdp2 engine: 30-55 s on the shared 2-core machine
def test_shared_weights_no_mismatch_and_perturbed_weights_by_hand(rollout_model_path):
    (r,) = run_distributed(_on_rank, 1, rollout_model_path, timeout=240)
    assert r["mismatch"]["rollout_corr/log_prob_abs_diff_max"] < 1e-5  # fp32: the same policy
    assert abs(r["mismatch"]["rollout_corr/kl"]) < 1e-6
    assert abs(r["mismatch"]["rollout_corr/ppl_ratio"] - 1.0) < 1e-5
    assert r["weight_error"] < 1e-4  # the sequence-level weight is 1: the correction is the identity
    assert r["loss_diff"] < 1e-6
    assert r["q_error"] < 1e-5  # the rollout's log-probs are its own policy's
    torch.testing.assert_close(r["weights"], r["hand"], atol=1e-5, rtol=1e-5)
    applied = r["weights"][r["mask"]]
    assert (applied - 1).abs().max() > 0.1 and (applied == CAP).any()  # really off-policy, some truncated
