"""A separate rollout pool (``algorithm.rollout.placement=separate``, ``verl_trainer/rollout_pool``).

* staleness 0 with the pool (``devices=2``: 1 trainer rank + 1 rollout rank) is the colocated
  synchronous run bitwise: tokens, metrics (timings and the pool's own rollout metrics aside), weights;
* (slow) ``devices=3``: one rollout rank serving two trainer ranks equals the colocated run at dp=2 bitwise;
* (slow) the recipe launched with ``trainer.devices=2`` and a separate pool runs to its report;
* (slow) staleness 2 with the pool: reproducible from the seed (two runs agree bitwise), staleness 0, 1, 2, 2,
  versions tagged;
* the bucketed broadcast delivers tensors bit-equal to the sender's at bucket sizes smaller than a
  tensor, between, and larger than all of them, holding one gathered tensor at a time;
* a killed rollout rank is reported with its rank within ``weight_sync_timeout_s`` (no hang);
* wrong settings (and the algorithm settings the pool does not run) are refused when the config is built,
  naming value, choices and fix.
"""

from __future__ import annotations

import os
import signal
import time
import weakref
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.algorithms.short_grpo import make_varied_reward_assets
from tests.algorithms.test_async_rollout import _grpo_fit, _without_timing
from verl_trainer.testing import run_distributed

SEPARATE = ("algorithm.rollout.placement=separate", "algorithm.rollout.rollout_ranks=1",
            "algorithm.rollout.weight_sync_bucket_mb=0.01")
POOL_ONLY = ("rollout/staleness", "rollout/tokens_at_staleness_", "rollout/queued")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_varied_reward_assets(tmp_path_factory.mktemp("rollout_pool"))


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


def _fit(assets: Path, root: Path, *overrides: str, devices: int = 1, **fit_args) -> dict | None:
    from verl_trainer.rollout_pool.current import current_pool

    run = _grpo_fit(str(assets / "model"), str(assets / "data"), str(root), *overrides, devices=devices,
                    **fit_args)
    pool = current_pool()
    return None if pool is not None and pool.serves_rollout else _summary(run)


def _grpo_fit_or_none(*args, **kwargs):
    try:
        return _fit(*args, **kwargs)
    except RuntimeError:  # the rollout rank's module has no actor: it never trained
        from verl_trainer.rollout_pool.current import current_pool

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
    one = run_distributed(_grpo_fit_or_none, 2, assets, tmp_path / "a", *args, devices=2, timeout=600,
                          checkpoint_every=2)[0]
    two = run_distributed(_grpo_fit_or_none, 2, assets, tmp_path / "b", *args, devices=2, timeout=600)[0]
    _assert_same(one, two)
    assert one["staleness"] == [0.0, 1.0, 2.0]
    assert [v.unique().tolist() for v in one["versions"]] == [[0], [0], [0]]
    # resumed from step 2, whose checkpoint holds the queued group of step 3 (sampled by version 0): step 3
    # trains those samples at staleness 2, with the same metrics and weights as the uninterrupted run
    step2 = str(tmp_path / "a" / "checkpoints" / "step_000002")
    resumed = run_distributed(_grpo_fit_or_none, 2, assets, tmp_path / "resumed", *args, devices=2,
                              timeout=600, ckpt_path=step2)[0]
    assert resumed["staleness"] == [2.0]
    assert torch.equal(resumed["tokens"][0], one["tokens"][2])
    assert torch.equal(resumed["versions"][0], one["versions"][2])
    assert resumed["metrics"] == one["metrics"][2:]
    for name, tensor in one["params"].items():
        assert torch.equal(resumed["params"][name], tensor), name


# ------------------------------------------------------------------------------------ the broadcast
def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(7, 9, generator=gen), "b": torch.randn(9, generator=gen).to(torch.bfloat16),
            "steps": torch.arange(5, dtype=torch.int64), "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4), "t": torch.randn(3, 4, generator=gen).t()}  # not contiguous


