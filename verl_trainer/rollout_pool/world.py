"""The split of a ``devices = N`` world into trainer ranks and rollout ranks (``placement="separate"``).

:func:`split_world` runs on every rank right after the world is joined, before any model loads: it checks
the sizes (:func:`~.config.check_pool_world`), re-makes the default process group over the trainer ranks
``0 .. T-1`` (so the fit sees a world of ``T``), and gives every rank a :class:`Pool`: the weight group
(trainer rank 0 + the ``R`` rollout ranks ``T .. N-1``; gloo on CPU, NCCL on CUDA; its time-out is
``weight_sync_timeout_s``) and the message store (:mod:`.channel`). Trainer rank ``r`` is served by rollout
rank ``T + (r mod R)``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.distributed_c10d import _get_default_store

from verl_trainer.rollout_pool.buckets import send_weights
from verl_trainer.rollout_pool.channel import Liveness, PoolStoppedError, RolloutPoolError, post, take
from verl_trainer.rollout_pool.config import check_pool_world
from verl_trainer.rollout_pool.current import set_current_pool

__all__ = ["Pool", "make_group", "pool_settings", "split_world"]


def pool_settings(module: Any) -> tuple[Any, str] | None:
    """``(rollout config, model path)`` of a module whose rollout is placed separately; else ``None``."""
    config = getattr(module, "config", None)
    rollout = getattr(config, "rollout", None)
    if getattr(rollout, "placement", "colocated") != "separate":
        return None
    return rollout, str(config.model_path)


def make_group(store: Any, rank: int, size: int, timeout: timedelta, backend: str) -> Any:
    """A process group of ``size`` ranks over ``store`` outside the default world (gloo or NCCL)."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


@dataclasses.dataclass
class Pool:
    """One rank's view of the pool (see the module docstring).

    Attributes:
        config: The rollout config.
        model_path: The policy checkpoint the rollout ranks build their model from.
        store: The message store (prefixed).
        rank: This process's global rank in the launched world.
        trainers: ``T``.
        weight_group: Trainer rank 0 and the rollout ranks (``None`` on other trainer ranks).
        device: Where broadcast buckets live (``cuda`` with NCCL).
        world: The trainer world (:class:`~verl_trainer.training.launch.World`) on trainer ranks.
        mirrors_posted: Mirrored calls posted so far (trainer rank 0; :mod:`.mirror`).
    """

    config: Any
    model_path: str
    store: Any
    rank: int
    trainers: int
    weight_group: Any
    device: str
    world: Any = None
    mirrors_posted: int = 0
    _syncs: int = 0
    _jobs: dict[int, int] = dataclasses.field(default_factory=dict)
    _stopped: bool = False

    @property
    def rollout_ranks(self) -> list[int]:
        """Global ranks of the rollout ranks."""
        return list(range(self.trainers, self.trainers + self.config.rollout_ranks))

    @property
    def serves_rollout(self) -> bool:
        """Whether this process is a rollout rank."""
        return self.rank >= self.trainers

    def server_of(self, trainer_rank: int) -> int:
        """Global rank of the rollout rank serving ``trainer_rank``."""
        return self.trainers + trainer_rank % self.config.rollout_ranks

    @property
    def timeout(self) -> timedelta:
        """``weight_sync_timeout_s``."""
        return timedelta(seconds=self.config.weight_sync_timeout_s)

    def liveness(self) -> Liveness:
        """A watcher of the rollout ranks' heartbeats."""
        return Liveness(self.store, self.rollout_ranks, self.config.weight_sync_timeout_s)

    # -------------------------------------------------------------------------------- trainer side
    def broadcast_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                          liveness: Liveness, adapter_config: Mapping[str, Any] | None = None) -> None:
        """Send version ``version`` to every rollout rank (trainer ranks: all call; rank 0 sends).

        ``adapter_config``: ``None`` for the model's (merged) tensors; with ``lora_sync=adapter`` the
        adapters' ``adapter_config.json`` content (``named_tensors`` are then the adapters under peft's
        names), posted with the version: the rollout rank serves them as a LoRA request (:mod:`.worker`).

        Raises:
            RolloutPoolError: A rollout rank is silent for ``weight_sync_timeout_s`` (named), before or
                during the broadcast.
        """
        if self.weight_group is None:  # another trainer rank: take part in the gather only
            for _ in named_tensors:
                pass
            return
        liveness.check(doing=f"waiting to receive weights version {version}")
        post(self.store, f"sync/{self._syncs}", {"version": version, "adapter_config": adapter_config})
        self._syncs += 1
        try:
            send_weights(named_tensors, self.weight_group, int(self.config.weight_sync_bucket_mb * 2**20),
                         self.device, self.timeout)
        except RolloutPoolError:
            raise
        except Exception as exc:  # a peer closed its connection, or the broadcast timed out
            gone = liveness.wait_silent()
            raise RolloutPoolError(
                f"weight broadcast of version {version} failed: rollout rank(s) {gone or self.rollout_ranks} "
                f"(global rank) did not answer within weight_sync_timeout_s="
                f"{self.config.weight_sync_timeout_s} s ({type(exc).__name__}: {exc})") from exc

    def generate(self, prompt_batch: TensorDict, step: int, version: int, trainer_rank: int,
                 liveness: Liveness, validation: Mapping[str, Any] | None = None) -> tuple[TensorDict, float]:
        """The samples of one group, generated by the rollout rank serving ``trainer_rank``.

        Args:
            prompt_batch: The trainer rank's prompts.
            step: The trainer's global step (it seeds the samples).
            version: The weight version to generate with (published before).
            trainer_rank: The trainer rank asking (its server generates; its uids' offset).
            liveness: The rollout ranks' heartbeat watcher.
            validation: A validation batch's sampling overrides (``n``, ``do_sample``, ``temperature``,
                ``top_p``; plain data): the rollout rank generates with the validation seed stream
                (``BaseRollout.generate(stream=1)``) instead of the training stage; ``None``: a
                training group.

        Returns:
            The rollout batch and the seconds the rollout rank spent.

        Raises:
            RolloutPoolError: The rollout rank failed (its error) or was silent (named).
        """
        seq = self._jobs.get(trainer_rank, 0)
        self._jobs[trainer_rank] = seq + 1
        server = self.server_of(trainer_rank)
        what = "group" if validation is None else "validation batch"
        job = {"prompts": prompt_batch, "step": step, "version": version, "dp_rank": trainer_rank}
        if validation is not None:
            job["validation"] = dict(validation)
        post(self.store, f"job/{trainer_rank}/{seq}", job)
        try:
            status, payload, seconds = take(
                self.store, f"result/{trainer_rank}/{seq}", lambda: self._stopped,
                lambda: liveness.check([server], f"generating the {what} of step {step + 1}"))
        except PoolStoppedError:
            raise RolloutPoolError(f"the rollout pool was closed before step {step + 1}'s {what} came back"
                                   ) from None
        if status != "ok":
            raise RolloutPoolError(f"rollout rank {server} (global rank) failed generating the {what} of "
                                   f"step {step + 1}: {payload}")
        return payload, seconds

    def close(self) -> None:
        """Tell the rollout ranks to stop (trainer rank 0; every trainer rank stops waiting)."""
        self._stopped = True
        if self.rank == 0:
            try:
                post(self.store, "stop", True)
            except Exception:  # the store is gone: the rollout ranks stop on their own
                pass

    def stopped(self) -> bool:
        """Whether trainer rank 0 posted ``stop`` (rollout side)."""
        return self._stopped or bool(self.store.check(["stop"]))

    def serve(self, exit_process: bool = False, mirrors: Mapping[str, Any] | None = None) -> None:
        """Run this rollout rank until the trainers stop (:func:`~.worker.serve`).

        Args:
            exit_process: End the process after serving (exit code 0): the Trainer passes ``True`` on a
                rank its script launcher started (a copy of the command: ``python recipe.py
                trainer.devices=N``), so what the script does after ``fit`` (validation, export) runs on
                the trainer ranks only. Elsewhere (a process group made by the caller, Ray Train) ``fit``
                returns on the rollout rank; a second fit there is refused (the Trainer runs no other
                stage on a rollout rank: it returns ``None`` from validate / test / predict).
            mirrors: Kind -> handler of the calls trainer rank 0 asks the rollout ranks to mirror
                (:mod:`.mirror`; e.g. Ray Train's report).

        Raises:
            RuntimeError: Called again after it served (a second fit on a rollout rank).
        """
        from verl_trainer.rollout_pool.worker import (
            serve,  # lazy: import cycle (worker -> algorithms -> stage)
        )

        if self._stopped:
            raise RuntimeError(f"global rank {self.rank} served the rollout pool of an earlier fit; a second "
                               "fit with a separate pool needs a fresh launch (one fit per process)")
        serve(self, mirrors or {})
        self._stopped = True
        if exit_process:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # not SystemExit: the failure guard around the stage would report it as a failure


