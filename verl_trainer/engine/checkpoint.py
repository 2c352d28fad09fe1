"""Checkpoint part: atomic checkpoint directories, RNG / scheduler state, and DCP for torch-native engines.

Layout of a checkpoint directory ``path``::

    path/dcp/...                     model + optimizer, torch.distributed.checkpoint (sharded, any backend
                                     may use its own sub-directory instead, e.g. DeepSpeed's format)
    path/extra_state_rank{r}.pt      lr scheduler, RNG states, global_step, float16 loss scaler (plain
                                     data and tensors; loadable with torch.load(weights_only=True))
    path/meta.json                   global_step, world_size, backend, model_type,
                                     tensor_model_parallel_size, pipeline_model_parallel_size
                                     (informative: DCP reshards on load), flat_optimizer_state
    path/huggingface/                the model's HF config, tokenizer and generation config (for export)

    path/manifest.json               every file's size and sha256, verified before anything is loaded
    path/.verl_trainer_output        the project's ownership marker (``verl_trainer.utils.fs``)

Writes go to ``.{name}.tmp`` next to ``path`` and are renamed into place only after every rank has
finished, so an interrupted save never replaces the previous checkpoint (see
:func:`atomic_checkpoint_dir`). Assumes a file system shared by all ranks. Loads are pickle-free: DCP
through ``engine/safe_dcp.py``, everything else through
:func:`~verl_trainer.utils.safe_load.safe_torch_load`.
"""

from __future__ import annotations

import contextlib
import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from verl_trainer.utils.disk_full import disk_full_error
from verl_trainer.utils.distributed import barrier, get_rank, get_world_size
from verl_trainer.utils.fs import (
    discard_temporary,
    ensure_replaceable,
    mark_owned,
    read_marker,
    record_files,
    remove_owned,
)
from verl_trainer.utils.manifest import MANIFEST_FILE, verify_manifest, write_manifest
from verl_trainer.utils.safe_load import safe_torch_load

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from transformers import PretrainedConfig

    from verl_trainer.engine.config import EngineConfig

EXTRA_STATE = "extra_state_rank{rank}.pt"
META_FILE = "meta.json"
HF_DIR = "huggingface"
DCP_SUBDIR = "dcp"
DEEPSPEED_SUBDIR = "deepspeed"
"""The state of an engine checkpoint: DCP files (FSDP / FSDP2) or DeepSpeed's own (ZeRO)."""
CHECKPOINT_KIND = "checkpoint"
"""The marker kind of checkpoint directories: only :func:`atomic_checkpoint_dir` replaces one."""


def _sibling(path: Path, suffix: str) -> Path:
    return path.parent / f".{path.name}.{suffix}"


@contextlib.contextmanager
def atomic_checkpoint_dir(path: str | Path, **marker: Any) -> Iterator[Path]:
    """Yield a temporary directory every rank writes into; commit it to ``path`` when all are done.

    A collective: every rank must enter it. Every rank first checks that ``path`` is missing, empty or a
    directory verl-trainer wrote (:func:`~verl_trainer.utils.fs.ensure_replaceable`). Rank 0 clears a
    stale temporary directory and marks the new one as the project's
    (:data:`~verl_trainer.utils.fs.OWNER_MARKER`, with ``marker`` and a token of this save recorded in
    it). The temporary name carries the run id (``.step_000003.tmp-<run id>``), and rank 0 commits only a
    temporary directory whose marker still records this save's token (else ``RuntimeError``). After the
    block every rank hashes a share of the files and rank 0 writes ``manifest.json``
    (:func:`~verl_trainer.utils.manifest.write_manifest`); then rank 0 moves an existing ``path`` aside,
    renames the temporary directory to ``path`` and deletes the old one. If the block raises (e.g. the
    disk is full: raised as :class:`~verl_trainer.utils.disk_full.DiskFullError`, "no space left on
    <path>"), nothing is renamed and rank 0 deletes the temporary directory.

    Args:
        path: The final checkpoint directory.
        **marker: Plain data recorded in the ownership marker (e.g. ``run_id``).

    """
    final = Path(path)
    run_id = marker.get("run_id")
    tmp = _sibling(final, f"tmp-{run_id}" if run_id else "tmp")  # a run's own scratch name
    old = _sibling(final, "old")
    ensure_replaceable(final, "checkpoint path", CHECKPOINT_KIND)
    token = uuid.uuid4().hex
    if get_rank() == 0:
        discard_temporary(tmp)  # left by an interrupted save of this path
        mark_owned(tmp, CHECKPOINT_KIND, save=token, **marker)
    barrier()
    try:
        yield tmp
    except BaseException as exc:
        full = disk_full_error(exc, final, "the checkpoint")  # before its files are removed
        if get_rank() == 0 and _is_this_save(tmp, token):
            discard_temporary(tmp)  # frees the space a failed save took
        if full is not None and full is not exc:
            raise full from exc
        raise
    barrier()
    if get_rank() == 0 and _is_this_save(tmp, token):
        record_files(tmp, also=(MANIFEST_FILE,))  # a file added later keeps the directory from being replaced
    barrier()
    write_manifest(tmp)  # covers the marker with its record
    if get_rank() == 0:
        if not _is_this_save(tmp, token):
            raise RuntimeError(
                f"the temporary checkpoint directory {str(tmp)!r} is no longer this save's (its marker "
                f"{read_marker(tmp)!r} does not record save {token}): another process wrote to it, e.g. a "
                f"second run in the same directory. Not committing it to {str(final)!r}; give each run its "
                f"own directory"
            )
        if final.exists():
            if old.exists():
                remove_owned(old, "checkpoint path", CHECKPOINT_KIND)
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            remove_owned(old, "checkpoint path", CHECKPOINT_KIND)
    barrier()