def _stream(alive: list, most_alive: list):
    """The tensors one at a time, each made fresh (as an FSDP gather gives them); counts those alive."""
    for name in _tensors():
        tensor = _tensors()[name]
        alive.append(weakref.ref(tensor))
        most_alive.append(sum(r() is not None for r in alive))
        yield name, tensor
        del tensor


def _broadcast_in_buckets(bucket_sizes: list[int]) -> list[dict[str, torch.Tensor]] | list[int]:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    from verl_trainer.rollout_pool.buckets import receive_weights, send_weights
    from verl_trainer.rollout_pool.world import make_group

    rank = dist.get_rank()
    group = make_group(dist.PrefixStore("bucket_test", _get_default_store()), rank, 2, timedelta(seconds=60),
                       "gloo")
    out, most_alive = [], []
    for size in bucket_sizes:
        if rank == 0:
            send_weights(_stream([], most_alive), group, size)
        else:
            out.append(dict(receive_weights(group)))
    return out if rank else most_alive


def test_bucketed_broadcast_is_bit_equal_at_any_bucket_size():
    sizes = [16, 100, 10 * 2**20]  # smaller than most tensors (w: 252 bytes), between, larger than all
    most_alive, received = run_distributed(_broadcast_in_buckets, 2, sizes, timeout=300)
    assert max(most_alive) <= 2  # the sender holds the tensor in flight (and the one just sent), not all
    expected = _tensors()
    for got in received:
        assert list(got) == list(expected)
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
            assert torch.equal(got[name], tensor), name


# --------------------------------------------------------------------------------- a killed rollout rank
def _killed_rank(rank: int, port: int, model: str, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from verl_trainer.rollout.config import RolloutConfig
    from verl_trainer.rollout_pool.channel import RolloutPoolError
    from verl_trainer.rollout_pool.world import Pool, make_group

    config = RolloutConfig(name="hf", device="cpu", placement="separate", weight_sync_timeout_s=3.0)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=120))
    group = make_group(dist.PrefixStore("weights", store), rank, 2, timedelta(seconds=3), "gloo")
    pool = Pool(config, model, dist.PrefixStore("pool", store), rank, 1, group, "cpu")
    if rank == 1:
        store.set("test/pid", str(os.getpid()))
        pool.serve()
        return
    params = AutoModelForCausalLM.from_pretrained(model).named_parameters
    liveness = pool.liveness()
    pool.broadcast_weights(params(), 0, liveness)  # rank 1 alive: received
    os.kill(int(store.get("test/pid")), signal.SIGKILL)
    start = time.monotonic()
    try:
        pool.broadcast_weights(params(), 1, liveness)
        out.put(("no error", 0.0))
    except RolloutPoolError as exc:
        out.put((str(exc), time.monotonic() - start))


def test_a_killed_rollout_rank_is_named(assets):
    import multiprocessing as mp

    from verl_trainer.testing.ranks import find_free_port

    ctx, port = mp.get_context("spawn"), find_free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_killed_rank, args=(r, port, str(assets / "model"), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        message, seconds = out.get(timeout=240)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert "rollout rank(s) [1]" in message and "weight_sync_timeout_s=3.0" in message, message
    print(f"killed rollout rank reported after {seconds:.1f} s (time-out 3 s)")


# ---------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("overrides", "match"), [
    ({"placement": "apart"}, r"placement='apart' is unknown; choose one of \('colocated', 'separate'\)"),
    ({"placement": "separate", "rollout_ranks": 0}, r"rollout_ranks=0 must be an int >= 1"),
    ({"weight_sync_bucket_mb": 0}, r"weight_sync_bucket_mb=0 must be > 0"),
    ({"weight_sync_timeout_s": -1}, r"weight_sync_timeout_s=-1 must be > 0"),
    ({"placement": "separate", "name": "auto"}, r"name='auto'.*set algorithm.rollout.name=hf"),
    ({"placement": "separate", "max_staleness": 1, "partial_rollout": True}, r"partial_rollout=true"),
])
def test_wrong_placement_settings_are_refused_at_build(overrides, match):
    from verl_trainer.rollout.config import RolloutConfig

    with pytest.raises(ValueError, match=match):
        RolloutConfig(**overrides)


