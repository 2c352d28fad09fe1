"""Tools and environments that hang, on the HF rollout with a real tiny model: each call returns within its
limit (``tool_timeout_s`` / ``environment_timeout_s``), becomes an error observation or the trajectory's end,
is counted in ``agent/*`` metrics, and a process whose tool or environment hangs for good exits by itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.agents.common import QUESTIONS, prompts, tool_policy
from verl_trainer.agents import Environment, MultiTurnConfig, StepResult, Tool, as_tool, calculator
from verl_trainer.metrics.metric import Reduction
from verl_trainer.rollout import AGENT_INFO, RolloutConfig, build_rollout
from verl_trainer.rollout.agent_loop import agent_rewards_and_metrics

RELEASE = threading.Event()  # set after each test: no thread outlives its test


@pytest.fixture(autouse=True)
def _release_hanging_calls():
    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    return tool_policy(tmp_path_factory.mktemp("tool_policy") / "model")


class HangingCalculator(Tool):
    name = "calculator"

    def schema(self):
        return as_tool(calculator).schema()

    def execute(self, instance_id, arguments):
        RELEASE.wait(3600)
        return "late"


class HangingStep(Environment):
    def step(self, message):
        RELEASE.wait(3600)
        return StepResult("late", 1.0, False)


class HangingReset(Environment):
    stepped = 0

    def reset(self, row):
        RELEASE.wait(3600)

    def step(self, message):
        HangingReset.stepped += 1
        return StepResult("", 1.0, True)


def generate(model: str, multi_turn: MultiTurnConfig, questions=QUESTIONS[:2]):
    rollout = build_rollout(RolloutConfig(device="cpu", max_new_tokens=200, do_sample=False,
                                          multi_turn=multi_turn), model)
    begin = time.monotonic()
    batch = rollout.generate(prompts(model, questions))
    return batch, time.monotonic() - begin


def test_a_hanging_tool_is_a_timeout_observation_and_counted(policy):
    multi_turn = MultiTurnConfig(enable=True, tools=[HangingCalculator], tool_timeout_s=0.5)
    batch, seconds = generate(policy, multi_turn)
    assert seconds < 20  # one 0.5 s wait per turn, not 3600 s
    for info in batch[AGENT_INFO]:
        assert info["tool_calls"] == 1 and info["tool_timeouts"] == 1 and info["turns"] == 2
        tool = next(m for m in info["messages"] if m["role"] == "tool")
        assert tool["content"] == "Error: the tool call ran past 0.5 s and was abandoned"
    _, metrics = agent_rewards_and_metrics(batch)
    assert metrics["agent/tool_timeouts"].reduction is Reduction.MEAN
    assert float(metrics["agent/tool_timeouts"].aggregate()) == 1.0


@pytest.mark.parametrize("env", [HangingStep, HangingReset])
def test_a_hanging_environment_ends_the_trajectory_and_is_counted(policy, env):
    multi_turn = MultiTurnConfig(enable=True, environment=env, environment_timeout_s=0.5, max_turns=3)
    batch, seconds = generate(policy, multi_turn)  # its first turn ends with eos: the environment answers
    assert seconds < 20
    for info in batch[AGENT_INFO]:
        assert info["env_timeouts"] == 1 and info["env_errors"] == 0 and info["turns"] == 1
        assert info["reward"] == 0.0  # the late step's reward is not counted
    assert HangingReset.stepped == 0  # an environment whose reset failed takes no step
    _, metrics = agent_rewards_and_metrics(batch)
    assert metrics["agent/env_timeouts"].reduction is Reduction.MEAN
    assert float(metrics["agent/env_timeouts"].aggregate()) == 1.0
    assert float(metrics["agent/env_errors"].aggregate()) == 0.0


def test_environment_timeout_is_checked_when_the_config_is_made():
    for value in (0, -1.0, float("inf"), "5", True):
        with pytest.raises(ValueError, match=r"multi_turn.environment_timeout_s=.* must be a number of "
                                             r"seconds in \(0, inf\) \(default 30\)"):
            MultiTurnConfig(environment_timeout_s=value)


def test_a_process_whose_tool_and_environment_hang_forever_exits_by_itself(policy, tmp_path):
    (tmp_path / "forever.py").write_text(textwrap.dedent("""
        import time
        from verl_trainer.agents import Environment, StepResult, Tool, as_tool, calculator

        class Calculator(Tool):
            name = "calculator"
            def schema(self):
                return as_tool(calculator).schema()
            def execute(self, instance_id, arguments):
                time.sleep(3600)

        class Forever(Environment):
            def step(self, message):
                time.sleep(3600)
    """))
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from tests.agents.common import prompts
        from verl_trainer.agents import MultiTurnConfig
        from verl_trainer.rollout import AGENT_INFO, RolloutConfig, build_rollout
        forever = {str(tmp_path / 'forever.py')!r}
        for model, multi_turn in [  # the policy's first turn is a tool call ending with eos
            ({policy!r}, MultiTurnConfig(enable=True, tools=[forever + ":Calculator"], tool_timeout_s=0.5)),
            ({policy!r}, MultiTurnConfig(enable=True, environment=forever + ":Forever",
                                               environment_timeout_s=0.5)),
        ]:
            rollout = build_rollout(RolloutConfig(device="cpu", max_new_tokens=200, do_sample=False,
                                                  multi_turn=multi_turn), model)
            infos = rollout.generate(prompts(model))[AGENT_INFO]
            print("timeouts", sum(i["tool_timeouts"] + i["env_timeouts"] for i in infos))
    """)
    begin = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["timeouts", str(len(QUESTIONS))] * 2
    assert time.monotonic() - begin < 90  # imports, two tiny rollouts, 2 x 0.5 s; never the sleeping threads
