"""Peak memory of the LM head + log-probs + entropy (forward and backward) at a 151,936-token vocabulary.

Usage::

    python bench/logprob_memory.py [--tokens 1024] [--samples 8] [--prompt 32] [--hidden 128]
                                   [--vocab 151936] [--dtype bf16|fp32]

One packed row of ``--samples`` sequences of ``tokens / samples`` tokens each, the first ``--prompt`` of
each a prompt (``loss_mask`` 0) and the rest a response; a ``hidden`` x ``vocab`` LM head in ``--dtype``
(Qwen2's vocabulary; a small hidden size keeps the matmuls short on CPU and changes no ``[N, V]`` term).
Both sides compute ``log_probs`` and ``entropy`` of the next token and back-propagate
``sum((log_probs + entropy) * loss_mask)`` into the hidden states and the head:

* before (the engine's previous path): the head on all ``N`` positions, then ``log_softmax`` of the
  whole ``[N, V]`` logits in float32;
* after (``engine/heads.py`` now): the head only at ``head_positions`` (the loss-mask targets, through
  HF's ``logits_to_keep`` in the engine) and the chunked float32 log-softmax of ``data/log_probs.py``.

Peak memory is measured with ``torch.distributed._tools.mem_tracker.MemTracker`` (every storage
allocated and freed, at the moment the total peaks) minus the head's parameters; the gradients of the
head and of the hidden states count on both sides. Values and gradients are checked equal first.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_trainer.data.packing import (  # noqa: E402
    PackedBatch,
    make_batch,
    pack_batch,
    shift_to_targets,
    token_log_probs_and_entropy,
)
from verl_trainer.engine.heads import head_positions, scatter_head_outputs  # noqa: E402

MIB = 2**20
Outputs = tuple[torch.Tensor, torch.Tensor]
Timed = tuple[float, float]
Step = Callable[[torch.Tensor, torch.nn.Linear, PackedBatch], Outputs]


def before(hidden: torch.Tensor, head: torch.nn.Linear, packed: PackedBatch) -> Outputs:
    """The previous path: ``[N, V]`` logits, one float32 log-softmax over all of them."""
    logits32 = F.linear(hidden, head.weight).float()
    all_log_probs = torch.log_softmax(logits32, -1)
    targets = torch.roll(packed.input_ids.reshape(-1), -1)
    log_probs = all_log_probs.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(all_log_probs.exp() * all_log_probs).sum(-1)
    return shift_to_targets(log_probs, packed.cu_seqlens), shift_to_targets(entropy, packed.cu_seqlens)


def after(hidden: torch.Tensor, head: torch.nn.Linear, packed: PackedBatch) -> Outputs:
    """The new path: the head at the used positions only, chunked float32 log-softmax."""
    positions = head_positions(packed)
    logits = F.linear(hidden[positions], head.weight)  # what logits_to_keep does inside the HF model
    targets = packed.input_ids.reshape(-1)[positions + 1]
    log_probs, entropy = token_log_probs_and_entropy(logits, targets, calculate_entropy=True)
    n = packed.num_tokens
    return scatter_head_outputs(log_probs, positions, n), scatter_head_outputs(entropy, positions, n)


def run(step: Step, hidden: torch.Tensor, head: torch.nn.Linear, packed: PackedBatch) -> list[torch.Tensor]:
    """Forward + backward; returns ``[log_probs, entropy, d hidden, d weight]``."""
    hidden.grad, head.weight.grad = None, None
    log_probs, entropy = step(hidden, head, packed)
    mask = packed.output_mask.float()
    ((log_probs + entropy) * mask).sum().backward()
    return [log_probs.detach() * mask, entropy.detach() * mask, hidden.grad, head.weight.grad]


def peak_mib(step: Step, hidden: torch.Tensor, head: torch.nn.Linear, packed: PackedBatch) -> Timed:
    """(peak MiB beyond the head's parameters, seconds) of one forward + backward (gradients included)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    run(step, hidden, head, packed)  # warm-up
    tracker = MemTracker()
    tracker.track_external(head, hidden)
    start = time.perf_counter()
    with tracker:
        run(step, hidden, head, packed)
    seconds = time.perf_counter() - start
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    by_kind = {str(k).rsplit(".", 1)[-1]: v for k, v in peak.items() if k != "Total"}
    fixed = sum(by_kind.get(k, 0) for k in ("PARAM", "BUFFER", "OPT"))
    return (peak["Total"] - fixed) / MIB, seconds


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    length = args.tokens // args.samples
    seqs = [torch.randint(0, args.vocab, (length,), generator=g).tolist() for _ in range(args.samples)]
    batch = make_batch([s[: args.prompt] for s in seqs], [s[args.prompt :] for s in seqs])
    packed = pack_batch(batch, keys=())
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, dtype=dtype)
    hidden = torch.randn(packed.num_tokens, args.hidden, generator=g).to(dtype).requires_grad_(True)

    got, want = run(after, hidden, head, packed), run(before, hidden, head, packed)
    diffs = [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, want)]
    used = int(packed.output_mask.sum())
    print(f"N={packed.num_tokens} tokens ({used} in the loss mask), hidden {args.hidden}, "
          f"vocab {args.vocab}, {args.dtype}; max relative difference (lp, entropy, d hidden, d head) "
          + ", ".join(f"{d:.1e}" for d in diffs))
    results = {}
    for name, step in (("before", before), ("after", after)):
        results[name] = peak_mib(step, hidden, head, packed)
        print(f"{name:>6}: peak {results[name][0]:9.1f} MiB, {results[name][1]:.2f} s", flush=True)
    print(f"peak memory after / before: {results['after'][0] / results['before'][0]:.3f} "
          f"({results['before'][0] - results['after'][0]:.0f} MiB saved)")


if __name__ == "__main__":
    main()
