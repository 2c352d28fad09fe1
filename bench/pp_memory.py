"""Parameter and activation memory per rank of pipeline parallelism: pp=2 vs pp=1.

Usage::

    python bench/pp_memory.py [--hidden 1024] [--layers 8] [--vocab 32000] [--micro-batches 4] [--tokens 512]

The same engine step both ways (``FSDPEngine``, a language model, fsdp2, fp32): a Llama (hidden 1024,
8 layers, 16 heads of 64, vocab 32k by default; ``bench/_common.py: write_model``) runs
``forward_backward_batch`` on ``--micro-batches`` micro-batches of one sample of ``--tokens`` tokens each
(the LM head on the response positions only, token-mean NLL — what a training step runs before the optimizer):

* pp=1: one rank runs the whole model, the micro-batches one after the other (the baseline, measured in
  the same run, in a 1-rank spawn so FSDP shards nothing);
* pp=2: two ranks (dp=1) each hold one stage — 4 decoder layers, the embedding on the first, the norm and
  LM head on the last — and run the micro-batches under the engine's 1F1B schedule.

Parameter memory per rank: the bytes of the parameters this rank stores. Activation memory:
``torch.distributed._tools.mem_tracker.MemTracker``'s peak of the step minus parameters, buffers,
gradients and optimizer state (as ``bench/tp_memory.py`` measures). 1F1B keeps up to ``pp - stage``
micro-batches in flight on a stage (2 on the first stage, 1 on the last), so the first stage's
activations are those of 4 layers x 2 micro-batches — about one whole-model micro-batch — and the last
stage's those of 4 layers x 1 micro-batch plus the LM head's. The ratios printed are pp=2 / pp=1 for the
larger stage.
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
from verl_trainer.data.packing import make_batch  # noqa: E402
from verl_trainer.engine import EngineConfig, EngineRegistry  # noqa: E402
from verl_trainer.testing import run_distributed  # noqa: E402


def _batch(samples: int, tokens: int, vocab: int) -> Any:
    g = torch.Generator().manual_seed(0)
    prompt = tokens // 4
    prompts = [torch.randint(4, vocab, (prompt,), generator=g).tolist() for _ in range(samples)]
    responses = [torch.randint(4, vocab, (tokens - prompt,), generator=g).tolist() for _ in range(samples)]
    return make_batch(prompts, responses)


def _nll(model_output: dict[str, torch.Tensor], micro_batch: Any, info: Any) -> tuple[torch.Tensor, dict]:
    mask = micro_batch["loss_mask"].float()
    return -(model_output["log_probs"] * mask).sum() / info.batch_num_tokens * info.dp_size, {}


def _tracker() -> Any:
    """``MemTracker`` without its per-module statistics (which allow one call per module per step).

    A step calls every stage module once per micro-batch; the whole-step peak by kind (parameters,
    gradients, activations, temporaries) comes from the tensor allocations and needs no module hooks.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepMemTracker(MemTracker):
        def _pre_fw_hook(self, *args: Any) -> None:
            pass

        def _post_fw_hook(self, *args: Any) -> None:
            pass

        def _pre_bw_hook(self, *args: Any) -> None:
            pass

        def _post_bw_hook(self, *args: Any) -> None:
            pass

    return StepMemTracker()


def _measure(path: str, pp: int, samples: int, tokens: int) -> dict[str, float]:
    engine = EngineRegistry.new("language_model", "fsdp2", EngineConfig(
        model_path=path, micro_batch_size_per_gpu=1, pipeline_model_parallel_size=pp), None)
    engine.initialize()
    engine.module.train()
    vocab = engine.model_config.vocab_size
    engine.forward_backward_batch(_batch(pp, 64, vocab), _nll)  # warm-up: allocates every .grad
    engine.module.zero_grad(set_to_none=False)
    batch = _batch(samples, tokens, vocab)
    dist.barrier()
    tracker = _tracker()
    tracker.track_external(engine.module)
    start = time.perf_counter()
    with tracker:
        engine.forward_backward_batch(batch, _nll)
    seconds = time.perf_counter() - start
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    by_kind = {str(k).rsplit(".", 1)[-1]: v for k, v in peak.items() if k != "Total"}
    fixed = sum(by_kind.get(k, 0) for k in ("PARAM", "BUFFER", "GRAD", "OPT"))
    return {"param_mib": local_param_mib(engine.module), "activation_mib": (peak["Total"] - fixed) / MIB,
            "seconds": seconds, "stage": engine.topology.pp_rank}


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark; returns the pp=2 / pp=1 ratios of parameter and activation memory."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches of one sample")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per sample")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_pp_") as tmp:
        path = str(Path(tmp) / "model")
        config = write_model(path, args.hidden, args.layers, args.vocab)
        runs = {pp: run_distributed(_measure, pp, path, pp, args.micro_batches, args.tokens, timeout=3600)
                for pp in (1, 2)}
    print(f"PP memory per rank: llama hidden={args.hidden} layers={args.layers} "
          f"heads={config.num_attention_heads} vocab={args.vocab}, {args.micro_batches} micro-batches of "
          f"{args.tokens} tokens, fp32, fsdp2 forward_backward_batch (pp=2: 1F1B)")
    print(f"{'':>12} {'params MiB':>11} {'activation MiB':>15} {'step s':>8}")
    for pp, per_rank in runs.items():
        for m in per_rank:
            print(f"pp{pp} stage {m['stage']}: {m['param_mib']:11.1f} {m['activation_mib']:15.1f} "
                  f"{m['seconds']:8.2f}")
    ratios = {key: max(r[key] for r in runs[2]) / max(r[key] for r in runs[1])
              for key in ("param_mib", "activation_mib")}
    print(f"per rank (the larger stage), pp=2 / pp=1: parameters {ratios['param_mib']:.3f}, "
          f"activations {ratios['activation_mib']:.3f}")
    return ratios


if __name__ == "__main__":
    main()