def split_world(world: Any, module: Any, backend: str, timeout: timedelta) -> Pool | None:
    """Split the launched world when ``module``'s rollout is placed separately (every rank, at launch).

    Args:
        world: This rank's :class:`~verl_trainer.training.launch.World` (the default group is up).
        module: The training module (its ``config.rollout`` and ``config.model_path``).
        backend: The run's backend (``gloo`` / ``nccl``).
        timeout: The trainers' collective time-out.

    Returns:
        ``None`` for a colocated rollout; else this rank's :class:`Pool` (``pool.world``: the trainer
        world of ``T`` ranks, on trainer ranks).

    Raises:
        ValueError: From :func:`~.config.check_pool_world` (on every rank alike).
    """
    settings = pool_settings(module)
    if settings is None:
        return None
    config, model_path = settings
    trainers = check_pool_world(config, world.world_size)
    base = _get_default_store()
    dist.barrier()  # every rank holds the store before the default group goes
    dist.destroy_process_group()
    rank = world.rank
    if rank < trainers:
        dist.init_process_group(backend, store=dist.PrefixStore("verl_trainers", base), rank=rank,
                                world_size=trainers, timeout=timeout)
        trainer_world = dataclasses.replace(world, world_size=trainers)
    else:
        trainer_world = None
    in_group = rank == 0 or rank >= trainers
    group_rank = 0 if rank == 0 else rank - trainers + 1
    group = (make_group(dist.PrefixStore("verl_pool_weights", base), group_rank, config.rollout_ranks + 1,
                        timedelta(seconds=config.weight_sync_timeout_s), backend) if in_group else None)
    device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    return set_current_pool(Pool(config, model_path, dist.PrefixStore("verl_pool", base), rank, trainers,
                                 group, device, trainer_world))
