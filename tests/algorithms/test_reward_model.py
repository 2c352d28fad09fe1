"""A neural reward model (a tiny saved AutoModelForSequenceClassification) scored through the engine layer.

Default run: it loads as a value model with its own head and scores exactly as the sequence classifier;
the TRL-style model path among the reward functions; config errors. ``slow``: GRPO validation scored by the
reward model alone at dp=1 and at dp=2 (real gloo ranks; fsdp2, fsdp2 with the reward model's parameters
offloaded, fsdp, DeepSpeed) equals the classifier run by hand on the same greedy responses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from verl_trainer.algorithms.config import RewardConfig, RewardModelConfig
from verl_trainer.algorithms.reward_model import RewardModel, is_reward_model_dir, split_reward_models
from verl_trainer.models.loading import load_reward_model, load_tokenizer
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def make_reward_model(root: Path) -> tuple[str, str]:
    """A tiny Qwen2 policy and a tiny sequence classifier (one label) sharing its tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    policy = make_tiny_model(root / "policy", max_position_embeddings=128, seed=0)
    config = AutoConfig.from_pretrained(policy)
    config.num_labels = 1
    torch.manual_seed(7)
    classifier = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        classifier.score.weight.normal_(0, 1.0)  # scores that differ visibly between responses
    classifier.save_pretrained(root / "rm")
    load_tokenizer(policy).save_pretrained(root / "rm")
    return policy, str(root / "rm")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    return make_reward_model(tmp_path_factory.mktemp("reward_model"))


def _classifier_scores(rm: str, texts: list[str]) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm).eval()
    tok = load_tokenizer(rm)
    with torch.no_grad():
        return [float(model(torch.tensor([tok.encode(t, add_special_tokens=False)])).logits[0, 0])
                for t in texts]


def test_loads_with_its_own_head_and_scores_as_the_classifier(models):
    _, rm = models
    model = load_reward_model(rm)
    assert model.score.bias is None and not any(p.requires_grad for p in model.parameters())
    tok = load_tokenizer(rm)
    ids = torch.tensor([tok.encode("3+4=7", add_special_tokens=False)])
    with torch.no_grad():
        got = float(model(ids).logits[0, -1, 0])
    assert got == pytest.approx(_classifier_scores(rm, ["3+4=7"])[0], abs=1e-6)
    batch, truncated = RewardModel(RewardModelConfig(enable=True, path=rm, max_length=4)).inputs(
        ["3+4=", [{"role": "user", "content": "1+1="}]], ["7", "2"])
    assert truncated == 2 and batch["seq_len"].tolist() == [4, 4]  # 3 kept + the extra token


def test_not_a_reward_model_is_refused(models):
    policy, _ = models
    with pytest.raises(ValueError, match="has no trained 'score' head, so it is not a reward model"):
        load_reward_model(policy)
    with pytest.raises(ValueError, match="needs algorithm.reward.model.path"):
        RewardModelConfig(enable=True)
    with pytest.raises(ValueError, match="is not a reward model: its config.json names no"):
        RewardModel(RewardModelConfig(enable=True, path=policy))
    with pytest.raises(FileNotFoundError, match="reward.model.path='/nonexistent/rm' does not exist"):
        RewardModel(RewardModelConfig(enable=True, path="/nonexistent/rm"))


def test_trl_style_model_path_among_reward_functions(models):
    policy, rm = models
    assert is_reward_model_dir(rm) and not is_reward_model_dir(policy) and not is_reward_model_dir("math")
    split = split_reward_models(RewardConfig(name=["math", rm], weights=[1.0, 0.5]))
    assert split.name == ["math"] and split.weights == [1.0]
    assert split.model.enable and split.model.path == rm and split.model.weight == 0.5
    alone = split_reward_models(RewardConfig(name=rm))
    assert alone.name == ["none"] and alone.model.weight == 1.0
    with pytest.raises(ValueError, match="one reward model per run"):
        split_reward_models(RewardConfig(name=[rm, rm]))


def _validate(policy: str, rm: str, data: str, root: str, strategy: str = "fsdp2", *overrides: str) -> dict:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.recipe_config import GRPORecipeConfig, load_config

    cfg = load_config(GRPORecipeConfig, ROOT / "configs" / "grpo.yaml", [
        f"algorithm.model_path={policy}", f"data.train_files={data}/train.jsonl",
        f"data.val_files={data}/val.jsonl", "algorithm.rollout.max_new_tokens=4", "data.train_batch_size=4",
        "algorithm.reward.name=none", "algorithm.reward.model.enable=true",
        f"algorithm.reward.model.path={rm}",
        "algorithm.reward.model.engine.micro_batch_size_per_gpu=2", *overrides,
    ])
    trainer = Trainer(devices=dist.get_world_size(), strategy=strategy, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, default_root_dir=root)
    module = GRPO(cfg.algorithm)
    return trainer.validate(module, datamodule=PromptDataModule(cfg.data, load_tokenizer(policy)))[0]


def _greedy_texts(policy: str, data: str) -> list[str]:
    from transformers import AutoModelForCausalLM

    from verl_trainer.data.prompts import load_prompts

    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    tok = load_tokenizer(policy)
    texts = []
    for rec in load_prompts(f"{data}/val.jsonl"):
        ids = torch.tensor([tok.encode(rec["prompt"], add_special_tokens=False)])
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        texts.append(rec["prompt"] + tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return texts


@pytest.fixture(scope="module")
def scored_at_dp1(tmp_path_factory) -> tuple[Path, str, str, dict, list[float]]:
    """The assets, GRPO validation scored by the reward model at dp=1 (fsdp2), and the classifier by hand."""
    from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task

    root = tmp_path_factory.mktemp("rm_validation")
    policy, rm = make_reward_model(root)
    write_arithmetic_task(root / "data", ArithmeticTaskConfig(num_train=16, num_val=6, holdout_fraction=0.4))
    one = run_distributed(_validate, 1, policy, rm, str(root / "data"), str(root / "one"), timeout=300)
    expected = _classifier_scores(rm, _greedy_texts(policy, str(root / "data")))
    return root, policy, rm, one[0], expected


@pytest.mark.slow  # ~30 s a case: GRPO validation at dp=2
@pytest.mark.parametrize(("strategy", "overrides"), [
    ("fsdp2", ()),
    ("fsdp2", ("algorithm.reward.model.engine.param_offload=true",)),  # offloaded between uses, as the ref
    ("fsdp", ()),
    ("deepspeed", ()),
], ids=["fsdp2", "fsdp2-param_offload", "fsdp", "deepspeed"])
def test_validation_scored_by_the_reward_model_at_dp2_equals_dp1_and_the_classifier(scored_at_dp1, tmp_path,
                                                                                    strategy, overrides):
    root, policy, rm, one, expected = scored_at_dp1
    two = run_distributed(_validate, 2, policy, rm, str(root / "data"), str(tmp_path / "two"), strategy,
                          *overrides, timeout=300)
    mean = sum(expected) / len(expected)
    assert max(expected) - min(expected) > 1e-3, "the responses must score differently"
    assert one["val/reward/mean"] == pytest.approx(mean, rel=1e-4, abs=1e-5)
    assert one["val/reward/model"] == pytest.approx(mean, rel=1e-4, abs=1e-5)
    assert two[0] == two[1]
    for key in ("val/reward/mean", "val/reward/min", "val/reward/max"):
        assert two[0][key] == pytest.approx(one[key], rel=1e-4, abs=1e-5), key
    assert two[0]["val/reward/model/truncated"] == 0.0
