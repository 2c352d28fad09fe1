"""Reward functions under ``algorithm.reward.timeout_s``: a hanging verl- or TRL-style function (loaded by
name from a file, as a user names it) returns within the limit as a counted time-out handled by ``on_error``,
and a process scoring with one exits by itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from tensordict import NonTensorStack

from verl_trainer.algorithms.config import RewardConfig
from verl_trainer.algorithms.stages.guard import check_reward_failures
from verl_trainer.data.packing import make_batch
from verl_trainer.rewards import RewardFunctions, compute_rewards, score_responses
from verl_trainer.rewards.failures import RewardError

HANGING = '''
import threading
RELEASE = threading.Event()  # the test sets it when done, so no thread outlives the test


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        RELEASE.wait(3600)
    return 1.0


def trl_reward(prompts, completions, **kwargs):
    if "hang" in completions:
        RELEASE.wait(3600)
    return [1.0] * len(completions)
'''


@pytest.fixture
def hanging(tmp_path: Path):
    path = tmp_path / "hanging_reward.py"
    path.write_text(HANGING)
    functions = []
    yield str(path), functions
    for fns in functions:
        for fn in fns.functions:
            fn.__globals__["RELEASE"].set()


def _batch(texts: list[str]):
    batch = make_batch([[4, 5]] * len(texts), [[6]] * len(texts), uids=list(range(len(texts))))
    batch["response_text"] = NonTensorStack.from_list(texts)
    batch["data_source"] = NonTensorStack.from_list(["mine"] * len(texts))
    batch["ground_truth"] = NonTensorStack.from_list(["1"] * len(texts))
    return batch


@pytest.mark.parametrize("name, timed_out", [("compute_score", [0, 1, 0, 1]), ("trl_reward", [1, 1, 1, 1])])
def test_a_hanging_reward_function_times_out_and_is_counted(hanging, name, timed_out):
    path, made = hanging
    config = RewardConfig(name=f"{path}:{name}", on_error="zero", timeout_s=0.5)
    fns = RewardFunctions(config.name, config.weights, config.on_error, config.timeout_s)
    made.append(fns)
    batch = _batch(["ok", "hang", "ok", "hang"])
    begin = time.monotonic()
    scores, info = score_responses(batch, fns, raise_on_error=False)
    assert time.monotonic() - begin < 20  # 0.5 s per hanging call, not 3600
    assert info["_timed_out"].tolist() == timed_out
    assert scores.tolist() == [0.0 if t else 1.0 for t in timed_out]
    metrics = {}
    check_reward_failures(fns, batch, scores, info, 1, None, metrics)
    assert metrics == {"reward/errors": 0.0, "reward/timeouts": float(sum(timed_out))}
    assert "ran past its 0.5 s limit" in fns.failures[0].message
    assert "algorithm.reward.timeout_s=0.5" in fns.failures[0].message
    fns.on_error = "error"
    with pytest.raises(RewardError, match=rf"reward function {name} timed out on sample \d"):
        fns.raise_failures()


def test_without_a_limit_the_call_runs_on_the_calling_thread(hanging):
    path, _ = hanging
    seen = []

    def where(data_source, solution_str, ground_truth):
        seen.append(threading.current_thread())
        return 1.0

    assert compute_rewards(["a"], ["1"], ["x"], RewardFunctions(where, timeout_s=None)).tolist() == [1.0]
    assert compute_rewards(["a"], ["1"], ["x"], RewardFunctions(where)).tolist() == [1.0]
    assert seen[0] is threading.current_thread() and seen[1].daemon and seen[1] is not seen[0]


def test_a_function_with_signal_time_outs_fails_naming_the_fix():
    """math_verify's default time-outs use signal.alarm, which only works on the main thread."""
    import signal

    def alarmed(data_source, solution_str, ground_truth):
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        return 1.0

    with pytest.raises(RewardError, match=r"signal-based time-outs.*parsing_timeout=None.*timeout_s=null"):
        compute_rewards(["a"], ["1"], ["x"], RewardFunctions(alarmed))
    assert compute_rewards(["a"], ["1"], ["x"], RewardFunctions(alarmed, timeout_s=None)).tolist() == [1.0]


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), True, "10"])
def test_a_bad_timeout_is_refused_with_the_valid_range(value):
    with pytest.raises(ValueError, match=rf"algorithm.reward.timeout_s={value!r} must be a number of "
                                         r"seconds in \(0, inf\).* or null"):
        RewardConfig(timeout_s=value)
    assert RewardConfig(timeout_s=None).timeout_s is None and RewardConfig().timeout_s == 60.0


def test_a_process_scoring_with_a_hanging_reward_exits_by_itself(tmp_path):
    (tmp_path / "forever.py").write_text(textwrap.dedent("""
        import time
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            time.sleep(3600)
    """))
    script = textwrap.dedent(f"""
        from verl_trainer.rewards import RewardFunctions, compute_rewards
        fns = RewardFunctions({str(tmp_path / 'forever.py')!r} + ":compute_score", on_error="zero",
                              timeout_s=0.5)
        print("scores", compute_rewards(["a", "b"], ["1", "1"], ["x", "x"], fns).tolist(),
              "timeouts", sum(f.timeout for f in fns.failures))
    """)
    begin = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "scores [0.0, 0.0] timeouts 2" in done.stdout
    assert time.monotonic() - begin < 60  # imports (torch) and 2 x 0.5 s; the sleeping threads do not hold it
