"""Parameter and activation memory per rank of tensor parallelism: tp=2 vs tp=1.

Usage::

    python bench/tp_memory.py [--hidden 1024] [--layers 8] [--vocab 32000] [--tokens 2048]

Two gloo ranks (``verl_trainer.testing.run_distributed``) each load the same Llama (hidden 1024,
8 layers, 16 heads of 64, vocab 32k by default; ``bench/_common.py: write_model``) with the engine's
padding-free attention and measure one forward + backward of the same packed row (4 samples, the LM
head on the response positions only, chunked float32 log-probs, loss = their sum — what the engine runs
per micro-batch):

* tp=1: every rank runs the whole model alone (the baseline, measured in the same run);
* tp=2: the model split with :func:`verl_trainer.engine.tensor_parallel.apply_tensor_parallel` over both
  ranks (q/k/v, gate/up column-wise; o/down row-wise; the embedding and the LM head over the vocabulary,
  log-probs from the vocabulary slices; norms replicated).

Parameter memory per rank: the bytes of the parameters this rank stores (a DTensor's local shard).
Activation memory: ``torch.distributed._tools.mem_tracker.MemTracker``'s peak of the step minus
parameters, buffers, gradients and optimizer state — the saved activations plus the transient buffers
(as ``bench/ulysses.py`` measures). FSDP is left out on purpose: it shards the stored parameters over dp
in both layouts alike and does not change activations. The ratios printed are tp=2 / tp=1 (the larger
rank of tp=2).
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

from bench._common import MIB, local_param_mib, write_model  # noqa: E402
from verl_trainer.data.packing import (  # noqa: E402
    make_batch,
    pack_batch,
    token_log_probs_and_entropy,
)
from verl_trainer.engine.heads import head_positions  # noqa: E402
from verl_trainer.engine.tensor_parallel import apply_tensor_parallel, vocab_slice_start  # noqa: E402
from verl_trainer.engine.vocab_parallel import vocab_parallel_log_probs_and_entropy  # noqa: E402
from verl_trainer.models import load_causal_lm  # noqa: E402
from verl_trainer.models.attention import VARLEN_ATTENTION, packed_forward  # noqa: E402
from verl_trainer.testing import run_distributed  # noqa: E402


def _packed_row(tokens: int, samples: int, vocab: int) -> Any:
    g = torch.Generator().manual_seed(0)
    length = tokens // samples
    prompt = length // 4
    prompts = [torch.randint(4, vocab, (prompt,), generator=g).tolist() for _ in range(samples)]
    responses = [torch.randint(4, vocab, (length - prompt,), generator=g).tolist() for _ in range(samples)]
    return pack_batch(make_batch(prompts, responses))


def _step(model: torch.nn.Module, packed: Any, vocab_parallel: bool = False) -> None:
    positions = head_positions(packed)
    logits = packed_forward(model, packed, logits_to_keep=positions).logits
    targets = packed.input_ids.reshape(-1)[positions + 1]
    if vocab_parallel:  # this rank's [K, V / tp] slice
        start = vocab_slice_start(model.config.vocab_size, dist.get_world_size(), dist.get_rank())
        log_probs, _ = vocab_parallel_log_probs_and_entropy(logits, targets, start, dist.group.WORLD)
    else:
        log_probs, _ = token_log_probs_and_entropy(logits, targets)
    log_probs.sum().backward()


def _activation_peak(model: torch.nn.Module, packed: Any, vocab_parallel: bool) -> dict[str, float]:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    start = time.perf_counter()
    with tracker:
        _step(model, packed, vocab_parallel)
    seconds = time.perf_counter() - start
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    by_kind = {str(k).rsplit(".", 1)[-1]: v for k, v in peak.items() if k != "Total"}
    fixed = sum(by_kind.get(k, 0) for k in ("PARAM", "BUFFER", "GRAD", "OPT"))
    return {"activation_mib": (peak["Total"] - fixed) / MIB, "seconds": seconds}


def _measure(path: str, tokens: int, samples: int) -> dict[str, dict[str, float]]:
    from torch.distributed.device_mesh import init_device_mesh

    results = {}
    for name in ("tp1", "tp2"):
        torch.manual_seed(0)
        model = load_causal_lm(path, attn_implementation=VARLEN_ATTENTION)
        vocab = False
        if name == "tp2":
            mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
            vocab = apply_tensor_parallel(model, mesh)
        model.train()
        packed = _packed_row(tokens, samples, model.config.vocab_size)
        _step(model, _packed_row(64, 1, model.config.vocab_size), vocab)  # warm-up: allocates every .grad
        model.zero_grad(set_to_none=False)
        dist.barrier()
        results[name] = {"param_mib": local_param_mib(model), **_activation_peak(model, packed, vocab)}
        del model
    return results


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark; returns the tp=2 / tp=1 ratios of parameter and activation memory."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in the packed row")
    parser.add_argument("--samples", type=int, default=4, help="sequences packed into the row")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_tp_") as tmp:
        path = str(Path(tmp) / "model")
        config = write_model(path, args.hidden, args.layers, args.vocab)
        per_rank = run_distributed(_measure, 2, path, args.tokens, args.samples, timeout=3600)
    print(f"TP memory per rank: llama hidden={args.hidden} layers={args.layers} "
          f"heads={config.num_attention_heads} vocab={args.vocab}, one packed row of {args.tokens} tokens "
          f"({args.samples} samples), fp32, fwd+bwd")
    print(f"{'':>8} {'params MiB':>11} {'activation MiB':>15} {'step s':>8}")
    for rank, r in enumerate(per_rank):
        for name in ("tp1", "tp2"):
            m = r[name]
            print(f"{name} r{rank}: {m['param_mib']:11.1f} {m['activation_mib']:15.1f} {m['seconds']:8.2f}")
    ratios = {key: max(r["tp2"][key] for r in per_rank) / max(r["tp1"][key] for r in per_rank)
              for key in ("param_mib", "activation_mib")}
    print(f"per rank, tp=2 / tp=1: parameters {ratios['param_mib']:.3f}, "
          f"activations {ratios['activation_mib']:.3f}")
    return ratios


if __name__ == "__main__":
    main()
