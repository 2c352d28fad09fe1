"""RL prompt data: verl-style parquet/jsonl files, a tokenising dataset, and the prompt batch.

**File format** (verl's): one row per prompt with the columns

* ``prompt``: a string, or a chat list ``[{"role": "user", "content": "..."}, ...]``;
* ``reward_model``: ``{"style": "rule", "ground_truth": ...}`` — or the flattened column
  ``reward_model.ground_truth`` (pandas ``json_normalize`` style), or a top-level ``ground_truth``, or
  TRL's ``solution`` column. Optional: a row without one has ground truth ``None``, which rewards that
  need none (``format``, length or format rewards in TRL's signature) ignore and the built-in ``math`` /
  ``math_exact`` refuse, naming the fix;
* ``data_source``: the task name a reward function may dispatch on;
* ``extra_info`` (optional): a dict passed on to the reward function;
* any other column: passed by name to TRL-style reward functions (see ``verl_trainer.rewards.signature``).

Parquet is read with pyarrow (no ``datasets`` dependency), jsonl with ``json``; a ``datasets.Dataset``
(or any sequence of such rows) is read row by row; a hub dataset id (``openai/gsm8k``,
``org/name:config@split``) from the local HF cache, offline (:mod:`verl_trainer.data.hub`).
:func:`load_prompts` normalises every row to a
*record* ``{"prompt", "ground_truth", "data_source", "extra_info", "columns",
"index"}``.

**Prompt batch** (what :meth:`verl_trainer.rollout.BaseRollout.generate` takes): a ``TensorDict`` with
``batch_size=[B]`` built by :func:`collate_prompts`:

* ``prompts`` ``[B, P]`` long, **left**-padded prompt token ids (schema key ``prompts``);
* ``prompt_len`` ``[B]`` long; ``uid`` ``[B]`` long (the record's ``index``: the group id of its samples);
* non-tensor entries (``tensordict.NonTensorStack``, one Python object per sample, they follow
  indexing/``torch.cat``): ``ground_truth``, ``data_source``, ``extra_info``, ``columns`` (the prompt as
  written and the row's other columns, a dict).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import NonTensorStack, TensorDict
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from verl_trainer.data import schema
from verl_trainer.data.hub import parse_hub_dataset, read_hub_rows
from verl_trainer.data.jsonl import read_json_rows
from verl_trainer.data.schema import COLUMNS, DATA_SOURCE, EXTRA_INFO, GROUND_TRUTH

if TYPE_CHECKING:
    from types import ModuleType

    from transformers import PreTrainedTokenizerBase

TRUNCATION_MODES = ("error", "left", "right", "middle")
"""What a prompt longer than ``max_prompt_length`` becomes (verl's ``data.truncation``): an error, its last
(``left``: the start is cut), first (``right``) or first and last halves (``middle``) tokens."""


def _pyarrow_parquet(path: Path, action: str) -> ModuleType:
    """``pyarrow.parquet``, or an ``ImportError`` naming the file, the ``data`` extra and jsonl instead."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"{action} {str(path)!r} needs pyarrow, which is not installed: pip install 'verl-trainer[data]' "
            f"(pyarrow and datasets) or pip install pyarrow; or use a .jsonl file", name="pyarrow",
        ) from None
    return pq


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The raw rows of a ``.parquet`` (pyarrow: the ``data`` extra), ``.jsonl`` or ``.json`` file, as dicts.

    A path that is not a local file but a hub dataset id (``org/name[:config][@split]``, split ``train`` by
    default) is read from the local HF cache (:mod:`verl_trainer.data.hub`).
    """
    if str(path).startswith("reasoning_gym:"):  # generated rows (verl_trainer.environments.reasoning_gym)
        from verl_trainer.environments.reasoning_gym import reasoning_gym_rows

        return reasoning_gym_rows(str(path))
    if parse_hub_dataset(path) is not None:
        return read_hub_rows(str(path))
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return _pyarrow_parquet(path, "reading").read_table(path).to_pylist()
    if suffix in (".jsonl", ".json"):
        return read_json_rows(path)  # errors name the file and line
    raise ValueError(f"cannot read prompts from {str(path)!r}: use a .parquet, .jsonl or .json file")


SOLUTION = "solution"
"""TRL's ground-truth column (``accuracy_reward(completions, solution, **kwargs)``)."""