def _is_this_save(tmp: Path, token: str) -> bool:
    """Whether ``tmp`` still carries the marker this save wrote into it (rank 0)."""
    marker = read_marker(tmp)
    return marker is not None and marker.get("save") == token


def resolve_checkpoint_dir(path: str | Path, verify: bool = True) -> Path:
    """``path``, or the previous checkpoint moved aside by a save interrupted while committing.

    Args:
        path: The checkpoint directory.
        verify: Check its files against its manifest first (a collective when distributed).

    Raises:
        FileNotFoundError: If neither exists.
        CorruptCheckpointError: If a file is missing, truncated or corrupted (naming it).

    """
    final = Path(path)
    if final.is_dir():
        found = final
    elif _sibling(final, "old").is_dir():
        found = _sibling(final, "old")
    else:
        raise FileNotFoundError(f"no checkpoint at {str(final)!r}")
    if verify:
        verify_manifest(found)
    return found


def get_rng_state() -> dict[str, Any]:
    """RNG states of torch (CPU and accelerator), numpy and Python, as tensors and plain data."""
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss": py_gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    np.random.set_state(
        ("MT19937", npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
         npst["cached_gaussian"])
    )
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_extra_state(
    directory: Path,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    global_step: int,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write this rank's scheduler + RNG state to ``directory / extra_state_rank{r}.pt``."""
    payload = {
        "global_step": int(global_step),
        "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
        "rng": get_rng_state(),
        "extra": extra or {},
    }
    torch.save(payload, directory / EXTRA_STATE.format(rank=get_rank()))


def load_extra_state(
    directory: Path, lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None
) -> dict[str, Any]:
    """Restore this rank's scheduler and RNG state (``torch.load(weights_only=True)``).

    A checkpoint saved with fewer ranks has no file for this rank: the scheduler comes from rank 0's
    file and the RNG is left as is.

    Returns:
        The loaded payload (``global_step``, ``extra``, ...).

    """
    own = directory / EXTRA_STATE.format(rank=get_rank())
    path = own if own.exists() else directory / EXTRA_STATE.format(rank=0)
    payload = safe_torch_load(path)
    if lr_scheduler is not None and payload.get("lr_scheduler") is not None:
        lr_scheduler.load_state_dict(payload["lr_scheduler"])
        # the scheduler's state does not include the optimizer's current lr: put it back as well
        for group, lr in zip(lr_scheduler.optimizer.param_groups, lr_scheduler.get_last_lr()):
            group["lr"] = lr
    if path == own:
        set_rng_state(payload["rng"])
    return payload


def write_meta(directory: Path, meta: dict[str, Any], hf_config: PretrainedConfig | None = None,
               source: str | None = None) -> None:
    """Rank 0 writes ``meta.json`` and ``huggingface/``: the HF config, tokenizer and generation config.

    ``huggingface/`` is what ``python -m verl_trainer.export`` needs to write a complete HF directory.
    """
    if get_rank() != 0:
        return
    (directory / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    if hf_config is not None and hasattr(hf_config, "save_pretrained"):
        from verl_trainer.models.hf_sources import save_model_files  # lazy: loads transformers only when used

        hf_config.save_pretrained(directory / HF_DIR)
        save_model_files(source, directory / HF_DIR)


class DCPCheckpointMixin:
    """``save_checkpoint`` / ``load_checkpoint`` with torch.distributed.checkpoint (FSDP1 and FSDP2).

    Attributes read: ``module``, ``optimizer``, ``lr_scheduler``, ``backend``, ``MODEL_TYPE``,
    ``has_adapters`` (LoRA: frozen base weights are not saved; they come from the model path again).
    """

    RESHARDABLE_CHECKPOINTS: ClassVar[bool] = True
    """DCP saves the state with its global layout: a checkpoint loads at any world size and layout."""

    has_adapters: bool
    config: EngineConfig
    module: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None
    backend: str
    MODEL_TYPE: str

    @property
    def _pipeline_size(self) -> int:
        return getattr(getattr(self, "topology", None), "pp_size", 1)

    def _state_dict_options(self, flat_optimizer: bool = False) -> StateDictOptions:
        """DCP state-dict options; ``flat_optimizer``: optimizer state keyed per parameter name.

        Pipeline stages hold different parameters, so their optimizers' ``param_groups`` differ: saved
        nested, one stage's list would stand for all. Flattened (``param_groups.<name>.lr``,
        ``state.<name>.exp_avg``) every entry belongs to one parameter, so stages save side by side and a
        checkpoint reshards into any pipeline layout. A checkpoint records which form it holds
        (``meta.json: flat_optimizer_state``); loading reads that form (a grouped one also loads into
        pipeline stages: its state is keyed by parameter name, and the engines build one group).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.has_adapters, strict=not self.has_adapters,
                                flatten_optimizer_state_dict=flat_optimizer)

    def _state_dicts(self, flat_optimizer: bool = False) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        options = self._state_dict_options(flat_optimizer)
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.module, options=options)}
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=options)
        return {"model": model_sd, "optimizer": optim_sd}

    def save_checkpoint(self, path: str, global_step: int = 0, **kwargs: Any) -> None:
        """Save model, optimizer (DCP), scheduler and RNG atomically to the directory ``path``."""
        import torch.distributed.checkpoint as dcp

        flat = self._pipeline_size > 1
        state = self._state_dicts(flat)
        with atomic_checkpoint_dir(path) as tmp:
            dcp.save(state, checkpoint_id=str(tmp / DCP_SUBDIR))
            scaler = getattr(self, "grad_scaler", None)  # float16: the loss scale and its growth tracker
            extra = {} if scaler is None else {"grad_scaler": scaler.state_dict()}
            save_extra_state(tmp, self.lr_scheduler, global_step, extra)
            meta = {
                "global_step": int(global_step),
                "world_size": get_world_size(),
                "backend": self.backend,
                "model_type": self.MODEL_TYPE,
                "model_path": self.config.model_path,
                "tensor_model_parallel_size": getattr(getattr(self, "topology", None), "tp_size", 1),
                "pipeline_model_parallel_size": self._pipeline_size,
                "flat_optimizer_state": flat,
            }
            hf_config = getattr(self, "model_config", None) or getattr(self.module, "config", None)
            write_meta(tmp, meta, hf_config, self.config.model_path)  # HF config, also for torchtitan

    def load_checkpoint(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and RNG from ``path``; returns ``meta.json``'s content."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        from verl_trainer.engine.safe_dcp import safe_dcp_load  # lazy: loads torch DCP only when used

        directory = resolve_checkpoint_dir(path)
        meta = json.loads((directory / META_FILE).read_text()) if (directory / META_FILE).exists() else {}
        flat = bool(meta.get("flat_optimizer_state", False))
        state = self._state_dicts(flat)
        safe_dcp_load(state, directory / DCP_SUBDIR)
        if self.optimizer is None:
            set_model_state_dict(self.module, state["model"], options=self._state_dict_options(flat))
        else:
            set_state_dict(
                self.module, self.optimizer,
                model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                options=self._state_dict_options(flat),
            )
        payload = load_extra_state(directory, self.lr_scheduler)
        scaler = getattr(self, "grad_scaler", None)
        if scaler is not None and payload.get("extra", {}).get("grad_scaler"):
            scaler.load_state_dict(payload["extra"]["grad_scaler"])
        meta.setdefault("global_step", payload.get("global_step", 0))
        return meta
