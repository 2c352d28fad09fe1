import pytest
import torch
from tensordict import NonTensorStack

from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.metrics import reduce_metrics
from verl_trainer.models import build_tokenizer
from verl_trainer.rewards import (
    DEFAULT_REWARD,
    FORMAT_SCORE,
    answers_match,
    available_rewards,
    compute_rewards,
    extract_answer,
    get_reward_fn,
    is_well_formatted,
    math_reward,
    parse_number,
    register_reward,
    reward_metrics,
    score_batch,
    token_level_scores,
)
from verl_trainer.rewards.failures import RewardError
from verl_trainer.rewards.registry import REWARD_REGISTRY


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("7", "7"),
        ("The sum is 12 and then 15", "15"),
        ("step 1\n#### 1,234", "1,234"),
        ("#### -3.5 dollars", "-3.5"),
        ("so \\boxed{42}.", "42"),
        ("2 then #### 5 then 9", "5"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_parse_and_match():
    assert parse_number(" 1,234 ") == 1234.0
    assert parse_number("$5.") == 5.0
    assert parse_number(7) == 7.0
    assert parse_number("seven") is None
    assert parse_number(True) is None
    assert answers_match("7", "7") and answers_match("7.0", 7) and answers_match("1,000", "1000")
    assert answers_match("12", "Natalia sold 48/2 = 24 clips.\n#### 12")  # GSM8K-style ground truth
    assert not answers_match("8", "7") and not answers_match(None, "7") and not answers_match("7", None)
    assert answers_match("abc", " abc ") and not answers_match("abc", "abd")


@pytest.mark.parametrize(
    ("text", "ok"),
    [("7", True), (" 18 ", True), ("-3", True), ("reasoning #### 12", True), ("x \\boxed{3}", True),
     ("77a", False), ("7 8", False), ("", False), ("the answer is 7", False)],
)
def test_format(text, ok):
    assert is_well_formatted(text) is ok


def test_builtin_scores():
    fn = get_reward_fn("math_exact")
    assert fn("arithmetic", "7", "7") == {"score": 1.0, "acc": 1.0}
    assert fn("arithmetic", "the answer is 7", "7")["score"] == 1.0
    assert fn("arithmetic", "8", "7")["score"] == 0.0
    fmt = get_reward_fn("format")
    assert fmt("a", "12", "7")["score"] == 1.0 and fmt("a", "12 apples", "7")["score"] == 0.0
    assert get_reward_fn(DEFAULT_REWARD) is math_reward is get_reward_fn("default")
    assert math_reward("a", "7", "7")["score"] == 1.0
    assert math_reward("a", "8", "7") == {"score": FORMAT_SCORE, "acc": 0.0, "format": 1.0}
    assert math_reward("a", "x8y", "7")["score"] == 0.0
    assert math_reward("a", "it is 7", "7")["score"] == 1.0  # correct counts even when loosely formatted
    assert {"math", "math_exact", "format", "default"} <= set(available_rewards())


def test_registry_errors_and_user_registration():
    with pytest.raises(ValueError, match="unknown reward function 'nope'.*'math_exact'"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math")(lambda *a, **k: 0.0)

    @register_reward("test_constant")
    def constant(data_source, solution_str, ground_truth):
        return 0.5

    try:
        assert get_reward_fn("test_constant") is constant
        # a function without extra_info is called without it
        assert compute_rewards(["a"], ["b"], ["c"], "test_constant").tolist() == [0.5]
    finally:
        REWARD_REGISTRY.remove("test_constant")


def test_module_function_loading(tmp_path, monkeypatch):
    pkg = tmp_path / "my_rewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scores.py").write_text(
        "def length_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    bonus = (extra_info or {}).get('bonus', 0.0)\n"
        "    return {'score': len(solution_str) + bonus, 'acc': float(solution_str == ground_truth)}\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_fn("my_rewards_pkg.scores:length_score")
    scores, info = compute_rewards(["ab", "abc"], ["ab", "x"], ["s", "s"], fn,
                                   extra_infos=[{"bonus": 1.0}, None], return_info=True)
    assert scores.tolist() == [3.0, 3.0]
    assert info["acc"].tolist() == [1.0, 0.0]
    from_file = get_reward_fn(f"{pkg / 'scores.py'}:length_score")
    assert from_file("s", "abcd", "x") == {"score": 4, "acc": 0.0}
    (pkg / "wrong.py").write_text("def reward(text):\n    return 0.0\n")
    with pytest.raises(ValueError, match=r"wrong.py:reward has the signature \(text\).*compute_score"):
        get_reward_fn(f"{pkg / 'wrong.py'}:reward")  # when the config is loaded, not at the first step
    with pytest.raises(ValueError, match="signature"):
        get_reward_fn(len)
    with pytest.raises(ValueError, match="cannot import module"):
        get_reward_fn("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        get_reward_fn("my_rewards_pkg.scores:missing")
    with pytest.raises(ValueError, match="not a callable"):
        get_reward_fn("my_rewards_pkg.scores:NOT_CALLABLE")
    with pytest.raises(ValueError, match="does not exist"):
        get_reward_fn(f"{tmp_path / 'absent.py'}:fn")


def test_compute_rewards_checks():
    with pytest.raises(ValueError, match="must match"):
        compute_rewards(["a", "b"], ["1"], ["s", "s"], "math")
    with pytest.raises(RewardError, match="without 'score'"):
        compute_rewards(["a"], ["1"], ["s"], lambda *a, **k: {"acc": 1.0})
    scores = compute_rewards(["7", "8", "x"], ["7", "7", "7"], ["s"] * 3, "math")
    assert scores.dtype == torch.float32 and scores.tolist() == pytest.approx([1.0, FORMAT_SCORE, 0.0])


def test_token_level_scores_on_last_response_token():
    batch = make_batch([[5, 6], [5], [7, 8, 9]], [[3, 4, 2], [3], []])
    scores = torch.tensor([1.0, -0.5, 2.0])
    out = token_level_scores(scores, batch[schema.RESPONSE_MASK])
    assert out.shape == batch[schema.INPUT_IDS].shape
    expected = torch.zeros_like(out)
    expected[0, 4] = 1.0
    expected[1, 1] = -0.5  # row 2 has no response: all zero
    assert torch.equal(out, expected)
    assert torch.equal((out * batch[schema.RESPONSE_MASK]).sum(-1), torch.tensor([1.0, -0.5, 0.0]))
    with pytest.raises(ValueError, match="expected"):
        token_level_scores(torch.zeros(2), batch[schema.RESPONSE_MASK])


def test_reward_metrics_ignore_padding_and_split_evenly():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.1, 9.0])
    info = {"acc": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])}
    uids = torch.tensor([0, 0, 1, 1, 2, 3])
    padding = torch.tensor([False, False, False, False, False, True])
    whole = reduce_metrics([reward_metrics(scores, info, uids, padding)])
    assert whole["reward/mean"] == pytest.approx(3.1 / 5)
    assert whole["reward/min"] == 0.0 and whole["reward/max"] == 1.0
    assert whole["reward/accuracy"] == pytest.approx(3 / 5)
    assert whole["reward/zero_std_group_frac"] == pytest.approx(2 / 3)  # groups 1 and 2 (size 1)
    # Reduced over pieces (micro-batches or ranks holding whole groups), the values are the same.
    parts = [reward_metrics(scores[s], {"acc": info["acc"][s]}, uids[s], padding[s]) for s in
             (slice(0, 2), slice(2, 6))]
    assert reduce_metrics(parts) == pytest.approx(whole)
    empty = reward_metrics(torch.zeros(1), None, None, torch.tensor([True]))
    assert reduce_metrics([parts[0], empty])["reward/mean"] == pytest.approx(0.5)