def _ground_truth(row: Mapping[str, Any]) -> Any:
    """The row's ground truth, or ``None``.

    verl's ``reward_model.ground_truth`` (nested or flattened), ``ground_truth``, TRL's ``solution``.
    """
    reward_model = row.get("reward_model")
    if isinstance(reward_model, Mapping) and reward_model.get(GROUND_TRUTH) is not None:
        return reward_model[GROUND_TRUTH]
    for key in (f"reward_model.{GROUND_TRUTH}", GROUND_TRUTH, SOLUTION):
        if row.get(key) is not None:
            return row[key]
    return None


def _check_prompt(prompt: Any, where: str) -> str | list[dict[str, str]]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: the prompt is empty; remove the row or give it a prompt")
        return prompt
    if isinstance(prompt, Sequence) and all(
        isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt
    ):
        if not any(str(m["content"]).strip() for m in prompt):
            raise ValueError(f"{where}: the chat prompt has no content ({prompt!r}); remove the row or fill "
                             f"it")
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    raise ValueError(
        f"{where}: prompt must be a string or a chat list of {{'role', 'content'}} dicts, got {prompt!r}"
    )


def normalize_record(row: Mapping[str, Any], index: int, prompt_key: str = "prompt",
                     default_data_source: str = "unknown") -> dict[str, Any]:
    """Normalise one verl-style row to a record.

    Args:
        row: A row of a prompt file (see the module docstring).
        index: Its position in the file; becomes the record's ``index`` (the ``uid`` of its samples).
        prompt_key: Column holding the prompt.
        default_data_source: Used when the row has no ``data_source``.

    Returns:
        ``{"prompt", "ground_truth", "data_source", "extra_info", "columns", "index"}``; ``columns`` holds
        the prompt as written and every other column of the row (what a TRL-style reward function gets by
        name).

    """
    where = f"prompt row {index}"
    if prompt_key not in row:
        raise ValueError(
            f"{where} has no {prompt_key!r} column (the prompt column, data.prompt_key); columns present: "
            f"{sorted(row)}. Set data.prompt_key to the column that holds the prompt."
        )
    extra = row.get(EXTRA_INFO)
    prompt = _check_prompt(row[prompt_key], where)
    known = {prompt_key, "reward_model", f"reward_model.{GROUND_TRUTH}", GROUND_TRUTH, DATA_SOURCE,
             EXTRA_INFO}
    return {
        "prompt": prompt,
        GROUND_TRUTH: _ground_truth(row),
        DATA_SOURCE: str(row.get(DATA_SOURCE) or default_data_source),
        EXTRA_INFO: dict(extra) if isinstance(extra, Mapping) else {},
        COLUMNS: {"prompt": prompt, **{k: v for k, v in row.items() if k not in known}},
        "index": index,
    }


def load_prompts(path: str | Path, prompt_key: str = "prompt",
                 default_data_source: str = "unknown") -> list[dict[str, Any]]:
    """Read a verl-style prompt file (parquet or jsonl) into normalised records.

    Args:
        path: ``.parquet`` / ``.pq`` (pyarrow), ``.jsonl`` (one JSON object a line) or ``.json``; or a hub
            dataset id in the local HF cache (``org/name[:config][@split]``, :mod:`verl_trainer.data.hub`).
        prompt_key: Column holding the prompt.
        default_data_source: Used for rows without ``data_source``.

    Returns:
        One record per row, ``index`` = row number (see :func:`normalize_record`).

    """
    rows = read_rows(Path(path))
    try:
        return [normalize_record(row, i, prompt_key, default_data_source) for i, row in enumerate(rows)]
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def to_verl_row(prompt: str | list[dict[str, str]], ground_truth: Any, data_source: str,
                extra_info: Mapping[str, Any] | None = None, ability: str = "math") -> dict[str, Any]:
    """One row in verl's column layout (``reward_model`` nested, style ``"rule"``)."""
    return {
        DATA_SOURCE: data_source,
        "prompt": prompt,
        "ability": ability,
        "reward_model": {"style": "rule", GROUND_TRUTH: ground_truth},
        EXTRA_INFO: dict(extra_info or {}),
    }


