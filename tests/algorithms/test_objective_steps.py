"""The new policy losses and estimators named from the recipe config run a real GRPO step: clip-cov /
KL-cov through the updater's step-wide selection (the old log-probs then never reused)."""

from __future__ import annotations

import math

from tests.algorithms.short_grpo import make_assets, short_grpo_config
from verl_trainer.testing import run_distributed

LOSS = "algorithm.actor.loss"
RUNS = {
    "kl_cov+gpg": (f"{LOSS}.policy_loss=kl_cov", f"{LOSS}.kl_cov_ratio=0.2", "algorithm.adv_estimator=gpg"),
    "clip_cov+pass_at_k": (f"{LOSS}.policy_loss=clip_cov", f"{LOSS}.clip_cov_ratio=0.2",
                           f"{LOSS}.clip_cov_lb=-10.0", "algorithm.adv_estimator=pass_at_k",
                           "algorithm.pass_k=2"),
    "gspo+opo": (f"{LOSS}.policy_loss=gspo", f"{LOSS}.loss_agg_mode=seq-mean-token-mean",
                 "algorithm.adv_estimator=opo"),
}
KEYS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/old_log_probs_reused", "actor/update_skipped")


def _steps(assets: str, root: str) -> dict:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.models.loading import load_tokenizer

    results = {}
    tokenizer = load_tokenizer(f"{assets}/model")
    for name, overrides in RUNS.items():
        cfg = short_grpo_config(f"{assets}/model", f"{assets}/data", "data.val_files=null", *overrides)
        trainer = Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                          default_root_dir=f"{root}/{name}")
        trainer.fit(GRPO(cfg.algorithm), datamodule=PromptDataModule(cfg.data, tokenizer))
        results[name] = {k: float(trainer.callback_metrics[k]) for k in KEYS if k in trainer.callback_metrics}
    return results


def test_new_objectives_train_a_grpo_step(tmp_path):
    assets = make_assets(tmp_path / "assets")
    out = run_distributed(_steps, 1, str(assets), str(tmp_path / "run"), timeout=600)[0]
    for name, metrics in out.items():
        assert set(KEYS) <= set(metrics), (name, metrics)
        assert metrics["actor/update_skipped"] == 0.0, name
        assert math.isfinite(metrics["actor/pg_loss"]), name
        assert 0.0 < metrics["actor/pg_clipfrac"] < 1.0 or name == "gspo+opo", (name, metrics)
    for name in ("kl_cov+gpg", "clip_cov+pass_at_k"):
        assert out[name]["actor/old_log_probs_reused"] == 0.0, name  # the selection read them first
    assert out["gspo+opo"]["actor/old_log_probs_reused"] == 1.0  # one on-policy update: reused as before
