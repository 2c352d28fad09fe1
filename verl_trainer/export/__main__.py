"""``python -m verl_trainer.export CKPT_DIR OUT_DIR``: a saved checkpoint to an HF directory, one process.

Examples::

    python -m verl_trainer.export outputs/grpo/checkpoints outputs/grpo/hf_step      # newest step_*
    python -m verl_trainer.export outputs/ppo/checkpoints/step_000100 out --engine critic
"""

from __future__ import annotations

import argparse
import pickle
import sys

from verl_trainer.models.hf_files import DTYPES


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, convert, print where the model went; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m verl_trainer.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR",
                        help="step_* checkpoint, checkpoints dir (newest step) or step_*/engines/<name>")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the HF directory to write")
    parser.add_argument("--engine", default="actor", help="engine of a trainer checkpoint (default: actor)")
    parser.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors file (default: 5GB)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="save the weights in this dtype (default: as stored)")
    parser.add_argument("--tokenizer", default=None,
                        help="take the tokenizer from here when the checkpoint has none")
    args = parser.parse_args(argv)

    from verl_trainer.export.convert import convert_checkpoint  # lazy: loads transformers only when used

    try:
        out = convert_checkpoint(args.ckpt_dir, args.out_dir, engine=args.engine,
                                 max_shard_size=args.max_shard_size,
                                 dtype=DTYPES[args.dtype] if args.dtype else None, tokenizer=args.tokenizer)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as exc:  # they say the fix
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote the HF model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
