"""GRPO with the calculator tool, at dp=1 and at dp=2 with dynamic micro-batches (real gloo ranks): the same
multi-turn trajectories, the same losses and metrics and the same final weights; the loss mask covers
exactly the model's tokens. Validation after the fit reports the agent metrics (``val/agent/*``) with the
same values at both sizes: 3 validation prompts on 2 ranks make one padding sample, which must count
nowhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.agents.common import fit_grpo_tools, tool_assets
from verl_trainer.testing import run_distributed

STEPS = 2
VAL_ROWS = 3
AGENT_VAL = ("val/agent/turns", "val/agent/tool_calls", "val/agent/tool_errors", "val/agent/correct_tool_use",
             "val/agent/tool_calls/calculator", "val/agent/tool_token_share", "val/reward/mean")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return tool_assets(tmp_path_factory.mktemp("grpo_tools"), VAL_ROWS)


@pytest.mark.slow
def test_grpo_with_the_calculator_is_the_same_run_at_dp1_and_dp2_with_dynamic_micro_batches(assets, tmp_path):
    one = run_distributed(fit_grpo_tools, 1, str(assets), str(tmp_path / "dp1"), False, STEPS,
                          timeout=900)[0]
    two = run_distributed(fit_grpo_tools, 2, str(assets), str(tmp_path / "dp2"), True, STEPS,
                          timeout=900)
    for step in range(STEPS):
        assert sorted(two[0]["rows"][step] + two[1]["rows"][step]) == sorted(one["rows"][step]), step
        want, got = one["metrics"][step], two[0]["metrics"][step]
        assert got["agent/tool_calls"] > 0 and got["agent/tool_token_share"] > 0  # the tool was used
        for key in ("actor/pg_loss", "actor/grad_norm", "reward/mean", "agent/turns", "agent/tool_calls",
                    "agent/tool_calls/calculator", "agent/tool_token_share", "rollout_corr/kl"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (step, key)
    for name, tensor in one["params"].items():
        torch.testing.assert_close(two[0]["params"][name], tensor, rtol=1e-4, atol=1e-5)
    assert two[0]["val"] == two[1]["val"], "every rank logs the same reduced validation metrics"
    assert one["val"]["val/agent/tool_calls"] > 0 and one["val"]["val/agent/correct_tool_use"] > 0
    for key in AGENT_VAL:
        assert two[0]["val"][key] == pytest.approx(one["val"][key], rel=1e-6, abs=1e-7), key
