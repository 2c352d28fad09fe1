"""On-policy distillation (algorithms/distill.py): the config's refusals, the tokenizer check, and one real
GRPO step with a teacher engine whose batch fields are checked against the teacher run by plain HF."""

from __future__ import annotations

import math

import pytest
import torch

from tests.algorithms.short_grpo import make_assets, short_grpo_config
from verl_trainer.algorithms.distill import DistillGRPO, check_same_tokenizer
from verl_trainer.algorithms.distill_config import DistillConfig, DistillGRPOConfig, TeacherConfig
from verl_trainer.engine.config import EngineConfig
from verl_trainer.models.tiny import build_tokenizer, make_tiny_model
from verl_trainer.testing import run_distributed


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"mode": "distill"}, "mode='distill'; choose one of reward, loss"),
    ({"kl_estimator": "k4"}, "kl_estimator='k4'; choose one of k1, k2, k3"),
    ({"top_k": -1}, "top_k=-1 must be an int >= 0"),
    ({"top_k_normalization": "softmax"}, "choose one of renorm, tail"),
    ({"coef": -0.1}, "coef=-0.1 must be a finite number >= 0"),
    ({"reward_weight": float("nan")}, "reward_weight=nan"),
    ({"coef": 0.0}, "nothing is learned from the teacher"),
])
def test_config_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistillConfig(**kwargs)


def test_top_k_refused_with_model_parallel_layouts():
    match = r"top_k=4 .*algorithm.distill.teacher.engine.tensor_model_parallel_size=2"
    with pytest.raises(ValueError, match=match):
        DistillGRPOConfig(distill=DistillConfig(top_k=4, teacher=TeacherConfig(
            engine=EngineConfig(tensor_model_parallel_size=2))))
    DistillGRPOConfig(distill=DistillConfig(top_k=0, teacher=TeacherConfig(
        engine=EngineConfig(tensor_model_parallel_size=2))))  # the reverse KL runs on any layout


def test_empty_teacher_path_refused_when_the_module_is_built():
    with pytest.raises(ValueError, match="teacher.model_path is empty"):
        DistillGRPO(DistillGRPOConfig(model_path="x"))


def test_teacher_with_another_tokenizer_refused(tmp_path):
    student = make_tiny_model(tmp_path / "student", arch="llama", hidden_size=32, num_attention_heads=4)
    make_tiny_model(tmp_path / "teacher", arch="llama", hidden_size=32, num_attention_heads=4)
    other = build_tokenizer()
    other.add_tokens(["<think>"])
    other.save_pretrained(tmp_path / "teacher")
    with pytest.raises(ValueError, match=r"does not share the student's tokenizer.*only the teacher's: "
                                         r"\['<think>'\]"):
        check_same_tokenizer(student, str(tmp_path / "teacher"))
    check_same_tokenizer(student, student)


def _distill_step(assets: str, teacher: str, root: str, top_k: int) -> dict:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import PromptDataModule
    from verl_trainer.callbacks import Callback
    from verl_trainer.models.loading import load_causal_lm, load_tokenizer

    cfg = short_grpo_config(f"{assets}/model", f"{assets}/data", "data.val_files=null")
    distill = DistillConfig(teacher=TeacherConfig(model_path=teacher), mode="reward", kl_estimator="k1",
                            coef=0.5, top_k=top_k, top_k_coef=1.0, top_k_normalization="tail",
                            reward_weight=0.5)
    algorithm = DistillGRPOConfig(**{**cfg.algorithm.__dict__, "distill": distill})
    logged, batches = [], []

    class Keep(Callback):
        def on_before_update(self, trainer, module, batch):
            batches.append(batch.clone())
            return batch

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items()
                           if k.startswith(("distill/", "actor/distill", "actor/pg_loss"))})

    module = DistillGRPO(algorithm)
    trainer = Trainer(max_steps=1, callbacks=[Keep()], logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, default_root_dir=root)
    trainer.fit(module, datamodule=PromptDataModule(cfg.data, load_tokenizer(f"{assets}/model")))
    batch = batches[0]
    hf = load_causal_lm(teacher, attn_implementation="sdpa")
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    log_softmax = torch.log_softmax(logits[:, :-1], -1)  # position t - 1 predicts token t
    mask = batch["response_mask"][:, 1:].bool()
    want = log_softmax.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    out = {"engines": sorted(module.engines), "metrics": logged[0],
           "log_prob_err": float((batch["teacher_log_probs"][:, 1:] - want)[mask].abs().max())}
    if top_k:
        top, ids = torch.topk(log_softmax, top_k, -1)
        out["topk_ids_equal"] = bool(torch.equal(batch["teacher_topk_ids"][:, 1:][mask], ids[mask]))
        out["topk_err"] = float((batch["teacher_topk_log_probs"][:, 1:][mask] - top[mask]).abs().max())
    scores, rewards = batch["token_level_scores"], batch["token_level_rewards"]
    dense = -0.5 * (batch["rollout_log_probs"] - batch["teacher_log_probs"]) * batch["response_mask"]
    out["reward_err"] = float((rewards - (0.5 * scores + dense)).abs().max())
    return out


def test_a_distillation_step_with_the_teacher_engine(tmp_path):
    assets = make_assets(tmp_path / "assets")
    teacher = make_tiny_model(tmp_path / "teacher", arch="llama", hidden_size=48, num_attention_heads=4,
                              num_key_value_heads=2, seed=7)  # wider, the student's tokenizer
    out = run_distributed(_distill_step, 1, str(assets), teacher, str(tmp_path / "run"), 4)[0]
    assert "teacher" in out["engines"]
    assert out["log_prob_err"] < 1e-4 and out["topk_ids_equal"] and out["topk_err"] < 1e-4
    assert out["reward_err"] < 1e-5  # 0.5 * verifiable - 0.5 * k1 per response token
    metrics = out["metrics"]
    for key in ("distill/reverse_kl", "distill/reverse_kl_k3", "distill/kl_reward", "distill/seq_reverse_kl",
                "actor/distill_topk_kl_loss"):
        assert math.isfinite(metrics[key]), key
    assert metrics["distill/reverse_kl_k3"] >= 0 and "actor/distill_kl_loss" not in metrics  # reward mode
