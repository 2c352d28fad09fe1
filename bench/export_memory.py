"""Peak memory of exporting an engine's model as an HF directory: ``engine.save_hf`` vs. a full-copy export.

The baseline (reproduced below) clones every full tensor into a dict, loads a second model from the source
checkpoint, loads the dict into it and calls ``save_pretrained``: about two extra copies of the model.
``engine.save_hf`` streams ``get_per_tensor_param()`` into safetensors shards of ``--shard-mb`` and holds at
most one shard plus one tensor. Each side runs in its own process (peak RSS is a per-process high-water
mark) on an inference-only fsdp2 engine (one gloo rank) of the same Llama; reported is the peak RSS during
the export (the kernel's high-water mark, reset after the engine was built) minus the RSS before it, and the
ratio baseline / save_hf measured in this run. Both outputs are checked to hold the same tensors.

Usage: python bench/export_memory.py [--hidden 1024] [--layers 8] [--vocab 32000] [--shard-mb 100]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import init_single_process, save_json, write_model  # noqa: E402


def _rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def _reset_peak() -> None:
    """Reset this process's peak RSS to its current RSS (Linux >= 4.0: ``5`` into ``clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def _peak_rss_mib() -> float:
    """Peak RSS since the last :func:`_reset_peak` (``VmHWM``), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _baseline_export(engine, source: str, out: Path) -> None:
    """The baseline export: a full copy of the tensors + a second model, then ``save_pretrained``."""
    from verl_trainer.models.loading import load_causal_lm

    params = {name: tensor.detach().cpu().clone() for name, tensor in engine.get_per_tensor_param()}
    model = load_causal_lm(source)
    model.load_state_dict(params, strict=True)
    model.save_pretrained(out)


def run_side(args: argparse.Namespace) -> dict:
    from verl_trainer.engine import EngineConfig, EngineRegistry

    torch.set_num_threads(2)
    init_single_process(torch.device("cpu"))
    engine = EngineRegistry.new("language_model", "fsdp2", EngineConfig(model_path=args.model), None)
    engine.initialize()
    base = _rss_mib()
    _reset_peak()  # loading and sharding the model peak higher than the export: measure the export only
    t0 = time.perf_counter()
    if args.side == "baseline":
        _baseline_export(engine, args.model, Path(args.out))
    else:
        engine.save_hf(args.out, max_shard_size=args.shard_mb * 2**20)
    return {"side": args.side, "peak_rss_growth_mib": _peak_rss_mib() - base,
            "seconds": time.perf_counter() - t0}


def _tensors(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(directory).glob("*.safetensors")) for k, v in load_file(f).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mb", type=int, default=100)
    parser.add_argument("--json", default=None)
    parser.add_argument("--side", choices=["baseline", "save_hf"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side is not None:
        print(json.dumps(run_side(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "model")
        write_model(model, args.hidden, args.layers, args.vocab)
        size_mib = sum(p.stat().st_size for p in Path(model).glob("*.safetensors")) / 2**20
        results = {}
        for side in ("baseline", "save_hf"):
            out = str(Path(tmp) / side)
            cmd = [sys.executable, __file__, f"--shard-mb={args.shard_mb}", "--side", side, "--model", model,
                   "--out", out]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[side] = json.loads(proc.stdout.strip().splitlines()[-1])
        a, b = _tensors(str(Path(tmp) / "baseline")), _tensors(str(Path(tmp) / "save_hf"))
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        shards = len(list((Path(tmp) / "save_hf").glob("model-*.safetensors")))
    print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {size_mib:.0f} MiB of fp32 "
          f"weights; fsdp2, 1 CPU rank; save_hf shards of {args.shard_mb} MiB ({shards} files)")
    for side in ("baseline", "save_hf"):
        r = results[side]
        print(f"  {side:>8}: peak RSS growth {r['peak_rss_growth_mib']:8.1f} MiB   {r['seconds']:.1f} s")
    ratio = results["baseline"]["peak_rss_growth_mib"] / max(results["save_hf"]["peak_rss_growth_mib"], 1e-9)
    print(f"  baseline / save_hf: peak memory {ratio:.2f}x; the same tensors written: {same}")
    save_json(args.json, {"config": vars(args), "results": results, "ratio": ratio, "same": same})


if __name__ == "__main__":
    main()