@pytest.mark.parametrize(("world", "ranks", "match"), [
    (2, 2, r"rollout_ranks=2 needs devices x num_nodes > 2 \(got 2\)"),
    (5, 2, r"the 3 trainer ranks .* must be a multiple of rollout_ranks=2"),
])
def test_pool_sizes_are_checked_against_the_world(world, ranks, match):
    from verl_trainer.rollout.config import RolloutConfig
    from verl_trainer.rollout_pool.config import check_pool_world

    with pytest.raises(ValueError, match=match):
        check_pool_world(RolloutConfig(placement="separate", rollout_ranks=ranks), world)
    assert check_pool_world(RolloutConfig(placement="separate", rollout_ranks=2), 6) == 4


# --------------------------------------------------------------------------------- the recipe's launcher
@pytest.mark.slow
def test_the_recipe_launches_trainer_and_rollout_ranks(tmp_path):
    """``recipes/grpo.py trainer.devices=2`` with a separate pool: the script launcher starts both ranks, the
    rollout rank exits 0 after the fit, validation (before the fit too: the rollout rank waits for the fit)
    and the report run on the trainer rank."""
    import csv
    import subprocess
    import sys

    from tests.algorithms.short_grpo import ROOT
    from tests.recipes.test_multinode import clean_env

    root = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "grpo.py"), "trainer.max_steps=3", "trainer.devices=2",
         "algorithm.rollout.placement=separate", "algorithm.rollout.max_staleness=1",
         "algorithm.rollout_correction.level=token", "trainer.val_check_interval=null",
         "trainer.logger=[csv]",
         "trainer.enable_checkpointing=false", "trainer.export_hf=false",
         "trainer.enable_progress_bar=false", f"trainer.default_root_dir={root}", "warm_start.enable=false"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "after training" in proc.stdout
    before = [line for line in proc.stdout.splitlines() if line.startswith("val/reward/mean")]
    assert before and "before training:      n/a" not in before[0], proc.stdout[-3000:]
    rows = [r for f in root.glob("**/metrics.csv") for r in csv.DictReader(open(f)) if r.get("timing/step_s")]
    assert [float(r["rollout/staleness"]) for r in rows] == [0.0, 1.0, 1.0]


def test_algorithm_settings_the_pool_does_not_run_are_refused_at_build():
    from verl_trainer.algorithms.config import ActorConfig, GRPOConfig
    from verl_trainer.core_algos import RolloutCorrectionConfig
    from verl_trainer.engine.config import EngineConfig
    from verl_trainer.models.moe_config import MoEConfig
    from verl_trainer.rollout.config import RolloutConfig

    rollout, correction = RolloutConfig(n=2, placement="separate"), RolloutCorrectionConfig(level="token")
    actor = ActorConfig(engine=EngineConfig(moe=MoEConfig(router_replay="rollout")))
    with pytest.raises(ValueError, match=r"router_replay=rollout with rollout.placement=separate"):
        GRPOConfig(actor=actor, rollout=rollout, rollout_correction=correction)
    with pytest.raises(ValueError, match=r"placement=separate with an estimator that reads reward_baselines"):
        GRPOConfig(rollout=rollout, adv_estimator="remax")
    GRPOConfig(rollout=rollout)  # accepted


@pytest.mark.slow
def test_one_rollout_rank_serves_two_trainer_ranks(assets, tmp_path, fresh_ranks):
    """``devices=3``: trainer ranks 0 and 1 both served by rollout rank 2 (staleness 0) equal the colocated
    synchronous run at ``devices=2`` bitwise, on both trainer ranks."""
    plain = run_distributed(_grpo_fit_or_none, 2, assets, tmp_path / "plain", devices=2, timeout=900)
    pooled = run_distributed(_grpo_fit_or_none, 3, assets, tmp_path / "pool", *SEPARATE, devices=3,
                             timeout=900)
    assert pooled[2] is None
    for rank in (0, 1):
        _assert_same(plain[rank], pooled[rank])


