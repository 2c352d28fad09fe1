"""pass@k / maj@k ... in validation: padding samples left out, exact over batches and 2 real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tensordict import NonTensorStack

from tests.trainer.common import tiny_model
from verl_trainer.algorithms.config import ValidationRolloutConfig
from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.data.prompts import save_rows, to_verl_row
from verl_trainer.evaluate.validation import batch_prompt_samples, validation_metrics
from verl_trainer.metrics import MetricAccumulator
from verl_trainer.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _batch(uids, texts, sources, padding):
    batch = make_batch([[1, 2]] * len(uids), [[3]] * len(uids), uids=torch.tensor(uids))
    batch["response_text"] = NonTensorStack.from_list(texts)
    batch["data_source"] = NonTensorStack.from_list(sources)
    schema.mark_padding(batch, torch.tensor(padding))
    return batch


def test_padding_samples_are_left_out_and_batches_reduce_exactly():
    # prompt 0 (src a): 1 of 2 correct; prompt 1 (src b): 2 of 2; prompt 2: a padding repeat of prompt 0
    first = _batch([0, 0, 1, 1], ["#### 4", "#### 5", "#### 9", "#### 9"], ["a", "a", "b", "b"],
                   [False] * 4)
    second = _batch([2, 2, 0, 0], ["#### 1", "#### 1", "#### 4", "#### 4"], ["a", "a", "a", "a"],
                    [False, False, True, True])
    prompts_1 = batch_prompt_samples(first, torch.tensor([1.0, 0.0, 1.0, 1.0]),
                                     {"acc": torch.tensor([1.0, 0.0, 1.0, 1.0])})
    prompts_2 = batch_prompt_samples(second, torch.tensor([0.0, 0.0, 1.0, 1.0]), {})  # acc from threshold
    got_1 = [(p.index, p.num_correct, p.answers) for p in prompts_1]
    assert got_1 == [(0, 1, ["4", "5"]), (1, 2, ["9", "9"])]
    assert [(p.index, p.n) for p in prompts_2] == [(2, 2)], "the padding samples belong to no prompt"
    acc = MetricAccumulator()
    acc.update(validation_metrics(prompts_1, [1, 2]))
    acc.update(validation_metrics(prompts_2, [1, 2]))
    got = acc.compute(sync_dist=False)
    assert got["val/pass@1"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert got["val/pass@2"] == pytest.approx((1 + 1 + 0) / 3)
    assert got["val/maj@2"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert got["val/a/pass@2"] == pytest.approx(0.5) and got["val/b/pass@2"] == 1.0
    assert got["val/b/worst@2"] == 1.0 and got["val/a/best@2"] == pytest.approx(0.5)


def test_validation_k_defaults_and_errors():
    assert ValidationRolloutConfig().ks == []
    assert ValidationRolloutConfig(n=6, do_sample=True).ks == [1, 2, 4, 6]
    assert ValidationRolloutConfig(n=4, do_sample=True, k=[4, 1]).ks == [1, 4]
    with pytest.raises(ValueError, match=r"every k must be an int in \[1, n=4\]"):
        ValidationRolloutConfig(n=4, do_sample=True, k=[8])
    with pytest.raises(ValueError, match="identical greedy responses"):
        ValidationRolloutConfig(n=4)


def truth_score(data_source: str, solution_str: str, ground_truth: str,
                extra_info: dict | None = None) -> dict:
    """The ground truth as the score; correct when it is even (the same for every sample of a prompt)."""
    value = float(ground_truth)
    return {"score": value, "acc": float(value % 2 == 0)}


def _validate(model: str, data: str, root: str) -> dict[str, float]:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.recipe_config import GRPORecipeConfig, load_config

    cfg = load_config(GRPORecipeConfig, ROOT / "configs" / "grpo.yaml", [
        f"algorithm.model_path={model}", f"data.train_files={data}", f"data.val_files={data}",
        "algorithm.rollout.max_new_tokens=2", "algorithm.val_rollout.n=4",
        "algorithm.val_rollout.do_sample=true",
        "algorithm.val_rollout.k=[1,2,4]", "data.train_batch_size=2",
        "algorithm.reward.name=tests.evaluate.test_validation_metrics:truth_score",
    ])
    trainer = Trainer(devices=dist.get_world_size(), logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root)
    data_module = PromptDataModule(cfg.data, load_tokenizer(model))
    return trainer.validate(GRPO(cfg.algorithm), datamodule=data_module)[0]


@pytest.mark.slow
def test_grpo_validation_reports_pass_at_k_per_source_at_2_ranks(tmp_path):
    pairs = [(1, 2), (3, 3), (2, 2), (5, 0), (4, 4)]  # 5 prompts on 2 ranks: one padding repeat
    rows = [to_verl_row(f"{a}+{b}=", str(a + b), "src_a" if i < 3 else "src_b")
            for i, (a, b) in enumerate(pairs)]
    save_rows(rows, tmp_path / "val.jsonl")
    results = run_distributed(_validate, 2, tiny_model(tmp_path / "model"), str(tmp_path / "val.jsonl"),
                              str(tmp_path), timeout=300)
    assert results[0] == results[1]
    got = results[0]
    truths = [a + b for a, b in pairs]
    even = [float(t % 2 == 0) for t in truths]
    for k in (1, 2, 4):  # every sample of a prompt scores alike: pass@k is the fraction of even prompts
        assert got[f"val/pass@{k}"] == pytest.approx(sum(even) / 5)
        assert got[f"val/best@{k}"] == got[f"val/worst@{k}"] == pytest.approx(sum(truths) / 5)
        assert got[f"val/src_a/pass@{k}"] == pytest.approx(sum(even[:3]) / 3)
        assert got[f"val/src_b/mean@{k}"] == pytest.approx((truths[3] + truths[4]) / 2)
        # a correct winner needs a correct prompt
        assert 0.0 <= got[f"val/maj@{k}"] <= got[f"val/pass@{k}"] + 1e-9
