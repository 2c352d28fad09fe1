"""The per-shape choice of the CPU attention path (``verl_trainer.models.attention_autotune``).

Timings are injected through the ``probe`` seam (``probe(key, length) -> speed-up``), so the choices
asserted here do not depend on the machine's load; one test runs the real probe once.
"""

import json
import pickle
import warnings

import pytest
import torch
from transformers import LlamaConfig

import verl_trainer.models.attention_autotune as autotune
from verl_trainer.models.attention_autotune import (
    AUTOTUNE_ENV,
    CACHE_ENV,
    PROBE_LENGTHS,
    PROBE_TOKENS,
    ShapeKey,
    agree_on_model_attention,
    choose_crossover,
    measure_probe,
    probe_lengths,
    tune,
)
from verl_trainer.models.bucketed_attention import (
    LAYOUT_CROSSOVERS,
    MATMUL_MAX_LENGTH,
    bucketed_varlen_attention,
    matmul_crossover,
)
from verl_trainer.models.varlen_kernels import reference_varlen_attention
from verl_trainer.testing import run_distributed

FP32 = ShapeKey.of(4, 2, 64, torch.float32, "cpu")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    """Autotune on, an empty in-process cache, the cache file in ``tmp_path``."""
    monkeypatch.setenv(AUTOTUNE_ENV, "1")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "autotune.json"))
    autotune.clear_cache()
    yield
    autotune.clear_cache()


def _probe(speed_ups, calls=None):
    """A probe returning ``speed_ups[length]`` (recording each call in ``calls``)."""

    def probe(key, length):
        if calls is not None:
            calls.append(length)
        return speed_ups[length]

    return probe


def _failing_probe(key, length):
    raise AssertionError("nothing should be measured here")


def test_shape_key():
    key = ShapeKey.of(4, 2, 64, torch.float32, torch.device("cpu"))
    assert key == ShapeKey(4, 2, 64, "torch.float32", "cpu") and key.torch_dtype is torch.float32
    assert key.eligible()
    assert ShapeKey.of(4, 2, 64, torch.bfloat16, "cpu").eligible()  # upcast to fp32 for the matmuls
    assert not ShapeKey.of(4, 2, 64, torch.int8, "cpu").eligible()
    assert not ShapeKey.of(4, 2, 64, torch.float32, "cuda").eligible()
    file_id = key.file_id()
    assert torch.__version__ in file_id and f"threads{torch.get_num_threads()}" in file_id
    assert file_id != ShapeKey.of(4, 4, 64, torch.float32, "cpu").file_id()


def test_crossover_is_the_longest_length_the_matmul_side_won_up_to():
    calls = []
    assert choose_crossover(FP32, _probe({8: 3.0, 16: 0.95, 32: 0.85}, calls)) == 16  # 0.95: not clearly
    assert calls == [8, 16, 32]  # probing stops at the first clear loss
    assert choose_crossover(FP32, _probe({8: 0.7})) == 0  # clearly slower at the shortest: sdpa everywhere
    assert choose_crossover(FP32, _probe({8: float("nan")})) == 0
    wins = dict.fromkeys(PROBE_LENGTHS, 2.0)
    assert choose_crossover(FP32, _probe(wins)) == 64  # D = 64: up to max(MATMUL_MAX_LENGTH, D)
    assert choose_crossover(ShapeKey.of(4, 1, 128, torch.float32, "cpu"), _probe(wins)) == 128
    assert choose_crossover(ShapeKey.of(4, 2, 64, torch.float32, "cuda"), _failing_probe) == 0