def save_rows(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write rows to ``.parquet`` (pyarrow) or ``.jsonl``; parent directories are created.

    Parquet columns are typed: every row needs the same kind of prompt (string or chat list), and dict
    columns read back with every key of any row (``None`` where a row lacked it).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        pq = _pyarrow_parquet(path, "writing")
        import pyarrow as pa

        try:
            table = pa.Table.from_pylist([dict(r) for r in rows])
        except (pa.ArrowTypeError, pa.ArrowInvalid) as err:
            raise ValueError(
                f"cannot write these rows to parquet ({err}): a parquet column holds one type, so every "
                "row needs the same kind of prompt (all strings or all chat lists) and extra_info values "
                "of one type per key; write .jsonl instead, or make the rows uniform"
            ) from err
        pq.write_table(table, path)
    elif suffix == ".jsonl":
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    else:
        raise ValueError(f"cannot write {str(path)!r}: use a .parquet or .jsonl file")
    return path


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, str]],
                  chat_template: bool | None = None,
                  tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """Tokenise a prompt to ids (no special tokens added beyond what the chat template writes).

    Args:
        tokenizer: A transformers tokenizer.
        prompt: Plain text, or a chat list.
        chat_template: ``None``: chat lists go through the tokenizer's chat template (with the generation
            prompt), strings are encoded as they are. ``True``: a string is wrapped as one user message
            first. ``False``: a chat list is joined as ``"role: content"`` lines.
        tools: JSON schemas of the tools (multi-turn rollouts), rendered by the chat template
            (``apply_chat_template(..., tools=tools)``, as transformers does for tool use); ``None``: none.

    Returns:
        The token ids.

    Raises:
        ValueError: ``tools`` with a prompt that does not go through the chat template.
    """
    use_template = isinstance(prompt, list) if chat_template is None else chat_template
    if tools and not use_template:
        raise ValueError(f"prompt {str(prompt)[:60]!r} is plain text, so the tools' schemas cannot be "
                         "rendered into it: give chat-list prompts or set data.chat_template=true, or set "
                         "algorithm.rollout.multi_turn.tools_in_prompt=false and describe the tools yourself")
    if use_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; pass chat_template=False")
        extra = {"tools": list(tools)} if tools else {}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    else:
        text = prompt if isinstance(prompt, str) else "".join(
            f"{m['role']}: {m['content']}\n" for m in prompt
        )
    return list(tokenizer.encode(text, add_special_tokens=False))


def check_template_renders_tools(tokenizer: PreTrainedTokenizerBase,
                                 tools: Sequence[Mapping[str, Any]]) -> None:
    """Fail early when the tokenizer's chat template ignores ``tools`` (the model would never see them).

    Raises:
        ValueError: The template renders the same text with and without the tools.
    """
    probe = [{"role": "user", "content": "hi"}]
    render = getattr(tokenizer, "apply_chat_template", None)
    if not getattr(tokenizer, "chat_template", None) or render is None:
        raise ValueError("the tokenizer has no chat_template, so the tools' schemas cannot be put in the "
                         "prompts; give a tokenizer with one, or set "
                         "algorithm.rollout.multi_turn.tools_in_prompt=false and describe the tools yourself")
    plain = render(probe, add_generation_prompt=True, tokenize=False)
    if render(probe, add_generation_prompt=True, tokenize=False, tools=list(tools)) == plain:
        names = [t.get("function", t).get("name") for t in tools]
        raise ValueError(f"the tokenizer's chat template ignores tools= (its output does not change with the "
                         f"schemas of {names}), so the model would not see them; use a template that renders "
                         "tools (Qwen2.5, Hermes, Llama 3.1 do), or set "
                         "algorithm.rollout.multi_turn.tools_in_prompt=false and describe the tools yourself")


