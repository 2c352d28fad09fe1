"""Writing a standard HF model directory from a stream of full tensors: :func:`save_hf_model`.

The directory holds what ``save_pretrained`` of the model and tokenizer would write — ``config.json``,
``model.safetensors`` (or shards + ``model.safetensors.index.json``), ``generation_config.json`` (language
models) and the tokenizer files — so ``AutoModelForCausalLM.from_pretrained(dir)`` (a value model:
``AutoModelForTokenClassification``) and ``AutoTokenizer.from_pretrained(dir)`` load it with plain
transformers. The engines' ``save_hf`` and ``python -m verl_trainer.export`` both write through here.

Tensors arrive one at a time (``engine.get_per_tensor_param()``, or read from a checkpoint); only the
current safetensors shard is held (``models/safetensors_shards.py``: ``SafetensorsShardWriter``). Tied
weights (``lm_head.weight`` = ``model.embed_tokens.weight`` when ``tie_word_embeddings``) are written once,
as ``save_pretrained`` does; the names are checked against the architecture (an instance on the ``meta``
device, built from the config), so a missing or unexpected tensor is an error, not a silently broken model.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from verl_trainer.models.hf_files import MODEL_TYPES, PROCESSOR_FILES
from verl_trainer.models.safetensors_shards import SafetensorsShardWriter, parse_size
from verl_trainer.utils.distributed import all_gather_object, get_rank
from verl_trainer.utils.fs import ensure_replaceable, replace_dir_atomically

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

__all__ = ["HF_MODEL_KINDS", "HFLayout", "auto_model_class", "save_hf_model"]

HF_MODEL_KINDS = ("hf_export", "warm_start")
"""Marker kinds of the HF model directories the project writes; an export replaces only one of these."""
_NOT_SAVED = ("_attn_implementation_internal", "_attn_implementation", "attn_implementation")


def auto_model_class(model_type: str, config: PretrainedConfig | None = None) -> Any:
    """``AutoModelForCausalLM`` (language_model) or ``AutoModelForTokenClassification`` (value_model).

    ``AutoModelForImageTextToText`` for a language model whose ``config`` has a ``vision_config``.
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
    )

    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not one of {MODEL_TYPES}")
    if model_type == "language_model" and getattr(config, "vision_config", None) is not None:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM if model_type == "language_model" else AutoModelForTokenClassification


