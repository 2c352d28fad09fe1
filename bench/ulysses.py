"""Peak activation memory per rank of Ulysses SP: one long packed sequence at sp=1 vs sp=2.

Usage::

    python bench/ulysses.py [--seq-len 4096] [--samples 1] [--hidden 256] [--layers 2] [--heads 8]

Two gloo ranks (``verl_trainer.testing.run_distributed``) each build the same tiny Qwen2 model with
``attn_implementation="verl_ulysses"``, then measure one forward + backward of the same packed row
(``--samples`` sequences totalling ``--seq-len`` tokens; the loss is the sum of the log-probs):

* sp=1: every rank runs the whole row alone (no SP group);
* sp=2: the two ranks form one SP group; each runs ``seq_len / 2`` tokens, attention ``heads / 2``.

How activation memory is measured: ``torch.distributed._tools.mem_tracker.MemTracker`` (a
``TorchDispatchMode`` plus module hooks) records every tensor storage allocated and freed during the
step and labels it PARAM / BUFFER / GRAD / ACT (created in forward) / TEMP (created in backward) / OPT.
Its peak snapshot is the live memory at the moment the total peaks; "activation memory" is that total
minus parameters, buffers, gradients and optimizer state (which Ulysses does not change) — i.e. the
saved activations plus the transient buffers of the forward/backward (all-to-all buffers included). A
warm-up step allocates the ``.grad`` tensors first, so gradient accumulation is in place during the
measured steps. ``tracemalloc`` would miss torch's C++ allocations and RSS includes allocator caching,
so neither is used. The ratio printed is the largest sp=2 rank over the sp=1 value; target <= 0.6.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_trainer.data.packing import make_batch, pack_batch  # noqa: E402
from verl_trainer.models import load_causal_lm, make_tiny_model  # noqa: E402
from verl_trainer.models.ulysses_attention import ULYSSES_ATTENTION  # noqa: E402
from verl_trainer.models.ulysses_forward import ulysses_packed_log_probs  # noqa: E402
from verl_trainer.testing import run_distributed  # noqa: E402

TARGET = 0.6
MIB = 2**20


def _packed_row(seq_len: int, samples: int) -> Any:
    g = torch.Generator().manual_seed(0)
    cuts = [seq_len * i // samples for i in range(samples + 1)]
    seqs = [torch.randint(4, 60, (b - a,), generator=g).tolist() for a, b in zip(cuts, cuts[1:])]
    return pack_batch(make_batch([s[:1] for s in seqs], [s[1:] for s in seqs]))


def _step(model: torch.nn.Module, packed: Any, group: dist.ProcessGroup | None) -> None:
    out = ulysses_packed_log_probs(model, packed, group)
    out["log_probs"].sum().backward()


def _activation_peak(
    model: torch.nn.Module, packed: Any, group: dist.ProcessGroup | None
) -> dict[str, float]:
    """Peak bytes of one forward+backward, by MemTracker category (MiB), and the step time (s)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    start = time.perf_counter()
    with tracker:
        _step(model, packed, group)
    seconds = time.perf_counter() - start
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    by_kind = {str(k).rsplit(".", 1)[-1]: v for k, v in peak.items() if k != "Total"}
    fixed = sum(by_kind.get(k, 0) for k in ("PARAM", "BUFFER", "GRAD", "OPT"))
    return {
        "activation_mib": (peak["Total"] - fixed) / MIB,
        "act_mib": by_kind.get("ACT", 0) / MIB,
        "temp_mib": by_kind.get("TEMP", 0) / MIB,
        "total_mib": peak["Total"] / MIB,
        "seconds": seconds,
    }


def _measure(path: str, seq_len: int, samples: int) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    model = load_causal_lm(path, attn_implementation=ULYSSES_ATTENTION)
    model.train()
    packed = _packed_row(seq_len, samples)
    _step(model, _packed_row(64, 1), None)  # warm-up: allocates every .grad
    results = {}
    for name, group in (("sp1", None), ("sp2", dist.group.WORLD)):
        dist.barrier()
        model.zero_grad(set_to_none=False)
        results[name] = _activation_peak(model, packed, group)
    return results


def main(argv: list[str] | None = None) -> float:
    """Run the benchmark and return the sp=2 / sp=1 activation-memory ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens in the packed row")
    parser.add_argument("--samples", type=int, default=1, help="sequences packed into the row")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_ulysses_") as tmp:
        path = make_tiny_model(
            Path(tmp) / "model",
            arch="qwen2",
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            intermediate_size=4 * args.hidden,
            max_position_embeddings=max(args.seq_len, 1024),
        )
        per_rank = run_distributed(_measure, 2, path, args.seq_len, args.samples, timeout=1800)
    sp1 = max(r["sp1"]["activation_mib"] for r in per_rank)
    sp2 = max(r["sp2"]["activation_mib"] for r in per_rank)
    ratio = sp2 / sp1
    print(
        f"Ulysses activation memory: qwen2 hidden={args.hidden} layers={args.layers} heads={args.heads} "
        f"kv_heads={args.kv_heads}, one packed row of {args.seq_len} tokens ({args.samples} sample(s))"
    )
    print(f"{'':>8} {'activation MiB':>15} {'ACT':>9} {'TEMP':>9} {'total MiB':>10} {'step s':>8}")
    for rank, r in enumerate(per_rank):
        for name in ("sp1", "sp2"):
            m = r[name]
            print(
                f"{name} r{rank}:  {m['activation_mib']:15.1f} {m['act_mib']:9.1f} {m['temp_mib']:9.1f} "
                f"{m['total_mib']:10.1f} {m['seconds']:8.2f}"
            )
    verdict = "OK" if ratio <= TARGET else "ABOVE TARGET"
    print(f"peak activation memory per rank, sp=2 / sp=1: {ratio:.3f} (target <= {TARGET}: {verdict})")
    return ratio


if __name__ == "__main__":
    main()
