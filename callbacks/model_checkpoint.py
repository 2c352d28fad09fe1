"""ModelCheckpoint: atomic checkpoints every N steps, keeping the last k, resumable with ``"last"``.

Each save writes ``<dirpath>/step_000003/`` through :meth:`Trainer.save_checkpoint` (engines, trainer
state, data position, module and callback states, every rank's RNG; see
``verl_trainer.engine.checkpoint_dirs``). The directory appears only once complete, so
``fit(ckpt_path="last")`` never picks a save that was interrupted. ``dirpath`` defaults to
``<default_root_dir>/checkpoints``.

With ``save_hf=True`` each save also writes the trained model as a standard HF directory into the
checkpoint: ``step_000003/hf/`` (the actor: ``engine.save_hf``, with the tokenizer of its ``model_path``)
and ``step_000003/hf_<name>/`` for every other trainable engine (PPO's critic: ``hf_critic/``, a
token-classification model with its value head). Lightning's ``ModelCheckpoint`` has no such option;
verl's checkpoint manager writes ``huggingface/`` with the config and tokenizer only.

A directory belongs to one run: a fresh run gets a run id (recorded in each checkpoint's ``meta.json``),
refuses to start where another run's checkpoints are, and prunes only its own checkpoints. For the whole
fit, rank 0 holds an exclusive lock on the directory (``verl_trainer.utils.dir_lock``), so a second run
started in it at the same time is refused with a message naming the first; a lock left by a killed run is
taken over and reported.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_trainer.callbacks.base import Callback
from verl_trainer.callbacks.contract import CallbackModule, CallbackTrainer
from verl_trainer.engine.checkpoint_dirs import checkpoint_dir_name, claim_checkpoint_dir, prune_checkpoints
from verl_trainer.models.safetensors_shards import parse_size
from verl_trainer.utils.dir_lock import DirectoryLock, DirectoryLockedError
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


MODES = ("min", "max")


class ModelCheckpoint(Callback):
    """Save the run every ``every_n_train_steps`` steps / ``every_n_epochs`` epochs and at the end of fit.

    With ``monitor``, each save records the monitored metric's value and the ``save_top_k`` best
    checkpoints are kept besides the newest ``keep_last_k`` (which ``fit(ckpt_path="last")`` resumes from);
    :attr:`best_model_path` / :attr:`best_model_score` name the best, as in Lightning.

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
        monitor: Lightning's: a logged metric (e.g. ``"val/loss"``) whose value at each save ranks the
            checkpoints; a save where it was never logged is an error naming the metrics there are.
        mode: ``"min"`` or ``"max"``: which value of ``monitor`` is best.
        save_top_k: Lightning's: with ``monitor``, keep the k best (``-1``: all; default 1); without, it is
            ``keep_last_k`` (Lightning keeps the newest k then).
        save_last: Lightning's; ``None`` / ``True``: the newest checkpoint is always kept (it is what
            ``ckpt_path="last"`` resumes). ``False`` with ``monitor`` is refused.
        filename: Lightning's; only ``None``: checkpoints are directories named ``step_<N>`` (what
            ``ckpt_path="last"`` and ``python -m verl_trainer.export`` find).
        every_n_epochs: Lightning's: also save at the end of every N-th training epoch.

    Raises:
        ValueError: For an invalid value or combination, naming it and the fix.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        every_n_train_steps: int | None = None,
        keep_last_k: int | None = 1,
        save_on_train_end: bool = True,
        save_hf: bool = False,
        hf_max_shard_size: int | str = "5GB",
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int | None = None,
        save_last: bool | None = None,
        filename: str | None = None,
        every_n_epochs: int | None = None,
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be None or >= 1, got {every_n_train_steps}")
        if every_n_epochs is not None and (isinstance(every_n_epochs, bool) or every_n_epochs < 1):
            raise ValueError(f"every_n_epochs must be None or >= 1, got {every_n_epochs}")
        if mode not in MODES:
            raise ValueError(f"ModelCheckpoint(mode={mode!r}); choose one of {MODES}")
        if filename is not None:
            raise ValueError(f"ModelCheckpoint(filename={filename!r}): checkpoints are directories named "
                             "step_<N> (what ckpt_path='last' and python -m verl_trainer.export find); drop "
                             "filename= (the best one is ModelCheckpoint.best_model_path)")
        if save_top_k is not None and (isinstance(save_top_k, bool) or save_top_k < -1 or save_top_k == 0):
            raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k!r}); use -1 (all) or k >= 1 (0 saves "
                             "nothing: use Trainer(enable_checkpointing=False))")
        if monitor is None and save_top_k is not None:  # Lightning without a monitor: the newest k
            keep_last_k = None if save_top_k == -1 else save_top_k
        if monitor is not None and save_last is False:
            raise ValueError("ModelCheckpoint(monitor=..., save_last=False): the newest checkpoint is always "
                             "kept besides the best (fit(ckpt_path='last') resumes from it); drop save_last")
        if keep_last_k is not None and keep_last_k < 1:
            raise ValueError(f"keep_last_k must be None or >= 1, got {keep_last_k}")
        self.monitor, self.mode, self.every_n_epochs = monitor, mode, every_n_epochs
        self.save_top_k = (1 if save_top_k is None else save_top_k) if monitor is not None else None
        self.scores: dict[int, float] = {}  # step -> the monitored value at its save
        self.dirpath: Path | None = Path(dirpath).absolute() if dirpath is not None else None
        self.every_n_train_steps = every_n_train_steps
        self.keep_last_k = keep_last_k
        self.save_on_train_end = save_on_train_end
        self.save_hf = save_hf
        self.hf_max_shard_size = parse_size(hf_max_shard_size)
        self.last_saved_step: int | None = None
        self.last_path: Path | None = None
        self.run_id: str | None = None
        self.new_run_id: str | None = None
        """The id a fresh run records in its checkpoints (``None``: a random one); set by a launcher that
        identifies runs itself (:class:`~verl_trainer.callbacks.RayTrainReport`: the Ray Train run)."""
        self._resumed = False
        self._lock: DirectoryLock | None = None
        self.save_listeners: list[Callable[[Any, Path], None]] = []
        """Called as ``listener(trainer, path)`` on every rank after each complete save (e.g.
        :class:`~verl_trainer.callbacks.RayTrainReport`), in the order they were added."""

    def setup(self, trainer: CallbackTrainer, module: CallbackModule, stage: str) -> None:
        """Resolve the default directory; for ``fit``, lock it (a collective, before any resume is read).

        Raises:
            DirectoryLockedError: On every rank, if another run holds the directory.
        """
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / "checkpoints"
        if stage != "fit":
            return
        error = stale = None
        if trainer.is_global_zero:
            lock = DirectoryLock(self.dirpath, "checkpoint directory")
            try:
                self._lock = lock.acquire()
                stale = lock.stale_message()
            except DirectoryLockedError as exc:
                error = str(exc)
        error = broadcast_object(error)
        if error is not None:
            raise DirectoryLockedError(error)
        if stale is not None:
            print(stale, flush=True)

    def teardown(self, trainer: CallbackTrainer, module: CallbackModule, stage: str) -> None:
        """Release the directory's lock (rank 0)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def on_fit_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Tie the run to its checkpoints (a collective; after a resume has restored :attr:`run_id`).

        Rank 0 removes the half-written / half-deleted folders an interrupted save or pruning left
        (saying so) and refuses a directory holding another run's checkpoints
        (:func:`~verl_trainer.engine.checkpoint_dirs.claim_checkpoint_dir`); a fresh run gets a new run id,
        recorded in every checkpoint it writes. Every rank raises the same error together.
        """
        assert self.dirpath is not None
        decision: list[Any] = [None, None, []]
        if trainer.is_global_zero:
            try:
                run_id, cleaned = claim_checkpoint_dir(self.dirpath, self.run_id, self._resumed,
                                                       new_id=self.new_run_id)
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

    @property
    def best_model_path(self) -> str:
        """The checkpoint with the best monitored value (``""`` before a save, or without ``monitor``)."""
        best = self._ranked()[:1]
        return str(self.dirpath / checkpoint_dir_name(best[0])) if best and self.dirpath is not None else ""

    @property
    def best_model_score(self) -> float | None:
        """The best monitored value so far (``None`` before one is saved, or without ``monitor``)."""
        best = self._ranked()[:1]
        return self.scores[best[0]] if best else None

    def _ranked(self) -> list[int]:
        """Saved steps, best monitored value first (ties: the earlier step)."""
        sign = 1.0 if self.mode == "min" else -1.0
        return sorted(self.scores, key=lambda step: (sign * self.scores[step], step))

    def _record_score(self, trainer: CallbackTrainer) -> None:
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            raise RuntimeError(
                f"ModelCheckpoint(monitor={self.monitor!r}) found no such metric at step "
                f"{trainer.global_step}; available: {', '.join(sorted(metrics)) or 'none'} (it must be "
                "logged before each save, e.g. by a validation run: check val_check_interval / "
                "check_val_every_n_epoch)"
            )
        self.scores[trainer.global_step] = float(metrics[self.monitor])

    def _due(self, trainer: CallbackTrainer) -> bool:
        n = self.every_n_train_steps
        return n is not None and trainer.global_step % n == 0 and trainer.global_step != self.last_saved_step

    def save(self, trainer: CallbackTrainer) -> Path:
        """Save now (a collective: every rank calls it); returns the checkpoint directory."""
        assert self.dirpath is not None
        path = self.dirpath / checkpoint_dir_name(trainer.global_step)
        if self.monitor is not None:  # before anything is written: a missing metric fails on every rank
            self._record_score(trainer)
        self.last_saved_step, self.last_path = trainer.global_step, path
        trainer.save_checkpoint(path)
        if self.save_hf:
            export_trainable_engines(trainer.module.engines, path, self.hf_max_shard_size)
        best = self._ranked()[: self.save_top_k] if self.save_top_k not in (None, -1) else list(self.scores)
        keep_all = self.keep_last_k is None or self.save_top_k == -1
        if trainer.is_global_zero and not keep_all:
            prune_checkpoints(self.dirpath, self.keep_last_k, trainer.global_step, self.run_id, protect=best)
        self.scores = {step: self.scores[step] for step in best} if self.monitor is not None else {}
        barrier()
        for listener in self.save_listeners:
            listener(trainer, path)
        return path

    def on_train_batch_end(
        self, trainer: CallbackTrainer, module: CallbackModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Save when due and no validation follows this step."""
        if self._due(trainer) and not trainer.validation_due():
            self.save(trainer)

    def on_validation_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Save when due, after the step's validation."""
        if trainer.state == "fit" and not trainer.sanity_checking and self._due(trainer):
            self.save(trainer)

    def on_train_epoch_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Save at the end of every ``every_n_epochs``-th epoch (unless this step is saved already)."""
        n = self.every_n_epochs
        epoch_done = n is not None and (trainer.current_epoch + 1) % n == 0
        if epoch_done and trainer.global_step != self.last_saved_step:
            self.save(trainer)

    def on_train_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Save the final state (unless this step is saved already)."""
        if self.save_on_train_end and trainer.global_step > 0 and trainer.global_step != self.last_saved_step:
            self.save(trainer)

    def state_dict(self) -> dict[str, Any]:
        """The last saved step and the run id (plain data)."""
        return {"last_saved_step": self.last_saved_step, "run_id": self.run_id,
                "scores": {str(step): value for step, value in self.scores.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.last_saved_step = state_dict.get("last_saved_step")
        self.run_id = state_dict.get("run_id")
        self.scores = {int(step): float(v) for step, v in state_dict.get("scores", {}).items()}
        self._resumed = True