def test_messages_are_plain_data_never_pickles():
    from tensordict import NonTensorStack, TensorDict

    from verl_trainer.rollout_pool.channel import decode, encode

    batch = TensorDict({"input_ids": torch.arange(6).view(2, 3), "rollout_log_probs": torch.rand(2, 3)}, [2])
    batch["ground_truth"] = NonTensorStack.from_list(["4", {"answer": [1, 2.5]}])
    job = {"prompts": batch, "step": 3, "version": 2, "flags": (True, None, "x"), "t": torch.ones(2)}
    back = decode(encode(job))
    assert torch.equal(back["prompts"]["input_ids"], batch["input_ids"])
    assert torch.equal(back["prompts"]["rollout_log_probs"], batch["rollout_log_probs"])
    assert back["prompts"]["ground_truth"].tolist() == ["4", {"answer": [1, 2.5]}]
    assert (back["step"], back["version"], back["flags"]) == (3, 2, [True, None, "x"])
    assert torch.equal(back["t"], torch.ones(2))
    with pytest.raises(TypeError, match="cannot carry a object"):
        encode({"x": object()})
    import pickle

    with pytest.raises(Exception):  # noqa: B017, PT011 - a pickle is not a message: refused, never run
        decode(pickle.dumps({"step": 1}))


def test_mirrored_calls_run_in_order_on_each_rollout_rank_and_failures_surface():
    """``rollout_pool/mirror.py`` (Ray Train's report on rollout workers): trainer rank 0's posts run on
    every rollout rank in order; a kind without a handler and a raising handler are raised when serving
    ends, and the calls after them still run (a trainer-side barrier would otherwise wait for ever)."""
    from types import SimpleNamespace

    from torch.distributed import TCPStore

    from verl_trainer.rollout_pool.mirror import Mirrors, post_mirror
    from verl_trainer.rollout_pool.world import Pool
    from verl_trainer.testing.ranks import find_free_port

    store = TCPStore("127.0.0.1", find_free_port(), is_master=True, wait_for_workers=False)
    config = SimpleNamespace(rollout_ranks=2, weight_sync_timeout_s=10)
    trainer = Pool(config, "", store, rank=0, trainers=1, weight_group=None, device="cpu")
    seen: dict[int, list] = {1: [], 2: []}

    def failing(payload: dict) -> None:
        raise ValueError(f"bad {payload['step']}")

    mirrors = [Mirrors(Pool(config, "", store, rank=r, trainers=1, weight_group=None, device="cpu"),
                       {"report": seen[r].append, "fail": failing}) for r in (1, 2)]
    for kind, step in [("report", 1), ("unknown", 2), ("fail", 3), ("report", 4)]:
        post_mirror(trainer, kind, {"step": step, "dir_name": f"step_{step}"})
    deadline = time.monotonic() + 30
    while any(m.done < 4 for m in mirrors) and time.monotonic() < deadline:
        time.sleep(0.05)
    trainer.close()
    for rank, mirror in zip((1, 2), mirrors):
        assert seen[rank] == [{"step": 1, "dir_name": "step_1"}, {"step": 4, "dir_name": "step_4"}]
        with pytest.raises(RuntimeError) as err:
            mirror.finish(10)
        unknown = f"rollout rank {rank}: no handler for the mirrored call 'unknown'"
        assert f"{unknown} (known: ['fail', 'report'])" in str(err.value)
        assert "mirrored call 'fail' failed" in str(err.value) and "ValueError: bad 3" in str(err.value)
    post_mirror(Pool(config, "", store, rank=1, trainers=1, weight_group=None, device="cpu"), "report", {})
    assert not store.check(["mirror/1/4"]), "only trainer rank 0 posts"
