"""Sample generations of a validation (or a training step), for a person to read.

Validation generations are written as JSONL under the run directory, printed to the console and logged as
a wandb table.

verl's ``trainer.log_val_generations``: ``algorithm.val_rollout.log_generations`` = ``N`` keeps the first
``N`` real samples of each validation (of rank 0's share of the validation set, in order) with their prompt
(as written in the data file), response text, score, ground truth and data source (and, in multi-turn runs,
the conversation's messages). Each validation writes
``<trainer.default_root_dir>/generations/val_step_<step>.jsonl`` (one JSON object per sample, replaced when
the same step validates again), prints the samples, and logs ``val/generations`` (a table) to every logger
that takes tables (Lightning's ``WandbLogger``, offline included). TRL's ``log_completions`` /
``num_completions_to_print``: ``algorithm.log_train_generations`` = ``N`` does the same with the first ``N``
samples of each training step (``train_step_<step>.jsonl``, ``train/generations``; ``step`` counts from 1).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from verl_trainer.algorithms.stages import StepMetrics
from verl_trainer.data import schema
from verl_trainer.data.schema import non_tensor_lists

__all__ = ["GENERATION_COLUMNS", "GenerationLog", "TrainGenerations", "generation_rows"]

GENERATION_COLUMNS = ("step", "data_source", "prompt", "response", "score", "ground_truth")
"""The table's columns (the JSONL rows hold these, plus ``messages`` in multi-turn runs)."""


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # chat messages
        return "\n".join(f"{m.get('role')}: {m.get('content')}" if isinstance(m, dict) else str(m)
                         for m in prompt)
    return "" if prompt is None else str(prompt)


def generation_rows(batch: TensorDict, scores: torch.Tensor, step: int, limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` real (non-padding) samples of a scored rollout batch, as plain rows.

    Each row: ``step``, ``data_source``, ``prompt`` (as written), ``response`` (its text), ``score``,
    ``ground_truth``; ``messages`` (the trajectory after the prompt) in a multi-turn batch.
    """
    data = non_tensor_lists(batch, (*schema.NON_TENSOR_KEYS, "response_text", "agent_info"))
    real = schema.real_mask(batch).tolist()
    texts = data.get("response_text") or [""] * len(real)
    columns = data.get(schema.COLUMNS) or [{} for _ in real]
    rows: list[dict[str, Any]] = []
    for i, keep in enumerate(real):
        if not keep or len(rows) >= limit:
            continue
        row = {"step": int(step), "data_source": (data.get(schema.DATA_SOURCE) or ["unknown"] * len(real))[i],
               "prompt": columns[i].get("prompt"), "response": texts[i], "score": float(scores[i]),
               "ground_truth": (data.get(schema.GROUND_TRUTH) or [None] * len(real))[i]}
        if data.get("agent_info"):
            row["messages"] = data["agent_info"][i]["messages"]
        rows.append(row)
    return rows


class GenerationLog:
    """Keeps, shows and writes the first ``limit`` samples of each validation (see the module docstring).

    Args:
        limit: Samples per validation (or training step); ``0``: off.
        stage: ``"val"`` (validation: the step is ``global_step``) or ``"train"`` (a training step: the
            step is ``global_step + 1``, the step being trained).
    """

    def __init__(self, limit: int, stage: str = "val") -> None:
        if stage not in ("val", "train"):
            raise ValueError(f"stage={stage!r}; choose 'val' or 'train'")
        self.limit = int(limit)
        self.stage = stage
        self.rows: list[dict[str, Any]] = []

    def record(self, batch: TensorDict, scores: torch.Tensor, batch_idx: int, trainer: Any) -> None:
        """Add one validation batch's samples (``batch_idx == 0`` starts a new validation).

        Only on the global-zero rank, with a trainer attached; prints the new samples, rewrites the step's
        JSONL file and logs the table of the validation's samples so far.
        """
        if self.limit <= 0 or trainer is None or not trainer.is_global_zero:
            return
        if batch_idx == 0:
            self.rows = []
        room = self.limit - len(self.rows)
        if room <= 0:
            return
        step = int(trainer.global_step) + (self.stage == "train")
        new = generation_rows(batch, scores, step, room)
        if not new:
            return
        self.rows += new
        _print(new, step, "validation" if self.stage == "val" else "training")
        path = Path(trainer.default_root_dir) / "generations" / f"{self.stage}_step_{step}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, default=str) + "\n" for r in self.rows))
        _log_table(getattr(getattr(trainer, "logging", None), "loggers", []), self.rows, step,
                   f"{self.stage}/generations")


def _print(rows: Sequence[dict[str, Any]], step: int, stage: str) -> None:
    print(f"\n[{stage} generations, step {step}]", flush=False)
    for r in rows:
        print(f"--- prompt ({r['data_source']}):\n{_prompt_text(r['prompt'])}\n"
              f"--- response:\n{r['response']}\n"
              f"--- score {r['score']:g}, ground truth {r['ground_truth']!r}", flush=False)
    print(flush=True)


def _log_table(loggers: Sequence[Any], rows: Sequence[dict[str, Any]], step: int, key: str) -> None:
    data = [[r["step"], str(r["data_source"]), _prompt_text(r["prompt"]), str(r["response"]), r["score"],
             json.dumps(r["ground_truth"], default=str)] for r in rows]
    for logger in loggers:
        if callable(getattr(logger, "log_table", None)):
            logger.log_table(key=key, columns=list(GENERATION_COLUMNS), data=data, step=step)


class TrainGenerations:
    """The scorer's part that records a training step's scored samples (``log_train_generations``).

    Args:
        log: A ``stage="train"`` log with ``limit > 0``.
        trainer: The trainer whose logger and rank it writes with.
    """

    def __init__(self, log: GenerationLog, trainer: Any) -> None:
        self.log = log
        self.trainer = trainer

    def after_score(self, scorer: Any, batch: TensorDict, scores: torch.Tensor, step: int,
                    metrics: StepMetrics) -> None:
        """Record the batch's first samples with their shaped ``scores`` ``[B]``."""
        self.log.record(batch, scores, 0, self.trainer)
