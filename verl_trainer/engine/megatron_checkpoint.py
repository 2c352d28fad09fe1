"""Checkpoints of the Megatron engine: one file of plain tensors per rank, written atomically, read safely.

Megatron's ``dist_checkpointing`` does not run on CPU (it synchronises CUDA; a TP=2 save hung), so each
rank saves what it holds under Megatron's own parameter names (its TP shard of every parameter) and its
torch optimizer's state; the layout is the shared one of ``engine/checkpoint.py``::

    path/megatron/rank_{r}.pt       {"model": {megatron name: tensor}, "optimizer": optimizer.state_dict()}
    path/extra_state_rank{r}.pt     lr scheduler, RNG states, global_step
    path/meta.json                  global_step, world_size, backend, model_type, tensor_model_parallel_size,
                                    expert_model_parallel_size
    path/huggingface/               the model's HF config, tokenizer and generation config

Every file holds only tensors and plain data and is read with ``torch.load(weights_only=True)``
(``utils/safe_load.py``). A checkpoint loads only at the world, TP and EP size it was written with
(``RESHARDABLE_CHECKPOINTS = False``: the resume check refuses another world size early).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from verl_trainer.engine.checkpoint import (
    META_FILE,
    atomic_checkpoint_dir,
    load_extra_state,
    resolve_checkpoint_dir,
    save_extra_state,
    write_meta,
)
from verl_trainer.utils.distributed import get_rank, get_world_size
from verl_trainer.utils.safe_load import safe_torch_load

if TYPE_CHECKING:
    from verl_trainer.engine.config import EngineConfig

MEGATRON_SUBDIR = "megatron"
RANK_FILE = "rank_{rank}.pt"

__all__ = ["MEGATRON_SUBDIR", "MegatronCheckpointMixin"]


class MegatronCheckpointMixin:
    """``save_checkpoint`` / ``load_checkpoint`` for :class:`~verl_trainer.engine.megatron.MegatronEngine`.

    Attributes read: ``gpt_model`` (the unwrapped ``GPTModel``), ``optimizer``, ``lr_scheduler``, ``config``,
    ``backend``, ``MODEL_TYPE``, ``model_config``, ``topology``.
    """

    RESHARDABLE_CHECKPOINTS: ClassVar[bool] = False

    gpt_model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None
    config: EngineConfig
    backend: str
    MODEL_TYPE: str
    model_config: Any
    topology: Any

    def save_checkpoint(self, path: str, global_step: int = 0, **kwargs: Any) -> None:
        """Save this rank's parameters and optimizer state, the scheduler and RNG atomically; a collective."""
        assert self.gpt_model is not None
        state: dict[str, Any] = {"model": {name: p.detach().cpu().clone()
                                           for name, p in self.gpt_model.named_parameters()}}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        with atomic_checkpoint_dir(path) as tmp:
            (tmp / MEGATRON_SUBDIR).mkdir(exist_ok=True)
            torch.save(state, tmp / MEGATRON_SUBDIR / RANK_FILE.format(rank=get_rank()))
            save_extra_state(tmp, self.lr_scheduler, global_step)
            meta = {
                "global_step": int(global_step),
                "world_size": get_world_size(),
                "backend": self.backend,
                "model_type": self.MODEL_TYPE,
                "model_path": self.config.model_path,
                "tensor_model_parallel_size": self.topology.tp_size,
                "expert_model_parallel_size": self.config.expert_model_parallel_size,
            }
            write_meta(tmp, meta, self.model_config, self.config.model_path)

    def load_checkpoint(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote (same world and TP size); a collective.

        Returns:
            ``meta.json``'s content (``global_step``, ``world_size``, ...).

        Raises:
            FileNotFoundError: No checkpoint at ``path``, or no file of this rank in it.
            ValueError: It was written at another world or TP size, or holds other parameters.
        """
        assert self.gpt_model is not None
        directory = resolve_checkpoint_dir(path)
        meta = json.loads((directory / META_FILE).read_text()) if (directory / META_FILE).exists() else {}
        layout = {"world_size": get_world_size(), "tensor_model_parallel_size": self.topology.tp_size,
                  "expert_model_parallel_size": self.config.expert_model_parallel_size}  # a rank: its experts
        saved = {key: meta.get(key, value) for key, value in layout.items()}
        if saved != layout:
            raise ValueError(
                f"checkpoint {str(directory)!r} was written by the megatron engine at {saved}, this run has "
                f"{layout}; its per-rank files load only in the same layout: resume with that world size, "
                f"tensor_model_parallel_size and expert_model_parallel_size"
            )
        state = safe_torch_load(self._rank_file(directory))
        self._load_model(state["model"], directory)
        if self.optimizer is not None:
            if "optimizer" not in state:
                raise ValueError(f"checkpoint {str(directory)!r} holds no optimizer state (written by an "
                                 f"engine without optim_config); it cannot resume training")
            self.optimizer.load_state_dict(state["optimizer"])
        payload = load_extra_state(directory, self.lr_scheduler)
        meta.setdefault("global_step", payload.get("global_step", 0))
        return meta

    @staticmethod
    def _rank_file(directory: Path) -> Path:
        file = directory / MEGATRON_SUBDIR / RANK_FILE.format(rank=get_rank())
        if not file.is_file():
            raise FileNotFoundError(f"no megatron checkpoint file of rank {get_rank()} at {str(file)!r}")
        return file

    def _load_model(self, tensors: dict[str, torch.Tensor], directory: Path) -> None:
        params = dict(self.gpt_model.named_parameters())
        if set(tensors) != set(params) or any(tensors[n].shape != p.shape for n, p in params.items()):
            missing = sorted(set(params) - set(tensors))[:3]
            raise ValueError(f"checkpoint {str(directory)!r} does not hold this model's parameters (missing "
                             f"{missing}, or other shapes); load it into the model it was written from")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(tensors[name])
