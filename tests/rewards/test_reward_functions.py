"""Reward functions with TRL's batched signature, several functions with weights, per-function means
(issue 16 item 5)."""

from __future__ import annotations

import math

import pytest
import torch

from verl_trainer.algorithms.config import RewardConfig
from verl_trainer.data.prompts import load_prompts, save_rows
from verl_trainer.metrics import reduce_metrics
from verl_trainer.rewards import RewardFunctions, compute_rewards, reward_metrics
from verl_trainer.rewards.signature import TRL, VERL, reward_style


def trl_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def trl_chat_and_columns(prompts, completions, ground_truth, difficulty, **kwargs):
    # conversational data: completions are assistant messages; other columns arrive by name
    return [float(c[0]["content"] == gt) * d if d is not None else None
            for c, gt, d in zip(completions, ground_truth, difficulty)]


def verl_exact(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "acc": float(solution_str == ground_truth)}


def test_styles_are_told_apart_by_the_signature():
    assert reward_style(trl_length, "trl_length") == TRL
    assert reward_style(trl_chat_and_columns, "x") == TRL
    assert reward_style(verl_exact, "verl_exact") == VERL
    assert reward_style(lambda data_source, solution_str, ground_truth: 0.0, "l") == VERL
    with pytest.raises(ValueError, match=r"has the signature \(data_source, text\), which is neither"):
        reward_style(lambda data_source, text: 0.0, "f")
    with pytest.raises(ValueError, match="neither verl's compute_score"):
        reward_style(lambda text: 0.0, "g")


def test_a_trl_function_alone_scores_the_batch_in_one_call():
    calls = []

    def counting(completions, **kwargs):
        calls.append(sorted(kwargs))
        return [1.0, 2.0, 3.0]

    scores = compute_rewards(["a", "bb", "ccc"], ["1", "2", "3"], ["s"] * 3, counting,
                             columns=[{"prompt": "p"}] * 3)
    assert scores.tolist() == [1.0, 2.0, 3.0]
    assert calls == [["data_source", "extra_info", "ground_truth", "prompts"]]
    with pytest.raises(ValueError, match=r"needs the columns \['answer'\], which the prompt file does not"):
        compute_rewards(["a"], ["1"], ["s"], lambda completions, answer, **k: [1.0],
                        columns=[{"prompt": "p"}])
    with pytest.raises(ValueError, match="returned 1 values for 3 completions; it must return one number"):
        compute_rewards(["a", "b", "c"], ["1"] * 3, ["s"] * 3, lambda completions, **k: [1.0])


def test_weighted_functions_chat_columns_none_and_per_function_means(tmp_path):
    rows = [
        {"data_source": "d", "prompt": [{"role": "user", "content": "1+1="}],
         "reward_model": {"ground_truth": "2"}, "difficulty": 2.0},
        {"data_source": "d", "prompt": [{"role": "user", "content": "2+2="}],
         "reward_model": {"ground_truth": "4"}, "difficulty": None},
    ]
    records = load_prompts(save_rows(rows, tmp_path / "p.jsonl"))
    assert records[0]["columns"] == {"prompt": rows[0]["prompt"], "difficulty": 2.0}
    functions = RewardFunctions([trl_chat_and_columns, verl_exact, trl_length], weights=[1.0, 0.5, 0.1])
    texts, truths = ["2", "5"], ["2", "4"]
    scores, info = functions(texts, truths, ["d", "d"], [{}, {}], [r["columns"] for r in records])
    # sample 0: 1*2 (difficulty) + 0.5*1 + 0.1*1 ; sample 1: None (counts 0) + 0.5*0 + 0.1*1
    assert scores.tolist() == pytest.approx([2.6, 0.1])
    assert info["trl_chat_and_columns/mean"][0] == 2.0 and math.isnan(info["trl_chat_and_columns/mean"][1])
    assert info["verl_exact/acc"].tolist() == [1.0, 0.0]
    metrics = reduce_metrics([reward_metrics(scores, info)])
    assert metrics["reward/trl_chat_and_columns/mean"] == pytest.approx(2.0)  # the None is left out
    assert metrics["reward/verl_exact/mean"] == pytest.approx(0.5)
    assert metrics["reward/mean"] == pytest.approx(1.35)


def test_reward_config_checks_names_and_weights():
    assert RewardConfig(name=["math", "format"], weights=[1.0, 0.5]).weights == [1.0, 0.5]
    with pytest.raises(ValueError, match=r"weights=\[1.0\] has 1 entries for 2 reward functions"):
        RewardConfig(name=["math", "format"], weights=[1.0])
    with pytest.raises(ValueError, match="give a reward name"):
        RewardConfig(name=[])
    with pytest.raises(ValueError, match="give a reward name"):
        RewardConfig(name=[3])

    def short(completions, **kwargs):
        return [1.0 / (1 + len(c)) for c in completions]

    assert RewardConfig(name=short).name is short  # Python configs pass the function itself (TRL's way)
    assert RewardFunctions(RewardConfig(name=[short, "math"]).name).names == ["short", "math"]
    with pytest.raises(ValueError, match="3 weights"):
        RewardFunctions(["math"], weights=[1, 2, 3])
    assert torch.equal(RewardFunctions("math")(["7"], ["7"], ["a"])[0], torch.tensor([1.0]))


def test_non_finite_scores_stay_non_finite_and_only_none_counts_zero():
    """Issue 32 item 1: NaN / inf reach the non-finite guard as they are; a TRL ``None`` counts 0."""

    def trl_raw(completions, **kwargs):
        return [None, math.nan, math.inf, -math.inf, 1.0]

    texts = ["a", "b", "c", "d", "e"]
    alone = compute_rewards(texts, ["1"] * 5, ["s"] * 5, trl_raw)
    assert alone[0] == 0.0 and math.isnan(alone[1]) and alone[2] == math.inf and alone[3] == -math.inf
    assert alone[4] == 1.0

    def verl_nan_on_b(data_source, solution_str, ground_truth, extra_info=None):
        return math.nan if solution_str == "b" else 0.5

    both = RewardFunctions([trl_raw, verl_nan_on_b], weights=[2.0, 1.0])
    total, info = both(texts, ["1"] * 5, ["s"] * 5)
    assert total[0] == 0.5  # None (0) + 0.5
    assert math.isnan(total[1]) and total[2] == math.inf and total[3] == -math.inf
    assert total[4] == 2.5
    # the per-function mean leaves the None out; the raw non-finite values stay in
    assert math.isnan(info["trl_raw/mean"][0]) and info["trl_raw/mean"][2] == math.inf