def truncate(ids: list[int], max_length: int, mode: str) -> list[int]:
    """``ids`` cut to ``max_length`` tokens as ``mode`` says (``left``, ``right`` or ``middle``)."""
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[len(ids) - max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length - max_length // 2
        return ids[:head] + ids[len(ids) - max_length // 2:]
    raise ValueError(f"cannot truncate with mode {mode!r}; choose left, right or middle")


def _is_record(row: Any) -> bool:
    return isinstance(row, Mapping) and {"prompt", GROUND_TRUTH, DATA_SOURCE, EXTRA_INFO, "index"} <= set(row)


def _refuse_tools_column(rec: Mapping[str, Any], name: str) -> None:
    """Fail on TRL's per-sample ``tools`` column: it would be silently unused (tools are per run here)."""
    value = rec.get(COLUMNS, {}).get("tools")
    if value is not None and not (hasattr(value, "__len__") and len(value) == 0):
        raise ValueError(f"{name}: prompt row {rec.get('index')} has a `tools` column (TRL's per-sample "
                         f"tools: {str(value)[:80]}); tools are the run's here, not the row's, so it would "
                         "be ignored. Name the tools in algorithm.rollout.multi_turn.tools (or "
                         ".tool_config_path) and drop the column; data for your reward goes in another "
                         "column")


class PromptDataset(Dataset):
    """Tokenised prompts with their reward data; items are dicts, batches come from :meth:`collate`.

    Prompts are tokenised once, at construction.

    Args:
        source: A prompt file path or cached hub dataset id (see :func:`load_prompts`), rows of one (a list
            or a ``datasets.Dataset``; normalised as :func:`normalize_record` does), or records.
        tokenizer: A transformers tokenizer.
        max_prompt_length: Longest prompt in tokens.
        truncation: What a longer prompt becomes, one of :data:`TRUNCATION_MODES`.
        chat_template: See :func:`encode_prompt`.
        filter_overlong_prompts: Drop longer prompts instead (verl's ``data.filter_overlong_prompts``);
            ``truncation`` then never applies.
        name: What the messages call the source (e.g. the file's path).
        prompt_key: The prompt column of a file (verl's ``data.prompt_key``); records given as a list are
            already normalised.
        tools: The tools' JSON schemas, rendered into every prompt by the chat template (multi-turn
            rollouts: :func:`verl_trainer.agents.prompt_tool_schemas`); ``None``: none.

    Raises:
        ValueError: A prompt longer than ``max_prompt_length`` with ``truncation="error"`` (the message
            names the row, its length and both fixes), no prompt left after filtering, ``tools`` that
            the tokenizer's chat template does not render, or a row with TRL's per-sample ``tools`` column
            (the tools are the run's: ``algorithm.rollout.multi_turn.tools``).
    """

    def __init__(self, source: str | Path | Sequence[Mapping[str, Any]],
                 tokenizer: PreTrainedTokenizerBase,
                 max_prompt_length: int = 512, truncation: str = "error",
                 chat_template: bool | None = None, filter_overlong_prompts: bool = False,
                 name: str | None = None, prompt_key: str = "prompt",
                 tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation={truncation!r}; choose one of {TRUNCATION_MODES}")
        if tools:
            check_template_renders_tools(tokenizer, tools)
        records = load_prompts(source, prompt_key) if isinstance(source, (str, Path)) else [
            row if _is_record(row) else normalize_record(row, i, prompt_key) for i, row in enumerate(source)]
        name = name or (str(source) if isinstance(source, (str, Path)) else "the prompts")
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.max_prompt_length = max_prompt_length
        self.num_filtered = 0
        self.items: list[dict[str, Any]] = []
        for rec in records:
            _refuse_tools_column(rec, name)
            ids = encode_prompt(tokenizer, rec["prompt"], chat_template, tools)
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if truncation == "error":
                    raise ValueError(
                        f"{name}: prompt row {rec.get('index')} has {len(ids)} tokens > max_prompt_length="
                        f"{max_prompt_length}; raise data.max_prompt_length, set data.truncation to one of "
                        f"left/right/middle, or data.filter_overlong_prompts=true"
                    )
                ids = truncate(ids, max_prompt_length, truncation)
            reward_data = {GROUND_TRUTH: rec[GROUND_TRUTH], DATA_SOURCE: rec[DATA_SOURCE],
                           EXTRA_INFO: rec[EXTRA_INFO], COLUMNS: rec.get(COLUMNS, {"prompt": rec["prompt"]})}
            self.items.append({"input_ids": ids, **reward_data, "index": rec["index"]})
        if records and not self.items:
            raise ValueError(
                f"{name}: every one of its {len(records)} prompts is longer than max_prompt_length="
                f"{max_prompt_length}, so filter_overlong_prompts left none; raise the limit"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]

    def data_sources(self) -> set[str]:
        """The distinct ``data_source`` values of the prompts."""
        return {str(item[DATA_SOURCE]) for item in self.items}

    def collate(self, items: Sequence[Mapping[str, Any]]) -> TensorDict:
        """:func:`collate_prompts` with this dataset's pad id (use as a DataLoader ``collate_fn``)."""
        return collate_prompts(items, self.pad_token_id)


def collate_prompts(items: Sequence[Mapping[str, Any]], pad_token_id: int = 0) -> TensorDict:
    """Build a prompt batch from dataset items.

    Args:
        items: Dicts with ``input_ids`` (list of ints), ``index`` and, optionally, ``ground_truth``,
            ``data_source``, ``extra_info``.
        pad_token_id: Id written at the (left) padding positions.

    Returns:
        ``TensorDict`` [B]: ``prompts`` [B, P] left-padded, ``prompt_len`` [B], ``uid`` [B] (= index),
        and the non-tensor entries (see the module docstring).

    """
    b = len(items)
    lens = [len(it["input_ids"]) for it in items]
    if b and min(lens) == 0:
        raise ValueError("an empty prompt cannot be generated from; every prompt needs >= 1 token")
    width = max(lens, default=0)
    prompts = torch.full((b, width), pad_token_id, dtype=torch.long)
    for i, it in enumerate(items):
        if lens[i]:
            prompts[i, width - lens[i]:] = torch.as_tensor(list(it["input_ids"]), dtype=torch.long)
    batch = TensorDict(
        {
            schema.PROMPTS: prompts,
            schema.PROMPT_LEN: torch.tensor(lens, dtype=torch.long),
            schema.UID: torch.tensor([int(it.get("index", i)) for i, it in enumerate(items)]).long(),
        },
        batch_size=[b],
    )
    defaults = {GROUND_TRUTH: None, DATA_SOURCE: "unknown", EXTRA_INFO: {}, COLUMNS: {}}
    for key, default in defaults.items():
        batch[key] = NonTensorStack.from_list([it.get(key, default) for it in items])
    return batch


def make_prompt_dataloader(dataset: PromptDataset, batch_size: int, shuffle: bool = True, seed: int = 0,
                           drop_last: bool = True, rank: int = 0, world_size: int = 1) -> DataLoader:
    """A DataLoader of prompt batches; with ``world_size > 1`` each rank gets its shard.

    Args:
        dataset: The prompts.
        batch_size: Prompts per batch **per rank** (before ``n`` samples each).
        shuffle: Shuffle every epoch (call ``loader.sampler.set_epoch(e)`` when sharded).
        seed: Shuffle seed (the same on every rank).
        drop_last: Drop the last incomplete batch (keeps every step's batch the same size).
        rank: This process's data-parallel rank.
        world_size: Data-parallel size.

    Returns:
        A ``DataLoader`` yielding prompt batches (see :func:`collate_prompts`).

    """
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                      collate_fn=dataset.collate)
