"""reasoning-gym's procedural tasks as prompt datasets, scored by each task's own verifier.

A data path ``reasoning_gym:<task>[@<split>][?<key>=<value>&...]`` (``data.train_files``,
``data.val_files``, ``warm_start.train_files``) is generated in the process that reads it, offline and
seeded, by ``reasoning_gym.create_dataset(<task>, seed=seed, size=size, **config)``:

* ``split``: ``train`` (default), ``val`` or ``sft`` (the ``train`` rows as SFT pairs ``prompt`` /
  ``response``, the response the task's oracle answer).
* Keys of this adapter: ``seed`` (default 0), ``size`` (problems generated, default 1000), ``val_fraction``
  (default 0.2) and ``chat`` (default ``true``: a one-message chat prompt; ``false``: the question string).
  Every other key is a field of the task's reasoning-gym config, its value read as JSON when it parses
  (``max_digits=1``, ``operators=["+","-"]``), else as the string. Pairs are split on ``&`` and ``=`` and
  taken literally (no URL decoding).
* Train and validation are disjoint by construction: the generated problems are grouped by question text,
  and a question is held out when ``sha256(f"{seed}:{question}")`` maps below ``val_fraction`` (a pure
  function of the question, so both splits agree in every process). ``train`` keeps every generated row of
  its questions (repeats included, reasoning-gym's frequencies); ``val`` keeps each held-out question once.

Rows are verl rows (:func:`verl_trainer.data.prompts.to_verl_row`): ``ground_truth`` the oracle answer,
``data_source`` ``reasoning_gym/<task>``, ``extra_info`` the task, config, question, answer and the task's
``metadata`` (JSON text). :func:`score` (``algorithm.reward.name=
verl_trainer.environments.reasoning_gym:score``) rebuilds the task and calls its ``score_answer(answer,
entry)``, so each task is judged by its own verifier (partial credit where the task gives it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl_trainer.data.prompts import ROW_SOURCES, to_verl_row

__all__ = ["PREFIX", "ReasoningGymSource", "check_source", "is_reasoning_gym", "parse_source",
           "reasoning_gym_rows", "score"]

PREFIX = "reasoning_gym:"
SPLITS = ("train", "val", "sft")
ADAPTER_KEYS = ("seed", "size", "val_fraction", "chat")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class ReasoningGymSource:
    """A parsed ``reasoning_gym:`` data path (see the module docstring).

    Attributes:
        task: The reasoning-gym dataset name.
        split: ``train``, ``val`` or ``sft``.
        seed: Seed of the generator and of the split.
        size: Problems generated before the split.
        val_fraction: Share of the distinct questions held out for ``val``, in (0, 1).
        chat: Prompts as a one-message chat list (else the question string).
        config: The task's own config fields.
    """

    task: str
    split: str = "train"
    seed: int = 0
    size: int = 1000
    val_fraction: float = 0.2
    chat: bool = True
    config: dict[str, Any] = field(default_factory=dict)


def is_reasoning_gym(path: Any) -> bool:
    """Whether ``path`` is a ``reasoning_gym:`` data path."""
    return isinstance(path, str) and path.startswith(PREFIX)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_source(path: str) -> ReasoningGymSource:
    """Parse and check ``path`` (the task exists, the keys are the task's or this adapter's).

    Raises:
        ImportError: reasoning-gym is not installed (names the extra).
        ValueError: An unknown task (the message lists the tasks), split, config key or a bad value.
    """
    datasets = _registry()
    body, _, query = path[len(PREFIX):].partition("?")
    task, _, split = body.partition("@")
    split = split or "train"
    fix = f"write {PREFIX}<task>[@train|val|sft][?key=value&...]"
    if task not in datasets:
        raise ValueError(f"data path {path!r}: reasoning-gym has no task {task!r}; choose one of "
                         f"{sorted(datasets)}; {fix}")
    if split not in SPLITS:
        raise ValueError(f"data path {path!r}: split {split!r} is unknown; choose one of {SPLITS}; {fix}")
    pairs = [item.partition("=") for item in query.split("&") if item]  # taken literally: "+" stays "+"
    malformed = [k for k, eq, _ in pairs if not eq or not k]
    if malformed:
        raise ValueError(f"data path {path!r}: {malformed} are not key=value pairs; {fix}")
    params = {k: _value(v) for k, _, v in pairs}
    own = {k: params.pop(k) for k in ADAPTER_KEYS if k in params}
    fields = set(datasets[task][1].__dataclass_fields__)
    bad = sorted(set(params) - fields)
    if bad:
        raise ValueError(f"data path {path!r}: {bad} are not fields of reasoning-gym's {task} config; choose "
                         f"from {sorted(fields - {'seed', 'size'})} or this adapter's {ADAPTER_KEYS}")
    source = ReasoningGymSource(task, split, int(own.get("seed", 0)), int(own.get("size", 1000)),
                                float(own.get("val_fraction", 0.2)), bool(own.get("chat", True)), params)
    if source.size < 1:
        raise ValueError(f"data path {path!r}: size={source.size} must be >= 1 (problems generated)")
    if not 0.0 < source.val_fraction < 1.0:
        raise ValueError(f"data path {path!r}: val_fraction={source.val_fraction} must be in (0, 1) "
                         "(train and val are disjoint sets of questions)")
    return source


def check_source(path: str, key: str) -> None:
    """Check a ``reasoning_gym:`` path given as config ``key`` (:func:`parse_source`'s errors, key named)."""
    try:
        parse_source(path)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def _registry() -> dict[str, Any]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ImportError("reasoning_gym: data paths need reasoning-gym: pip install 'verl-trainer[envs]'",
                          name="reasoning_gym") from None
    return DATASETS


@functools.lru_cache(maxsize=16)
def _dataset(task: str, config_json: str, seed: int, size: int) -> Any:
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **json.loads(config_json))
    except (AssertionError, TypeError, ValueError) as exc:
        raise ValueError(f"reasoning-gym refused the {task} config {config_json} ({type(exc).__name__}: "
                         f"{exc}); fix the key=value pairs of the data path") from None


