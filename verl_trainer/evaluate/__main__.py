"""``python -m verl_trainer.evaluate MODEL_OR_CHECKPOINT data.val_files=... [key=value ...]``.

Examples::

    python -m verl_trainer.evaluate outputs/grpo/hf data.val_files=outputs/data/arithmetic/val.jsonl \
        eval.n=8 "eval.k=[1,4,8]" eval.output=outputs/eval/grpo.json
    python -m verl_trainer.evaluate outputs/grpo/checkpoints data.val_files=my_data/val.parquet \
        eval.n=16 eval.rollout.temperature=0.6 eval.rollout.max_new_tokens=512 reward.name=my_reward.py:score

MODEL_OR_CHECKPOINT is an HF directory, a hub id already in the HF cache, or a checkpoint (``step_*``, a
checkpoints directory: its newest step, or ``step_*/engines/actor``). Keys: ``--print-config`` lists them
(schema: ``verl_trainer.evaluate.config.EvaluateConfig``).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Parse, evaluate, print the table; returns the exit status."""
    from verl_trainer.evaluate.config import EvaluateConfig  # lazy: loads transformers only when used
    from verl_trainer.recipe_config.loading import (
        parse_recipe_args,  # lazy: loads transformers only when used
    )

    args = list(sys.argv[1:] if argv is None else argv)
    positional = [a for a in args if "=" not in a and not a.startswith("-")]
    if len(positional) > 1:
        print(f"error: one MODEL_OR_CHECKPOINT, got {positional}; the rest must be key=value overrides",
              file=sys.stderr)
        return 2
    rest = [a for a in args if a not in positional]
    if positional:
        rest.insert(0, f"model={positional[0]}")
    cfg = parse_recipe_args(EvaluateConfig, None, rest, description=__doc__)

    from rich.console import Console

    from verl_trainer.evaluate.run import evaluate, format_table  # lazy: loads transformers only when used
    from verl_trainer.rewards.failures import RewardError  # lazy: 4 more modules only when used

    try:
        report = evaluate(cfg)
    except (FileNotFoundError, FileExistsError, ValueError, ImportError, RewardError) as exc:  # say the fix
        print(f"error: {exc}", file=sys.stderr)
        return 1
    console = Console()
    console.print(format_table(report))
    if cfg.eval.output:
        console.print(f"report: {cfg.eval.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