@pytest.mark.parametrize("length", PROBE_LENGTHS)
def test_the_probe_row_spreads_each_length_apart(length):
    lengths = probe_lengths(length)
    assert set(lengths) == set(range(length // 2 + 1, length + 1))  # every length of the probed range
    assert all(a != b for a, b in zip(lengths, lengths[1:]))  # a length's segments lie apart (gathered)
    assert sum(lengths) <= max(PROBE_TOKENS, sum(set(lengths)))  # about PROBE_TOKENS, one of each at least


def test_chosen_once_per_key_and_used_by_the_attention():
    q = torch.zeros(1, 4, 3, 64)
    k = torch.zeros(1, 2, 3, 64)
    assert tune(FP32, _probe({8: 2.0, 16: 0.5})) == 8
    assert tune(FP32, _failing_probe) == 8  # cached in-process
    assert matmul_crossover(q, k, 0.0) == 8
    assert matmul_crossover(q, k, 0.1) == 0  # dropout: sdpa
    tune(ShapeKey.of(4, 2, 64, torch.bfloat16, "cpu"), _probe({8: 2.0, 16: 2.0, 32: 0.5}))
    assert matmul_crossover(q.bfloat16(), k.bfloat16(), 0.0) == 16
    autotune.clear_cache()
    assert tune(FP32, _failing_probe) == 8  # from the file


def test_switch_off_keeps_the_constant(monkeypatch):
    monkeypatch.setenv(AUTOTUNE_ENV, "0")
    q, k = torch.zeros(1, 4, 3, 64), torch.zeros(1, 2, 3, 64)
    assert matmul_crossover(q, k, 0.0) == MATMUL_MAX_LENGTH
    assert matmul_crossover(q.bfloat16(), k.bfloat16(), 0.0) == 0  # the old rule: fp32 only
    assert not LAYOUT_CROSSOVERS  # nothing measured
    assert agree_on_model_attention(LlamaConfig(num_attention_heads=4, hidden_size=256), "cpu") is None


def test_cache_file_is_json_and_keyed_by_torch_and_threads(tmp_path):
    path = tmp_path / "autotune.json"
    path.write_text(json.dumps({"format": 1, "crossovers": {FP32.file_id(): 32, "other": 8}}))
    assert tune(FP32, _failing_probe) == 32
    other = ShapeKey.of(4, 4, 32, torch.float32, "cpu")
    assert tune(other, _probe({8: 0.5})) == 0
    stored = json.loads(path.read_text())["crossovers"]
    assert stored == {FP32.file_id(): 32, "other": 8, other.file_id(): 0}
    assert [p.name for p in tmp_path.iterdir()] == ["autotune.json"]  # no temporary file left


@pytest.mark.parametrize("content", [
    b"not json",
    pickle.dumps({"format": 1, "crossovers": {}}),  # never unpickled: just not JSON
    json.dumps({"format": 1, "crossovers": {FP32.file_id(): "64"}}).encode(),
    json.dumps([1, 2]).encode(),
])
def test_corrupt_cache_file_is_ignored_with_a_warning(tmp_path, content):
    path = tmp_path / "autotune.json"
    path.write_bytes(content)
    autotune._warned.clear()
    with pytest.warns(RuntimeWarning, match="corrupt attention autotune cache"):
        assert tune(FP32, _probe({8: 2.0, 16: 0.5})) == 8
    assert json.loads(path.read_text())["crossovers"] == {FP32.file_id(): 8}  # rewritten


def test_no_cache_file(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, "0")
    assert autotune.cache_path() is None
    assert tune(FP32, _probe({8: 0.5})) == 0
    assert list(tmp_path.iterdir()) == []


def test_real_probe_and_autotune():
    """The real measurement: a finite speed-up, and the chosen path equals the loop."""
    key = ShapeKey.of(2, 1, 16, torch.float32, "cpu")
    assert 0 < measure_probe(key, 8, rounds=1) < float("inf")
    lengths = [3, 9, 9, 40, 2]
    q, k, v = (torch.randn(1, h, sum(lengths), 16, requires_grad=True) for h in (2, 1, 1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert matmul_crossover(q, k, 0.0) == MATMUL_MAX_LENGTH  # not tuned: the constant, nothing measured
        assert not LAYOUT_CROSSOVERS
        chosen = tune(key)  # the real probe, called under no_grad as a model build may be
        out = bucketed_varlen_attention(q, k, v, lengths)
    assert chosen in (0, *PROBE_LENGTHS) and LAYOUT_CROSSOVERS == {key.layout: chosen}
    assert matmul_crossover(q, k, 0.0) == chosen
    torch.testing.assert_close(out, reference_varlen_attention(q, k, v, lengths), atol=1e-5, rtol=1e-5)


def _chosen_and_loop(crossover, heads_kv, dtype):
    """Outputs and q/k/v gradients of the bucketed path with ``crossover`` chosen, and of the loop."""
    dim, lengths = 16, [1, 8, 8, 12, 16, 20, 33, 64, 70, 3]
    LAYOUT_CROSSOVERS[ShapeKey.of(4, heads_kv, dim, dtype, "cpu").layout] = crossover
    g = torch.Generator().manual_seed(crossover + heads_kv)
    n = sum(lengths)
    q, k, v = (torch.randn(1, n, h, dim, generator=g).to(dtype).transpose(1, 2).requires_grad_(True)
               for h in (4, heads_kv, heads_kv))
    grad = torch.randn(1, n, 4, dim, generator=g).to(dtype)
    results = []
    for fn in (bucketed_varlen_attention, reference_varlen_attention):
        out = fn(q, k, v, lengths)
        results.append([out.detach(), *torch.autograd.grad(out, (q, k, v), grad)])
    return results


@pytest.mark.parametrize("crossover", [0, *PROBE_LENGTHS])
@pytest.mark.parametrize("heads_kv", [4, 2, 1])
def test_every_chosen_path_equals_the_loop(crossover, heads_kv):
    """Whatever the autotune picks, outputs and gradients equal the per-segment loop (fp32, 1e-5)."""
    results = _chosen_and_loop(crossover, heads_kv, torch.float32)
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    if crossover == 0:
        assert all(torch.equal(a, b) for a, b in zip(*results))  # sdpa buckets: bitwise the loop


@pytest.mark.parametrize("heads_kv", [4, 1])
def test_half_precision_matmul_path_is_the_fp32_result_rounded(heads_kv):
    """bf16 buckets on the matmul path: computed in fp32 and rounded once, within bf16 round-off of the loop
    (whose sdpa rounds inside); crossover 0 stays bitwise the loop."""
    for name, a, b in zip(("out", "dq", "dk", "dv"), *_chosen_and_loop(64, heads_kv, torch.bfloat16)):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert all(torch.equal(a, b) for a, b in zip(*_chosen_and_loop(0, heads_kv, torch.bfloat16)))


def test_heads_per_rank():
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    assert autotune._heads_of(config, 1) == (4, 2, 32)
    assert autotune._heads_of(config, 2) == (2, 1, 32)
    assert autotune._heads_of(config, 4) is None  # KV heads not split evenly: not tuned here


def _agree_on_two_ranks(path):
    """Rank 0 has measured 32 for the layout, rank 1 would take 8: both must take rank 0's."""
    import torch.distributed as dist

    rank = dist.get_rank()
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=256)
    key = ShapeKey.of(4, 2, 64, torch.float32, "cpu")
    LAYOUT_CROSSOVERS[key.layout] = 32 if rank == 0 else 8
    agreed = agree_on_model_attention(config, "cpu", dtypes=(torch.float32,))
    unseen = matmul_crossover(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0.0)  # first seen here
    return agreed, LAYOUT_CROSSOVERS[key.layout], unseen


def test_every_rank_takes_rank_0s_choice(tmp_path):
    env = {AUTOTUNE_ENV: "1", CACHE_ENV: str(tmp_path / "autotune.json")}
    for agreed, stored, unseen in run_distributed(_agree_on_two_ranks, 2, tmp_path, env=env):
        assert agreed == {"torch.float32": 32} and stored == 32
        assert unseen == MATMUL_MAX_LENGTH  # the constant rule on every rank: no collective in a forward
