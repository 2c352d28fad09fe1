"""Datamodules for ``Trainer.fit``: RL prompts and SFT pairs from verl-style files.

Batch sizes in :class:`DataConfig` are **global** (verl's ``data.train_batch_size``: prompts per step over
all data-parallel ranks); the DataLoader each rank gets holds ``train_batch_size / dp_size`` of them
(the Trainer shards the dataset by DP rank). The DP size is read when ``train_dataloader()`` is called —
inside ``fit``, once the process group and the engines exist — as the Trainer's DP size (``trainer.dp_size``,
which counts the ranks of one SP / TP group once) when the Trainer has attached itself
(``datamodule.trainer``, Lightning's attribute), else as ``world_size // sp_size``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader
from transformers import AutoConfig

from verl_trainer.data.hub import data_fingerprint, parse_hub_dataset, resolve_hub_split, with_default_split
from verl_trainer.data.prompts import TRUNCATION_MODES, PromptDataset
from verl_trainer.data.sft import SFTDataset
from verl_trainer.data.vlm_processor import VisionProcessor
from verl_trainer.environments.reasoning_gym import check_source, is_reasoning_gym
from verl_trainer.models.source import resolve_model_path
from verl_trainer.models.vlm import is_vision_language
from verl_trainer.utils.distributed import get_world_size

__all__ = ["DataConfig", "PromptDataModule", "SFTDataModule", "dp_size_now", "vision_processor"]


@dataclass
class DataConfig:
    """Where the data is and how it is batched.

    Attributes:
        train_files: Training file (``.jsonl`` / ``.parquet``; RL: verl's prompt columns, SFT: ``prompt``
            and ``response``), or a hub dataset id in the local HF cache (``org/name[:config][@split]``,
            split ``train`` by default; :mod:`verl_trainer.data.hub`).
        val_files: Validation file or cached hub dataset id (split ``test`` by default), or ``None``.
        train_batch_size: Prompts (RL) or examples (SFT) per step, over all DP ranks.
        val_batch_size: Validation prompts per batch over all DP ranks; ``None``: the whole file at once.
        max_prompt_length: Longest prompt in tokens (RL; see ``truncation``).
        truncation: A longer prompt is an ``error`` (default) or cut at the ``left``, ``right`` or
            ``middle`` (verl's ``data.truncation``).
        filter_overlong_prompts: Drop longer prompts at load time instead (verl's name).
        max_length: Longest prompt + response in tokens (SFT).
        shuffle: Shuffle the training data every epoch.
        chat_template: ``None``: chat-list prompts use the tokenizer's template, strings are used as is.
        prompt_key: The prompt column (verl's name): of RL prompt files, and of SFT pair rows.
        response_key: SFT: the response column of pair rows.
        messages_key: SFT: the column of multi-turn chats (loss on the assistant turns only); a row that has
            it is a chat, any other a pair.
        image_key: The image column of rows with images (a vision-language policy; ``None``: ``images``,
            else ``image``; ``data/vlm_prompts.py``).
    """

    train_files: str = ""
    val_files: str | None = None
    train_batch_size: int = 32
    val_batch_size: int | None = None
    max_prompt_length: int = 256
    truncation: str = "error"
    filter_overlong_prompts: bool = False
    max_length: int = 512
    shuffle: bool = True
    chat_template: bool | None = None
    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: str = "messages"
    image_key: str | None = None

    def __post_init__(self) -> None:
        if self.train_batch_size < 1:
            raise ValueError(f"data.train_batch_size={self.train_batch_size} must be >= 1")
        if self.val_batch_size is not None and self.val_batch_size < 1:
            raise ValueError(f"data.val_batch_size={self.val_batch_size} must be >= 1 or null (all at once)")
        for key in ("train_files", "val_files"):  # a reasoning_gym: path is checked now, before models load
            if is_reasoning_gym(getattr(self, key)):
                check_source(getattr(self, key), f"data.{key}")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(
                f"data.truncation={self.truncation!r}; choose one of {', '.join(TRUNCATION_MODES)}"
            )


def dp_size_now(sp_size: int = 1) -> int:
    """The data-parallel size of the current process group (``world_size // sp_size``; 1 without one)."""
    world = get_world_size()
    if world % sp_size:
        raise ValueError(f"world size {world} is not divisible by the sequence-parallel size {sp_size}")
    return world // sp_size


def per_rank(global_size: int, dp: int, what: str) -> int:
    """``global_size / dp``; an error when it does not divide."""
    if global_size % dp:
        raise ValueError(
            f"{what}={global_size} is not divisible by the data-parallel size {dp}; choose a multiple of {dp}"
        )
    return global_size // dp


def vision_processor(model_path: str | Path) -> VisionProcessor | None:
    """The :class:`VisionProcessor` (tokenizer + image processor) of a vision-language checkpoint.

    ``None`` for a text-only one (its ``config.json`` has no ``vision_config``).
    """
    path = resolve_model_path(model_path)
    if not is_vision_language(AutoConfig.from_pretrained(path)):
        return None
    return VisionProcessor.from_pretrained(path)


class _DataModule:
    def __init__(self, config: DataConfig, tokenizer: Any, sp_size: int = 1, train_dataset: Any = None,
                 val_dataset: Any = None, processor: VisionProcessor | None = None) -> None:
        if not config.train_files and train_dataset is None:
            raise ValueError("data.train_files is empty; point it at a .jsonl or .parquet file, or pass "
                             "train_dataset= (a datasets.Dataset or a list of rows)")
        self.config = config
        self.tokenizer = tokenizer
        self.sp_size = sp_size
        self.processor = processor
        """A vision-language policy's :class:`VisionProcessor` (:func:`vision_processor`): rows with images
        are encoded with their images; ``None``: such a row is an error naming it."""
        self.trainer: Any = None  # set by Trainer.fit / validate (Lightning's attribute)
        self._rows = {"data.train_files": train_dataset, "data.val_files": val_dataset}
        self._train: Any = None
        self._val: Any = None

    @property
    def has_val(self) -> bool:
        """Whether there is validation data (``config.val_files`` or ``val_dataset``)."""
        return bool(self.config.val_files) or self._rows["data.val_files"] is not None

    def _dataset(self, source: Any) -> Any:
        raise NotImplementedError

    def _load(self, path: str, what: str) -> Any:
        if self._rows[what] is not None:  # rows given in place of the file (a datasets.Dataset, a list)
            return self._dataset(self._rows[what])
        if Path(path).is_file() or is_reasoning_gym(path):
            return self._dataset(path)
        if parse_hub_dataset(path) is None:
            raise FileNotFoundError(f"{what}={path!r} does not exist (relative paths start at {os.getcwd()})")
        split = "test" if what == "data.val_files" else "train"  # TRL's defaults
        resolve_hub_split(path, what, split)  # not cached, no such config / split: errors name the setting
        return self._dataset(with_default_split(path, split))

    def fingerprint(self) -> dict[str, Any]:
        """The data files by path and content, recorded in checkpoints (``training/run_inputs.py``)."""
        files = {"train_files": self.config.train_files, "val_files": self.config.val_files}
        return {key: {"path": path, "content": data_fingerprint(path)} for key, path in files.items() if path}

    def check(self, dp_size: int) -> None:
        """Read, tokenise and check the data for ``dp_size`` data-parallel ranks, before any model loads.

        The datasets are kept for the dataloaders, so nothing is read twice.

        Raises:
            FileNotFoundError: A data file that does not exist.
            ValueError: A row or column problem (named by file and row), a prompt longer than the limit
                (``data.truncation="error"``), a batch size ``dp_size`` does not divide, or fewer training
                rows than one batch.
        """
        if self._train is None:
            self._train = self._load(self.config.train_files, "data.train_files")
        size = per_rank(self.config.train_batch_size, dp_size, "data.train_batch_size")
        if len(self._train) < size * dp_size:
            raise ValueError(
                f"data.train_files={self.config.train_files!r} has {len(self._train)} rows, fewer than one "
                f"batch (data.train_batch_size={self.config.train_batch_size})"
            )
        if self.has_val:
            if self._val is None:
                self._val = self._load(self.config.val_files, "data.val_files")
            if self.config.val_batch_size is not None:
                per_rank(self.config.val_batch_size, dp_size, "data.val_batch_size")

    def batches_per_epoch(self, dp_size: int) -> int:
        """Loader batches of one training epoch at ``dp_size`` ranks, after :meth:`check`.

        Full batches only, as the loader drops a last partial one (verl's ``len(train_dataloader)``): each
        rank holds ``ceil(rows / dp_size)`` rows (the epoch padded to a multiple of ``dp_size``) in batches
        of ``train_batch_size / dp_size``.
        """
        if self._train is None:
            raise RuntimeError("batches_per_epoch() needs the data read: call check(dp_size) first")
        size = per_rank(self.config.train_batch_size, dp_size, "data.train_batch_size")
        return math.ceil(len(self._train) / dp_size) // size

    def _dp_size(self) -> int:
        if self.trainer is not None:
            return int(self.trainer.dp_size)
        return dp_size_now(self.sp_size)

    def _loader(self, dataset: Any, batch_size: int, shuffle: bool, drop_last: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                          collate_fn=dataset.collate)

    def train_dataloader(self) -> DataLoader:
        """This rank's share of each step: ``train_batch_size / dp`` items per batch."""
        if self._train is None:
            self._train = self._load(self.config.train_files, "data.train_files")
        size = per_rank(self.config.train_batch_size, self._dp_size(), "data.train_batch_size")
        if len(self._train) < size:
            raise ValueError(f"{self.config.train_files} has {len(self._train)} rows, fewer than one batch")
        return self._loader(self._train, size, self.config.shuffle, drop_last=True)

    def val_dataloader(self) -> DataLoader | None:
        """Validation batches (``None`` without ``val_files``)."""
        if not self.has_val:
            return None
        if self._val is None:
            self._val = self._load(self.config.val_files, "data.val_files")
        dp = self._dp_size()
        if self.config.val_batch_size is None:
            size = max(1, math.ceil(len(self._val) / dp))
        else:
            size = per_rank(self.config.val_batch_size, dp, "data.val_batch_size")
        return self._loader(self._val, size, shuffle=False, drop_last=False)


class PromptDataModule(_DataModule):
    """RL prompts (:class:`~verl_trainer.data.prompts.PromptDataset`) batched for the rollout.

    Args:
        config: Files and global batch sizes.
        tokenizer: The policy's tokenizer.
        sp_size: Ulysses sequence-parallel size of the actor (ranks of one SP group share a batch).
        train_dataset: Rows in place of ``config.train_files`` (TRL's ``train_dataset``): a
            ``datasets.Dataset`` or a list of rows in the file's columns (a ``prompt``; a ground truth as
            ``reward_model.ground_truth``, ``ground_truth`` or TRL's ``solution``, optional; any other
            column, passed by name to TRL-style rewards).
        val_dataset: Rows in place of ``config.val_files``.
        tools: The tools' JSON schemas, rendered into every prompt by the chat template (multi-turn:
            ``verl_trainer.agents.prompt_tool_schemas(algorithm.rollout.multi_turn)``; the recipes pass
            them); ``None``: none.
    """

    def __init__(self, config: DataConfig, tokenizer: Any, sp_size: int = 1, train_dataset: Any = None,
                 val_dataset: Any = None, tools: list[dict[str, Any]] | None = None,
                 processor: VisionProcessor | None = None) -> None:
        super().__init__(config, tokenizer, sp_size, train_dataset, val_dataset, processor)
        self.tools = tools

    def _dataset(self, source: Any) -> PromptDataset:
        cfg = self.config
        return PromptDataset(source, self.tokenizer, cfg.max_prompt_length, truncation=cfg.truncation,
                             chat_template=cfg.chat_template,
                             filter_overlong_prompts=cfg.filter_overlong_prompts, prompt_key=cfg.prompt_key,
                             tools=self.tools, processor=self.processor, image_key=cfg.image_key)


    def data_sources(self) -> set[str]:
        """The ``data_source`` values of the files read by :meth:`check` (train and validation)."""
        return {s for ds in (self._train, self._val) if ds is not None for s in ds.data_sources()}


class SFTDataModule(_DataModule):
    """SFT pairs or chats (:class:`~verl_trainer.data.sft.SFTDataset`).

    ``loss_mask`` is on the response + eos of a pair, on the assistant turns of a chat.

    Args:
        config: Files and global batch sizes.
        tokenizer: The model's tokenizer.
        sp_size: Ulysses sequence-parallel size.
        train_dataset: Rows in place of ``config.train_files`` (a ``datasets.Dataset`` or a list of rows in
            one of TRL's SFT formats, see :mod:`verl_trainer.data.sft`).
        val_dataset: Rows in place of ``config.val_files``.
    """

    def _dataset(self, source: Any) -> SFTDataset:
        cfg = self.config
        return SFTDataset(source, self.tokenizer, cfg.max_length, chat_template=cfg.chat_template,
                          prompt_key=cfg.prompt_key, response_key=cfg.response_key,
                          messages_key=cfg.messages_key, processor=self.processor, image_key=cfg.image_key)