class HFLayout:
    """The tensor names and class of the HF model ``config`` describes, from an instance on ``meta``.

    Args:
        config: The model's HF config (a value model's has ``num_labels=1``).
        model_type: ``"language_model"`` or ``"value_model"``.

    Attributes:
        class_name: E.g. ``"Qwen2ForCausalLM"`` (written as ``config.architectures``).
        names: The state-dict names to write (tied aliases excluded), in state-dict order.
        aliases: ``{alias: name}`` of tied parameters (``lm_head.weight -> model.embed_tokens.weight``).
    """

    def __init__(self, config: PretrainedConfig, model_type: str) -> None:
        cls = auto_model_class(model_type, config)
        with torch.device("meta"):
            model = cls.from_config(copy.deepcopy(config))
        self.class_name = type(model).__name__
        first: dict[int, str] = {}
        self.aliases: dict[str, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in first:
                self.aliases[name] = first[id(param)]
            else:
                first[id(param)] = name
        self.names = [name for name in model.state_dict() if name not in self.aliases]

    def canonical(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``named`` with each tied parameter once (under its first name); the stream is consumed fully.

        Raises:
            ValueError: After the stream ended, if a tensor the architecture has was missing or one it does
                not have was present (naming them).
        """
        seen: set[str] = set()
        unexpected: list[str] = []
        expected = set(self.names)
        for name, tensor in named:
            name = self.aliases.get(name, name)
            if name in seen:
                continue
            if name not in expected:
                unexpected.append(name)
                continue
            seen.add(name)
            yield name, tensor
        missing = [name for name in self.names if name not in seen]
        if missing or unexpected:
            raise ValueError(
                f"the weights do not match {self.class_name}: missing {missing[:8]}, unexpected "
                f"{unexpected[:8]}; export the model type the engine trains (language_model / value_model)"
            )

    def hf_config(self, config: PretrainedConfig, dtype: torch.dtype) -> PretrainedConfig:
        """A copy of ``config`` as ``save_pretrained`` would write it for this class in ``dtype``."""
        out = copy.deepcopy(config)
        out.architectures = [self.class_name]
        out.dtype = dtype
        for attr in _NOT_SAVED:  # the engines' padding-free / Ulysses attention is not plain transformers'
            if attr in getattr(out, "__dict__", {}):
                setattr(out, attr, None)
        return out


def _write(tmp: Path, layout: HFLayout, named: Iterator[tuple[str, torch.Tensor]], config: PretrainedConfig,
           max_shard_size: int, dtype: torch.dtype | None,
           tokenizer: PreTrainedTokenizerBase | str | os.PathLike | None,
           generation_config: GenerationConfig | None, model_type: str,
           processor_dir: str | os.PathLike | None = None) -> None:
    writer = SafetensorsShardWriter(tmp, max_shard_size, dtype)
    saved_dtype = dtype
    for name, tensor in named:
        if saved_dtype is None and tensor.is_floating_point():
            saved_dtype = tensor.dtype
        writer.add(name, tensor)
    writer.finish()
    layout.hf_config(config, saved_dtype or torch.float32).save_pretrained(tmp)
    if model_type == "language_model":
        from transformers import GenerationConfig

        generation = generation_config or GenerationConfig.from_model_config(config)
        generation.save_pretrained(tmp)
    if tokenizer is not None:
        if isinstance(tokenizer, (str, os.PathLike)):
            from verl_trainer.models.loading import load_tokenizer  # lazy: loads transformers only when used

            tokenizer = load_tokenizer(tokenizer)
        tokenizer.save_pretrained(tmp)
    for name in PROCESSOR_FILES if processor_dir is not None else ():  # a VLM's image processor
        if (Path(processor_dir) / name).is_file():
            shutil.copyfile(Path(processor_dir) / name, tmp / name)


def save_hf_model(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    path: str | os.PathLike,
    config: PretrainedConfig,
    model_type: str = "language_model",
    tokenizer: PreTrainedTokenizerBase | str | os.PathLike | None = None,
    generation_config: GenerationConfig | None = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    what: str = "path",
    processor_dir: str | os.PathLike | None = None,
) -> str:
    """Write ``named_tensors`` as an HF model directory at ``path``; a collective when distributed.

    Every rank consumes ``named_tensors`` (the engines' stream gathers each tensor over all ranks); rank 0
    writes, under a temporary name renamed to ``path`` when complete. An existing ``path`` is replaced only
    if verl-trainer wrote it (:func:`~verl_trainer.utils.fs.replace_dir_atomically`). An error on rank 0
    (e.g. a full disk) is raised on every rank.

    Args:
        named_tensors: ``(hf_name, full_tensor)`` under the model's state-dict names, one at a time.
        path: The output directory.
        config: The model's HF config (``PretrainedConfig``).
        model_type: ``"language_model"`` (``*ForCausalLM``) or ``"value_model"`` (``*ForTokenClassification``,
            ``num_labels=1``: the value head is written as ``score``).
        tokenizer: A tokenizer (``save_pretrained``) or a directory to load it from; ``None``: none written.
        generation_config: Written as ``generation_config.json`` (language models; default: from ``config``).
        max_shard_size: Bytes per safetensors file (int, or e.g. ``"5GB"``); larger models are sharded.
        dtype: Save floating-point tensors in this dtype (default: as they arrive).
        what: How the caller names ``path`` in errors (e.g. ``"export_dir"``).
        processor_dir: A directory whose processor files (``hf_files.PROCESSOR_FILES``: a VLM's image
            processor) are copied along; ``None``: none.

    Returns:
        ``str(path)``.

    Raises:
        NotOwnedError: Before any tensor is gathered, if ``path`` holds files verl-trainer did not write or
            is another kind of its directories (a checkpoint, the task data, ...).
        ValueError: If the tensors do not match the architecture of ``config`` (on every rank).
    """
    ensure_replaceable(path, what, HF_MODEL_KINDS)
    shard_bytes = parse_size(max_shard_size)
    layout = HFLayout(config, model_type)
    named = layout.canonical(named_tensors)
    error: str | None = None
    if get_rank() == 0:
        try:
            replace_dir_atomically(
                path,
                lambda tmp: _write(tmp, layout, named, config, shard_bytes, dtype, tokenizer,
                                   generation_config, model_type, processor_dir),
                "hf_export", what, replaces=HF_MODEL_KINDS,
            )
        except ValueError:
            raise  # a mismatch of names: every rank raises it from the same stream
        except BaseException as exc:  # noqa: BLE001 - told to every rank, then re-raised here
            error = f"{type(exc).__name__}: {exc}"
            for _ in named:  # keep up with the other ranks' collectives
                pass
            _gather_errors(error)
            raise
    else:
        for _ in named:
            pass
    _gather_errors(error)
    return str(path)


def _gather_errors(error: str | None) -> None:
    """All-gather rank 0's write error (if any) and raise it on the other ranks."""
    errors = [e for e in all_gather_object(error) if e]
    if errors and error is None:
        raise RuntimeError(f"rank 0 failed to write the HF export: {errors[0]}")
