"""default_compute_score: dispatch by data source, LaTeX equivalence through math-verify, time limits."""

from __future__ import annotations

import time

import pytest

from verl_trainer.rewards import (
    KNOWN_DATA_SOURCES,
    RewardTimeoutError,
    check_data_sources,
    configure_score_pool,
    default_compute_score,
    get_reward_fn,
    last_boxed,
)
from verl_trainer.utils.timeout_pool import CallFailedError, CallTimeoutError, TimeoutPool


@pytest.fixture(scope="module", autouse=True)
def _pool():
    configure_score_pool(num_workers=1, timeout_s=20.0)  # a loaded CI machine; tests below set their own
    yield
    configure_score_pool()


def _acc(source: str, response: str, truth: str) -> float:
    out = default_compute_score(source, response, truth)
    assert out["score"] == out["acc"] or source == "arithmetic"
    return out["acc"]


@pytest.mark.parametrize("response, truth, expected", [
    (r"so the answer is \boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\sqrt{2}/2", 1.0),
    (r"we get \boxed{\dfrac{3}{4}}.", r"\frac{3}{4}", 1.0),
    (r"\boxed{x^2+2x+1}", r"(x+1)^2", 1.0),
    (r"\boxed{\{1, 2\}}", r"\{2, 1\}", 1.0),
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0.0),
    (r"\boxed{1,000}", "1000", 1.0),
    ("no boxed answer, just 7", r"\frac{1}{2}", 0.0),
])
def test_math_latex_equivalence(response, truth, expected):
    assert _acc("HuggingFaceH4/MATH-500", response, truth) == expected


def test_gsm8k_and_arithmetic():
    assert _acc("openai/gsm8k", "3 + 4 = 7 apples, so #### 1,234", "1234") == 1.0
    assert _acc("openai/gsm8k", "Natalia sold ... #### 72", "She sold 48/2 = 24 ... #### 72") == 1.0
    assert _acc("openai/gsm8k", "the answer is 1234", "1234") == 0.0  # no ####
    assert default_compute_score("arithmetic", "7", "7") == {"score": 1.0, "acc": 1.0, "format": 1.0}
    assert default_compute_score("arithmetic", "8", "7")["score"] == pytest.approx(0.1)
    assert get_reward_fn("default_compute_score") is default_compute_score


def test_unknown_data_source_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"no scorer for the data source\(s\) \['my_task'\]") as err:
        default_compute_score("my_task", "x", "y")
    assert all(s in str(err.value) for s in KNOWN_DATA_SOURCES)
    check_data_sources(["openai/gsm8k", "arithmetic"])


def test_last_boxed_keeps_nested_braces():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{3} and an unclosed \boxed{4") == "3"
    assert last_boxed("nothing") is None


def test_a_pathological_expression_times_out_and_the_pool_goes_on():
    _acc("math", r"\boxed{1}", "1")  # the worker is up
    configure_score_pool(num_workers=1, timeout_s=2.0)
    try:
        with pytest.raises(RewardTimeoutError, match=r"data source 'math' ran past 2 s .*9\^\{9\^\{9"):
            default_compute_score("math", r"\boxed{9^{9^{9^{9}}}}", "1")
        configure_score_pool(num_workers=1, timeout_s=20.0)
        assert _acc("math", r"\boxed{2}", "2") == 1.0
    finally:
        configure_score_pool(num_workers=1, timeout_s=20.0)


def test_timeout_pool_kills_only_the_slow_call():
    pool = TimeoutPool(num_workers=2, timeout_s=3.0)
    try:
        started = time.monotonic()
        out = pool.map(time.sleep, [(60,), (0,), (0,), (0,)])
        assert isinstance(out[0], CallTimeoutError) and out[1:] == [None, None, None]
        assert time.monotonic() - started < 50 and pool.timeouts == 1
        failed = pool.map(int, [("x",), ("5",)])
        assert isinstance(failed[0], CallFailedError) and "invalid literal" in str(failed[0])
        assert failed[1] == 5
    finally:
        pool.close()
    with pytest.raises(ValueError, match="timeout_s=0 must be > 0"):
        TimeoutPool(timeout_s=0)
