"""RayTrainReport: every checkpoint the Trainer saves goes to Ray Train, and a restarted run resumes from it.

Under Ray Train (``ray.train.torch.TorchTrainer``), the workers run an ordinary recipe or ``Trainer.fit``:
Ray starts the processes, sets ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` and
initialises the process group, which the Trainer joins as it is. Two things need this callback:

* Ray keeps (and hands back after a failure) only checkpoints given to ``ray.train.report``, and every
  worker must call it the same number of times. After each complete save of the Trainer's
  :class:`~verl_trainer.callbacks.ModelCheckpoint`, every rank reports: global rank 0 with the checkpoint
  directory (written by all ranks, so one report holds every shard; the ranks share that directory as
  they do for any multi-node checkpoint), the others with metrics only. With a separate rollout pool
  (``algorithm.rollout.placement=separate``) the rollout workers run no hook: trainer rank 0 asks them to
  report too (:mod:`verl_trainer.rollout_pool.mirror`), so the report's barrier over all workers passes.
* Ray Train 2 has no ``resume_from_checkpoint``: when Ray restarts the workers (a worker died, up to
  ``FailureConfig(max_failures)``) or a run is started again under the same ``RunConfig(name)``,
  ``ray.train.get_checkpoint()`` is the latest checkpoint Ray registered. A worker that dies after a save
  but before Ray registered it (Ray does so once every rank reported) leaves a newer checkpoint in the
  Trainer's own directory: every attempt of one Ray run records the same run id in its checkpoints
  (:func:`ray_run_id`), so :meth:`RayTrainReport.resume_path` finds it and returns the newer of the two,
  to pass as ``ckpt_path`` (recipes: ``trainer.ckpt_path=...``). Checkpoints of any other run in that
  directory are still refused.

``examples/ray_grpo.py`` runs a recipe this way; ``docs/ray.md`` maps Ray's placement to ``devices`` /
``num_nodes``. Needs the ``ray`` extra (``pip install 'verl-trainer[ray]'``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_trainer.callbacks.base import Callback
from verl_trainer.callbacks.contract import CallbackModule, CallbackTrainer
from verl_trainer.callbacks.model_checkpoint import ModelCheckpoint
from verl_trainer.engine.checkpoint_dirs import checkpoint_run_id, list_checkpoints
from verl_trainer.rollout_pool.current import current_pool
from verl_trainer.rollout_pool.mirror import post_mirror

MIRROR_KIND = "ray_train_report"


def _ray_train() -> Any:
    """``ray.train``, or an error saying how to install it."""
    try:
        import ray.train
    except ImportError as exc:
        raise ImportError(
            "RayTrainReport needs Ray Train: install the `ray` extra (pip install 'verl-trainer[ray]')"
        ) from exc
    return ray.train


def _in_ray_train_worker(train: Any) -> bool:
    try:
        train.get_context().get_world_rank()
    except Exception:  # noqa: BLE001 - Ray raises different errors outside a worker across versions
        return False
    return True


def ray_run_id() -> str:
    """This Ray Train run's id for the Trainer's checkpoints: ``ray-`` and a hash of its storage and name.

    Every attempt of the run (Ray's restarts after a failure; the run started again under the same name
    and storage) gets the same id, so an attempt recognises the checkpoints an earlier one wrote.
    """
    context = _ray_train().get_context()
    where = context.get_experiment_name()
    try:  # a DeveloperAPI in Ray 2.x: the run's directory in its storage
        where = str(context.get_storage().experiment_fs_path)
    except Exception:  # noqa: BLE001 - the name alone where Ray does not offer it
        pass
    return "ray-" + hashlib.sha256(where.encode()).hexdigest()[:10]


class RayTrainReport(Callback):
    """Report each checkpoint of the Trainer's ``ModelCheckpoint`` to Ray Train, from every rank.

    Args:
        metrics: Names of the step's logged metrics (``trainer.callback_metrics``) attached to each
            reported checkpoint, besides ``step`` (rank 0's values; Ray keeps those).

    Raises:
        ValueError: At ``setup`` (on every rank, before any step) if the Trainer has no
            ``ModelCheckpoint`` (``enable_checkpointing=False``) or the process is not a Ray Train worker.
    """

    def __init__(self, metrics: tuple[str, ...] = ()) -> None:
        self.metrics = tuple(metrics)
        self.reported: list[Path] = []
        self._listening: ModelCheckpoint | None = None

    def setup(self, trainer: CallbackTrainer, module: CallbackModule, stage: str) -> None:
        """Subscribe to the ``ModelCheckpoint``'s saves (fit only)."""
        if stage != "fit" or self._listening is not None:
            return
        checkpoints = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
        if not checkpoints:
            raise ValueError(
                "RayTrainReport reports the checkpoints of a ModelCheckpoint, but this Trainer has none "
                "(enable_checkpointing=False); turn checkpointing on (recipes: "
                "trainer.enable_checkpointing=true, trainer.checkpoint.every_n_train_steps=N) "
                "or drop RayTrainReport"
            )
        if not _in_ray_train_worker(_ray_train()):
            raise ValueError(
                "RayTrainReport works inside a Ray Train worker (the train_loop_per_worker of "
                "ray.train.torch.TorchTrainer), and this process is not one; run it through a TorchTrainer "
                "(examples/ray_grpo.py) or drop RayTrainReport"
            )
        self._listening = checkpoints[0]
        self._listening.new_run_id = ray_run_id()
        self._listening.save_listeners.append(self._report)

    def teardown(self, trainer: CallbackTrainer, module: CallbackModule, stage: str) -> None:
        """Unsubscribe (a later ``fit`` subscribes again)."""
        if self._listening is not None:
            self._listening.save_listeners.remove(self._report)
            self._listening = None

    def _report(self, trainer: CallbackTrainer, path: Path) -> None:
        """Every rank: ``ray.train.report``; rank 0 attaches the checkpoint directory ``path``."""
        train = _ray_train()
        metrics: dict[str, Any] = {"step": trainer.global_step}
        logged = getattr(trainer, "callback_metrics", {}) or {}
        for name in self.metrics:
            if name in logged:
                metrics[name] = float(logged[name])
        checkpoint = train.Checkpoint.from_directory(str(path)) if trainer.is_global_zero else None
        # a separate pool's rollout workers must report too (Ray's report is a barrier): ask them first
        post_mirror(current_pool(), MIRROR_KIND, {"step": int(metrics["step"]), "dir_name": path.name})
        train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=path.name)
        self.reported.append(path)

    def rollout_rank_mirrors(self) -> dict[str, Callable[[dict[str, Any]], None]]:
        """A separate pool's rollout worker reports each checkpoint too (``placement=separate``).

        It reports ``{"step": ...}`` and no checkpoint (global rank 0 attaches it).
        """
        return {MIRROR_KIND: self._report_on_rollout_rank}

    @staticmethod
    def _report_on_rollout_rank(payload: dict[str, Any]) -> None:
        _ray_train().report({"step": payload["step"]}, checkpoint=None,
                            checkpoint_dir_name=payload["dir_name"])

    @staticmethod
    def resume_path(checkpoint_dir: str | Path | None = None) -> str | None:
        """The checkpoint a (re)started attempt of this Ray run resumes from, or ``None`` (a fresh run).

        The newer of Ray's latest registered checkpoint and the newest complete checkpoint this Ray run
        wrote into ``checkpoint_dir`` (the Trainer's ``ModelCheckpoint`` directory; recorded with
        :func:`ray_run_id`), Ray's on a tie. Call it in the train function on every rank, before ``fit``,
        and pass the result as ``ckpt_path``. Ray's checkpoint is used where it lies on a local or shared
        file system; one in remote storage (``s3://``) is downloaded into a temporary directory first.
        """
        train = _ray_train()
        found: list[tuple[int, int, str]] = []  # (step, Ray's first on a tie, path)
        if checkpoint_dir is not None:
            run_id = ray_run_id()
            found += [(step, 0, str(path)) for step, path in list_checkpoints(checkpoint_dir)
                      if checkpoint_run_id(path) == run_id]
        checkpoint = train.get_checkpoint()
        if checkpoint is not None:
            local = Path(checkpoint.path)
            path = str(local) if local.is_dir() else checkpoint.to_directory()
            tail = local.name.rpartition("_")[2]  # reported as step_000050 (ModelCheckpoint's folder name)
            step = int(tail) if tail.isdigit() else -1
            found.append((step, 1, path))
        return max(found)[2] if found else None
