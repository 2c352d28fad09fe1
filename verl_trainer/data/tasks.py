"""A synthetic arithmetic task for the default runs: prompt files for RL, examples for an SFT warm start.

Problems are ``"{a}{op}{b}="`` with the integer result as the answer (``"3+4="`` -> ``"7"``); the
character tokenizer makes this one token per character. The default — single-digit addition, 100
distinct problems — is small enough for the tiny demo model (2 layers, hidden 64) to learn on CPU in
seconds. For a GRPO demo, warm-start with a *short* SFT (format learned, accuracy well below 100%) so the
reward has room to rise.

Files use verl's columns (see :mod:`verl_trainer.data.prompts`): ``prompt`` (a string, or a chat list
with ``chat=True``), ``reward_model.ground_truth`` (the answer as a string), ``data_source``
(``"arithmetic"``), ``extra_info`` (split, index, question, answer). SFT files hold ``prompt`` and
``response`` (the answer text; the eos is appended at tokenisation). Everything is deterministic given
the seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_trainer.data.prompts import save_rows, to_verl_row

OPERATIONS = ("+", "-", "*")


@dataclass
class ArithmeticTaskConfig:
    """What problems to generate.

    Attributes:
        num_train: Training rows (drawn with replacement from the training problems).
        num_val: Validation rows (without replacement while the pool lasts).
        min_operand: Smallest operand.
        max_operand: Largest operand (inclusive).
        operations: Any of ``"+"``, ``"-"``, ``"*"``.
        holdout_fraction: Fraction of the distinct problems kept out of training; validation draws
            from them. 0: validation draws from the same problems as training.
        chat: Write prompts as a one-message chat list (``[{"role": "user", "content": "3+4="}]``)
            instead of the plain string.
        data_source: The ``data_source`` column.
        seed: Seed of every random choice.
        tool_traces: Also write ``sft_tool_train``: this many calculator tool-use traces (chat rows, see
            :func:`tool_trace_rows`) of the first training rows, for an SFT warm start before multi-turn RL
            (``configs/grpo_tools.yaml``); 0: none.

    """

    num_train: int = 1000
    num_val: int = 100
    min_operand: int = 0
    max_operand: int = 9
    operations: tuple[str, ...] = ("+",)
    holdout_fraction: float = 0.0
    chat: bool = False
    data_source: str = "arithmetic"
    seed: int = 0
    tool_traces: int = 0

    def __post_init__(self) -> None:
        self.operations = tuple(self.operations)
        bad = [op for op in self.operations if op not in OPERATIONS]
        if bad or not self.operations:
            raise ValueError(f"operations={self.operations!r}: choose a non-empty subset of {OPERATIONS}")
        if self.min_operand > self.max_operand:
            raise ValueError(f"min_operand={self.min_operand} > max_operand={self.max_operand}")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction={self.holdout_fraction} must be in [0, 1)")
        if self.num_train < 0 or self.num_val < 0:
            raise ValueError(f"num_train={self.num_train} and num_val={self.num_val} must be >= 0")
        if not 0 <= self.tool_traces <= self.num_train:
            raise ValueError(f"tool_traces={self.tool_traces} must be in [0, num_train={self.num_train}] "
                             "(traces are made from the training rows)")


def solve(a: int, op: str, b: int) -> int:
    """The result of ``a op b``."""
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def all_problems(config: ArithmeticTaskConfig) -> list[tuple[int, str, int]]:
    """Every distinct ``(a, op, b)``, in a fixed order."""
    operands = range(config.min_operand, config.max_operand + 1)
    return [(a, op, b) for op in config.operations for a in operands for b in operands]


def _row(problem: tuple[int, str, int], split: str, index: int,
         config: ArithmeticTaskConfig) -> dict[str, Any]:
    a, op, b = problem
    question, answer = f"{a}{op}{b}=", str(solve(a, op, b))
    prompt: str | list[dict[str, str]] = [{"role": "user", "content": question}] if config.chat else question
    extra = {"split": split, "index": index, "question": question, "answer": answer}
    return to_verl_row(prompt, answer, config.data_source, extra)


def make_arithmetic_rows(config: ArithmeticTaskConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Generate the train and validation rows (verl columns).

    Returns:
        ``(train_rows, val_rows)``.

    """
    rng = random.Random(config.seed)
    problems = all_problems(config)
    rng.shuffle(problems)
    n_hold = int(round(config.holdout_fraction * len(problems)))
    if config.holdout_fraction > 0 and not 0 < n_hold < len(problems):
        raise ValueError(
            f"holdout_fraction={config.holdout_fraction} of {len(problems)} problems leaves no train or no "
            "validation problems"
        )
    train_pool = problems[n_hold:]
    val_pool = problems[:n_hold] if n_hold else problems
    train = [rng.choice(train_pool) for _ in range(config.num_train)]
    if config.num_val <= len(val_pool):
        val = rng.sample(val_pool, config.num_val)
    else:
        val = [rng.choice(val_pool) for _ in range(config.num_val)]
    return ([_row(p, "train", i, config) for i, p in enumerate(train)],
            [_row(p, "val", i, config) for i, p in enumerate(val)])


