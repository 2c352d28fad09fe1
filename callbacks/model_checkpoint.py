"""ModelCheckpoint: atomic checkpoints every N steps, keeping the last k, resumable with ``"last"``.

Each save writes ``<dirpath>/step_000003/`` through :meth:`Trainer.save_checkpoint` (engines, trainer
state, data position, module and callback states, every rank's RNG; see
``verl_trainer.training.checkpoint``). The directory appears only once complete, so
``fit(ckpt_path="last")`` never picks a save that was interrupted. ``dirpath`` defaults to
``<default_root_dir>/checkpoints``.

With ``save_hf=True`` each save also writes the trained model as a standard HF directory into the
checkpoint: ``step_000003/hf/`` (the actor: ``engine.save_hf``, with the tokenizer of its ``model_path``)
and ``step_000003/hf_<name>/`` for every other trainable engine (PPO's critic: ``hf_critic/``, a
token-classification model with its value head). Lightning's ``ModelCheckpoint`` has no such option;
verl's checkpoint manager writes ``huggingface/`` with the config and tokenizer only.

A directory belongs to one run: a fresh run gets a run id (recorded in each checkpoint's ``meta.json``),
refuses to start where another run's checkpoints are, and prunes only its own checkpoints.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from verl_trainer.callbacks.base import Callback
from verl_trainer.export.shards import parse_size
from verl_trainer.training.checkpoint import checkpoint_dir_name, claim_checkpoint_dir, prune_checkpoints
from verl_trainer.utils.distributed import barrier, broadcast_object


def export_trainable_engines(engines: dict[str, Any], directory: Path, max_shard_size: int) -> list[Path]:
    """``engine.save_hf`` of every engine with an optimizer into ``directory``; a collective.

    The first engine (the actor) goes to ``directory/hf``, the others to ``directory/hf_<name>``.

    Returns:
        The directories written.
    """
    written = []
    for index, (name, engine) in enumerate(engines.items()):
        if getattr(engine, "optimizer", None) is None:
            continue  # a reference policy or other frozen engine: nothing trained to export
        out = directory / ("hf" if index == 0 else f"hf_{name}")
        engine.save_hf(out, max_shard_size=max_shard_size)
        written.append(out)
    return written


class ModelCheckpoint(Callback):
    """Save the run every ``every_n_train_steps`` steps and at the end of fit.

    Args:
        dirpath: Where the ``step_*`` directories go (default ``<default_root_dir>/checkpoints``).
        every_n_train_steps: Save after every N-th trainer step (``None``: only at the end). When
            validation runs after that step, the save follows it (``on_validation_end``).
        keep_last_k: Keep the newest k checkpoints (``None``: keep all); older ones are deleted after a
            new one is complete.
        save_on_train_end: Also save when training ends (unless that step was just saved).
        save_hf: Also export the trainable engines as HF directories into each checkpoint (``hf/`` for the
            actor, ``hf_<name>/`` for the others; see the module).
        hf_max_shard_size: Bytes per safetensors file of those exports (int or e.g. ``"5GB"``).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        every_n_train_steps: int | None = None,
        keep_last_k: int | None = 1,
        save_on_train_end: bool = True,
        save_hf: bool = False,
        hf_max_shard_size: int | str = "5GB",
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be None or >= 1, got {every_n_train_steps}")
        if keep_last_k is not None and keep_last_k < 1:
            raise ValueError(f"keep_last_k must be None or >= 1, got {keep_last_k}")
        self.dirpath: Path | None = Path(dirpath).absolute() if dirpath is not None else None
        self.every_n_train_steps = every_n_train_steps
        self.keep_last_k = keep_last_k
        self.save_on_train_end = save_on_train_end
        self.save_hf = save_hf
        self.hf_max_shard_size = parse_size(hf_max_shard_size)
        self.last_saved_step: int | None = None
        self.last_path: Path | None = None
        self.run_id: str | None = None
        self._resumed = False

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        """Resolve the default directory."""
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / "checkpoints"

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        """Tie the run to its checkpoints (a collective; after a resume has restored :attr:`run_id`).

        Rank 0 removes the half-written / half-deleted folders an interrupted save or pruning left
        (saying so) and refuses a directory holding another run's checkpoints
        (:func:`~verl_trainer.training.checkpoint.claim_checkpoint_dir`); a fresh run gets a new run id,
        recorded in every checkpoint it writes. Every rank raises the same error together.
        """
        assert self.dirpath is not None
        decision: list[Any] = [None, None, []]
        if trainer.is_global_zero:
            try:
                run_id, cleaned = claim_checkpoint_dir(self.dirpath, self.run_id, self._resumed)
                decision = [run_id, None, [str(p) for p in cleaned]]
            except FileExistsError as exc:
                decision = [None, str(exc), []]
        run_id, error, cleaned = broadcast_object(decision)
        if error is not None:
            raise FileExistsError(error)
        if cleaned and trainer.is_global_zero:
            print(f"removed {len(cleaned)} folder(s) left by an interrupted checkpoint save or deletion: "
                  f"{', '.join(cleaned)}", flush=True)
        self.run_id = run_id

    def _due(self, trainer: Any) -> bool:
        n = self.every_n_train_steps
        return n is not None and trainer.global_step % n == 0 and trainer.global_step != self.last_saved_step

    def save(self, trainer: Any) -> Path:
        """Save now (a collective: every rank calls it); returns the checkpoint directory."""
        assert self.dirpath is not None
        path = self.dirpath / checkpoint_dir_name(trainer.global_step)
        self.last_saved_step, self.last_path = trainer.global_step, path
        trainer.save_checkpoint(path)
        if self.save_hf:
            export_trainable_engines(trainer.module.engines, path, self.hf_max_shard_size)
        if trainer.is_global_zero and self.keep_last_k is not None:
            prune_checkpoints(self.dirpath, self.keep_last_k, trainer.global_step, self.run_id)
        barrier()
        return path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Save when due and no validation follows this step."""
        if self._due(trainer) and not trainer.validation_due():
            self.save(trainer)

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        """Save when due, after the step's validation."""
        if trainer.state == "fit" and not trainer.sanity_checking and self._due(trainer):
            self.save(trainer)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        """Save the final state (unless this step is saved already)."""
        if self.save_on_train_end and trainer.global_step > 0 and trainer.global_step != self.last_saved_step:
            self.save(trainer)

    def state_dict(self) -> dict[str, Any]:
        """The last saved step and the run id (plain data)."""
        return {"last_saved_step": self.last_saved_step, "run_id": self.run_id}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.last_saved_step = state_dict.get("last_saved_step")
        self.run_id = state_dict.get("run_id")
        self._resumed = True
