"""The "A feature of the RL step" block of ``docs/architecture.md`` runs as written, in a GRPO step."""

from __future__ import annotations

import inspect
import math

from tests.algorithms.short_grpo import make_assets, short_grpo_config
from tests.test_architecture_docs import DOC, doc_block
from verl_trainer.algorithms.rl import RLModule
from verl_trainer.testing import run_distributed


def _distilled_step(assets: str, root: str) -> dict:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import PromptDataModule
    from verl_trainer.callbacks import Callback
    from verl_trainer.models.loading import load_tokenizer

    namespace: dict = {}
    exec(compile(doc_block("**A feature of the RL step.**"), str(DOC), "exec"), namespace)
    cfg = short_grpo_config(f"{assets}/model", f"{assets}/data", "data.val_files=null")
    logged: list[dict] = []

    class Keep(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            logged.append(dict(outputs))

    module = namespace["DistilledGRPO"](cfg.algorithm)
    trainer = Trainer(max_steps=1, callbacks=[Keep()], logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, default_root_dir=root)
    trainer.fit(module, datamodule=PromptDataModule(cfg.data, load_tokenizer(f"{assets}/model")))
    return {"engines": sorted(module.engines), "kl": float(logged[0]["distill/teacher_kl"].aggregate()),
            "update_skipped": float(logged[0]["actor/update_skipped"])}


def test_a_teacher_kl_part_joins_the_step_without_a_branch(tmp_path):
    assets = make_assets(tmp_path / "assets")
    out = run_distributed(_distilled_step, 1, str(assets), str(tmp_path / "run"))[0]
    assert {"actor", "teacher"} <= set(out["engines"])
    assert math.isfinite(out["kl"]) and out["update_skipped"] == 0.0
    assert "teacher" not in inspect.getsource(RLModule.training_step)  # a part, not a branch of the step
