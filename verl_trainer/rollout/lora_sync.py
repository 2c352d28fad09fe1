"""LoRA adapter-only weight sync (``algorithm.rollout.lora_sync``): its values and vLLM's adapter versions.

With LoRA on the actor the rollout can receive either the merged model (``merged``: every base tensor with ``W
+ lora_alpha/r · B·A`` folded in, streamed into the rollout's weights; any backend) or the adapters alone
(``adapter``: the ``lora_A`` / ``lora_B`` tensors under peft's file names, a few MB instead of the whole
model, served by vLLM as a LoRA request on top of the checkpoint's base weights, which never change). ``auto``
(the default) is ``adapter`` where it runs and pays (the vLLM rollout on an accelerator, LoRA on linear layers
only) and ``merged`` elsewhere (on CPU a LoRA request generates at about half the speed);
:func:`verl_trainer.algorithms.rollout_lora.resolve_lora_sync` decides when the algorithm's config is built,
before any model loads.

:class:`AdapterVersions` holds the vLLM side: each synced adapter becomes a version (a directory with
``adapter_config.json`` + ``adapter_model.safetensors`` and a ``LoRARequest`` with its own id, since vLLM
caches an adapter by id; a version is one export of the actor's adapters, numbered in order); the newest
``keep`` versions stay registered (``max_staleness + 1``: a queued group of the asynchronous rollout may
still need the oldest), older ones are removed from the engine and their files deleted.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["ADAPTER_BACKENDS", "LORA_SYNCS", "VLLM_LORA_RANKS", "AdapterVersions", "peft_config_dict",
           "vllm_lora_rank"]

LORA_SYNCS = ("auto", "merged", "adapter")
"""``algorithm.rollout.lora_sync`` values."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM's ``LoRAConfig`` accepts (vllm 0.32)."""
ADAPTER_BACKENDS = ("vllm",)
"""Rollout backends that serve an adapter as a LoRA request."""


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of rank ``rank``.

    Raises:
        ValueError: ``rank`` above vLLM's largest (512).
    """
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}; use "
                     "algorithm.rollout.lora_sync=merged")


def peft_config_dict(peft_model: Any) -> dict[str, Any]:
    """The active adapter's config as ``adapter_config.json`` holds it (inference mode, JSON types)."""
    config = peft_model.peft_config[peft_model.active_adapter]
    out = config.to_dict()
    out["inference_mode"] = True
    as_json = json.dumps(out, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v))
    return json.loads(as_json)


class AdapterVersions:
    """The adapter versions registered with one vLLM engine (see the module docstring).

    Args:
        keep: Versions kept registered (``>= 1``; the engine's ``max_loras``).
        remove: Unregisters a LoRA id from the engine (``llm.llm_engine.remove_lora``).
        root: Where the version directories go (``None``: a new temporary directory, deleted by
            :meth:`close`).
    """

    def __init__(self, keep: int, remove: Callable[[int], Any], root: str | Path | None = None) -> None:
        if keep < 1:
            raise ValueError(f"AdapterVersions keep={keep} must be >= 1")
        self.keep = keep
        self.remove = remove
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="vllm_lora_"))
        self.requests: OrderedDict[int, Any] = OrderedDict()
        """``{version: LoRARequest}``, oldest first."""
        self.active: int | None = None
        """The version generation uses (``None``: the base model)."""

    def add(self, version: int, tensors: Mapping[str, torch.Tensor], peft_config: Mapping[str, Any],
            request_class: Callable[..., Any]) -> None:
        """Write version ``version`` and make it the active one; drop the oldest beyond :attr:`keep`.

        A version already registered is only made active.

        Args:
            version: The adapter's serial number (``>= 0``, one per export, increasing; ``lora_int_id`` is
                ``version + 1``).
            tensors: The adapter under peft's file names (``...q_proj.lora_A.weight``).
            peft_config: Its ``adapter_config.json`` content.
            request_class: ``vllm.lora.request.LoRARequest``.
        """
        if version not in self.requests:
            from safetensors.torch import save_file  # lazy: only where adapters are synced

            directory = self.root / f"v{version}"
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "adapter_config.json").write_text(json.dumps(dict(peft_config)))
            save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()},
                      str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
            self.requests[version] = request_class(f"policy_v{version}", version + 1, str(directory))
        self.active = version
        while len(self.requests) > self.keep:
            old, _ = self.requests.popitem(last=False)
            self.remove(old + 1)
            shutil.rmtree(self.root / f"v{old}", ignore_errors=True)

    def request(self) -> Any:
        """The active version's ``LoRARequest`` (``None`` before the first :meth:`add`)."""
        return None if self.active is None else self.requests[self.active]

    def close(self) -> None:
        """Delete the version directories."""
        shutil.rmtree(self.root, ignore_errors=True)