def sft_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """SFT rows ``{"prompt", "response"}`` from verl rows: the response is the ground-truth answer."""
    return [{"prompt": r["prompt"], "response": str(r["reward_model"]["ground_truth"])} for r in rows]


def preference_rows(rows: Sequence[Mapping[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Preference pairs ``{"prompt", "chosen", "rejected"}`` from SFT rows of the arithmetic task.

    ``chosen`` is the row's answer; ``rejected`` a wrong one, the answer plus an offset in ``[-3, 3]`` other
    than 0, drawn per row from ``seed`` (a negative number for an answer below the offset).
    """
    rng = random.Random(seed)
    out = []
    for r in rows:
        answer = int(r["response"])
        offset = rng.choice([-3, -2, -1, 1, 2, 3])
        out.append({"prompt": r["prompt"], "chosen": str(answer), "rejected": str(answer + offset)})
    return out


def tool_trace_rows(rows: Sequence[Mapping[str, Any]], end_of_turn: str = "<eos>") -> list[dict[str, Any]]:
    """Calculator tool-use traces as SFT chat rows (``messages``; the loss on the assistant turns only).

    A trace: the user's question, the assistant's Hermes call of ``calculator`` on the question's
    expression, the tool's result, the assistant's answer::

        user: 12*34=
        assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call><eos>
        tool: 408
        assistant: 408<eos>

    Args:
        rows: Verl rows of this task (``extra_info.question``, the ground truth).
        end_of_turn: Text ending each assistant turn, so the model learns to stop there and the multi-turn
            rollout runs the call (the tiny models' templates end a message with a newline only; their
            tokenizer's eos is ``<eos>``).
    """
    traces = []
    for row in rows:
        question, answer = row["extra_info"]["question"], str(row["reward_model"]["ground_truth"])
        call = json.dumps({"name": "calculator", "arguments": {"expression": question.rstrip("=")}})
        traces.append({"messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>{end_of_turn}"},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": f"{answer}{end_of_turn}"},
        ]})
    return traces


def write_arithmetic_task(out_dir: str | Path, config: ArithmeticTaskConfig | None = None,
                          fmt: str = "jsonl") -> dict[str, Path]:
    """Write ``train``, ``val`` (RL prompts) and ``sft_train``, ``sft_val`` files to ``out_dir``.

    Args:
        out_dir: Output directory (created).
        config: The task; default :class:`ArithmeticTaskConfig()`.
        fmt: ``"jsonl"`` or ``"parquet"``.

    Returns:
        ``{"train": path, "val": path, "sft_train": path, "sft_val": path}``, and ``"sft_tool_train"``
        with ``config.tool_traces``.

    """
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"fmt={fmt!r}; choose 'jsonl' or 'parquet'")
    config = config or ArithmeticTaskConfig()
    train, val = make_arithmetic_rows(config)
    out = Path(out_dir)
    paths = {
        "train": save_rows(train, out / f"train.{fmt}"),
        "val": save_rows(val, out / f"val.{fmt}"),
        "sft_train": save_rows(sft_rows(train), out / f"sft_train.{fmt}"),
        "sft_val": save_rows(sft_rows(val), out / f"sft_val.{fmt}"),
    }
    if config.tool_traces:
        traces = tool_trace_rows(train[: config.tool_traces])
        paths["sft_tool_train"] = save_rows(traces, out / f"sft_tool_train.{fmt}")
    return paths