def _held_out(seed: int, question: str, fraction: float) -> bool:
    digest = hashlib.sha256(f"{seed}:{question}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < fraction


def reasoning_gym_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a ``reasoning_gym:`` data path: verl rows (``train`` / ``val``) or SFT pairs (``sft``).

    Raises:
        ValueError: A bad path (:func:`parse_source`), or a split with no rows (names the fix).
    """
    src = parse_source(path)
    config_json = json.dumps(src.config, sort_keys=True)
    data = _dataset(src.task, config_json, src.seed, src.size)
    want_val = src.split == "val"
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for entry in data:
        question = entry["question"]
        if _held_out(src.seed, question, src.val_fraction) != want_val or (want_val and question in seen):
            continue
        seen.add(question)
        answer = str(entry["answer"])
        prompt: Any = [{"role": "user", "content": question}] if src.chat else question
        if src.split == "sft":
            rows.append({"prompt": prompt, "response": answer})
            continue
        extra = {"split": src.split, "index": len(rows), "task": src.task, "config": config_json,
                 "seed": src.seed, "question": question, "answer": answer,
                 "metadata": json.dumps(entry.get("metadata", {}), default=str)}
        rows.append(to_verl_row(prompt, answer, f"reasoning_gym/{src.task}", extra, ability="reasoning"))
    if not rows:
        raise ValueError(f"data path {path!r}: the {src.split} split is empty ({src.size} problems, "
                         f"val_fraction={src.val_fraction}); raise size or move val_fraction")
    return rows


ROW_SOURCES.add(PREFIX.rstrip(":"), reasoning_gym_rows)  # read_rows generates "reasoning_gym:..." paths


def extract_answer(solution_str: str) -> str:
    """The last ``<answer>...</answer>`` of the response, else the whole response, stripped."""
    tagged = _ANSWER_TAG.findall(solution_str)
    return (tagged[-1] if tagged else solution_str).strip()


def score(data_source: str, solution_str: str, ground_truth: Any,
          extra_info: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The task's own verifier: ``score_answer(extract_answer(solution_str), entry)`` in [0, 1].

    ``entry`` is the generated problem (question, oracle answer, metadata) from ``extra_info``.

    Returns:
        ``{"score": s, "acc": 1.0 if s == 1 else 0.0}``.

    Raises:
        ValueError: ``extra_info`` lacks the task (the row was not made by :func:`reasoning_gym_rows`).
    """
    if not extra_info or "task" not in extra_info or "config" not in extra_info:
        raise ValueError(f"reward reasoning_gym score: the row of data_source={data_source!r} has no "
                         "extra_info.task / config; use it with reasoning_gym: data paths")
    data = _dataset(extra_info["task"], extra_info["config"], int(extra_info.get("seed", 0)), 1)
    entry = {"question": extra_info.get("question", ""), "answer": str(ground_truth),
             "metadata": json.loads(extra_info.get("metadata") or "{}")}
    value = float(data.score_answer(extract_answer(solution_str), entry))
    return {"score": value, "acc": float(value == 1.0)}