def test_score_batch_from_rollout_style_batch():
    tok = build_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prompts = [enc("3+4="), enc("3+4="), enc("1+1=")]
    responses = [enc("7") + [2], enc("8") + [2], enc("2")]
    batch = make_batch(prompts, responses, uids=[0, 0, 1])
    batch["ground_truth"] = NonTensorStack.from_list(["7", "7", "2"])
    batch["data_source"] = NonTensorStack.from_list(["arithmetic"] * 3)
    scores, metrics = score_batch(batch, "math", tokenizer=tok)  # decodes: no response_text
    assert scores.tolist() == pytest.approx([1.0, FORMAT_SCORE, 1.0])
    tls = batch[schema.TOKEN_LEVEL_SCORES]
    assert torch.allclose(tls.sum(-1), scores)
    assert tls[0, 5] == 1.0 and tls[2, 4] == 1.0  # the eos of row 0, the last token of row 2
    reduced = reduce_metrics([metrics])
    assert reduced["reward/accuracy"] == pytest.approx(2 / 3)
    assert reduced["reward/zero_std_group_frac"] == pytest.approx(0.5)
    batch["response_text"] = NonTensorStack.from_list(["7", "7", "7"])
    scores, _ = score_batch(batch, "math_exact", prefix="val/reward")
    assert scores.tolist() == [1.0, 1.0, 0.0]
