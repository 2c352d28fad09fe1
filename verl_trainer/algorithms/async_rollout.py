"""Asynchronous rollout at bounded staleness (``algorithm.rollout.max_staleness = k >= 1``).

A background thread on each rank generates the responses of the next ``k`` steps while the training
thread trains; step ``s`` trains on responses sampled by the weights after ``v(s)`` updates, with
``s - v(s) <= k`` (the *staleness*)::

    step t (global_step = t updates done), training thread:
      publish the actor's weights as version t          (a collective: the weight export)
      wait for the group of step t                      (the head of the queue; idle time measured)
      agree over the DP ranks that no rank's rollout failed        (a collective; raises naming the rank)
      admit the groups of steps t+1 .. t+k not yet queued, with version t   (admission control)
      rewards, advantages, update of step t             (meanwhile the thread generates the queue in order)

**Admission control.** A group is queued only for a step ``s <= t + k`` and is sampled with the version
current when it is admitted (``t``), so its staleness when consumed is ``s - t <= k``; it is never
started with weights that could make it staler than ``k``, and every admitted group is trained (none is
discarded for being slow). In steady state step ``s`` is sampled by version ``s - k``; the first ``k``
steps (and the steps after a resume, or after an epoch's end where the read-ahead saw fewer steps) have
a smaller staleness. The schedule depends only on the step count and the data, never on timing, so a run
is reproducible from its seed at any dp size (sampling is seeded per response, as synchronously).

**Weights.** The training thread exports the actor's weights once per step into a snapshot (a CPU clone,
version-tagged); the thread loads a snapshot into the rollout's private copy between two groups, when
its next group needs a newer version. At most ``k + 1`` snapshots are alive (a group of step ``s`` holds
version ``s - k`` while versions up to ``s`` are published); a snapshot is freed once loaded past.
``k = 1`` is verl's one-step-off policy: step ``t + 1`` is generated with the weights of step ``t`` while
step ``t`` trains.

**Partial rollouts** (``rollout.partial_rollout``): a group is generated in chunks, each with the newest
published version its step may use (:mod:`verl_trainer.algorithms.partial_rollout`); its tokens then carry
several versions, all within ``[s - k, s]``.

**Batch fields.** ``policy_version`` ``[B]`` (int64: the updates the sampling weights contain) and
``token_policy_version`` ``[B, T]`` (int64: each response token's version, ``-1`` elsewhere); they
follow balancing and micro-batching as every per-sample / per-token tensor does.

**Failures.** An exception in the thread is kept with its group and re-raised on the training thread; a
thread that ended without finishing its group is reported with its rank. After each wait the DP ranks
agree (an all-reduce of a flag) so that every rank raises together, naming the failed ranks, instead of
one rank waiting in the next collective.

**Resume.** A checkpoint of step ``t`` waits for the queued groups (steps ``t .. t + k - 1``, versions
``t - k .. t - 1``) and stores their samples (:meth:`AsyncRollout.state_dict`,
:mod:`verl_trainer.algorithms.rollout_queue_state`); the resumed run trains them at their steps, so
without partial rollouts it continues with the same samples, losses and weights as the uninterrupted run.
With partial rollouts the checkpoint finishes the queued groups with the versions published so far (the
uninterrupted run might have sampled their last chunks with a newer one): the resumed run trains exactly
the samples the checkpointing run trains; later steps depend on timing, as in any partial run.

Validation waits for the queue to drain, then loads the current weights (validation samples on the
training thread with the rollout's model).

Logged: ``rollout/staleness`` (mean over samples), ``rollout/staleness_min``, ``rollout/staleness_max``,
``rollout/tokens_at_staleness_<d>`` (response tokens trained at staleness ``d``; sum), ``rollout/queued``
(groups queued after admission), ``timing/rollout_s`` (generation of the trained group, wherever it ran),
``timing/idle_s`` (the training thread waiting for it), ``timing/rollout_idle_s`` (the thread not
generating since the previous step), ``timing/weight_sync_s`` (the export).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.algorithms.partial_rollout import ChunkedSampler, place_token_versions
from verl_trainer.algorithms.rollout_queue_state import QUEUE_STATE_VERSION
from verl_trainer.algorithms.stages import StepMetrics
from verl_trainer.algorithms.stages.rollout import RolloutStage, WeightSnapshot
from verl_trainer.data import schema
from verl_trainer.data.batch_state import batch_from_state, batch_state
from verl_trainer.data.schema import prompt_token_lists
from verl_trainer.metrics import Metric
from verl_trainer.rollout import BaseRollout

__all__ = ["POLICY_VERSION", "TOKEN_POLICY_VERSION", "AsyncRollout", "RolloutWorkerError",
           "check_async_rollout", "tag_versions"]

POLICY_VERSION = "policy_version"
"""``[B]`` int64: updates contained in the weights that sampled the sample."""
TOKEN_POLICY_VERSION = "token_policy_version"
"""``[B, T]`` int64: the version that sampled each response token; ``-1`` at prompt and padding tokens."""
_POLL_S = 0.5


class RolloutWorkerError(RuntimeError):
    """The rollout thread of one or more DP ranks failed; raised on every rank together."""


def check_async_rollout(rollout: BaseRollout) -> None:
    """Refuse a built rollout backend that cannot generate on a background thread (after ``auto``).

    Raises:
        ValueError: Naming the backend and the fix.
    """
    if not type(rollout).one_step_off or rollout.agent_loop is not None:  # declared by the backend class
        raise ValueError(
            f"rollout max_staleness>=1 needs a single-turn rollout whose backend declares one_step_off "
            f"(hf and vllm do), got {type(rollout).__name__}"
            f"{' with a multi-turn agent loop' if rollout.agent_loop is not None else ''}: set "
            "algorithm.rollout.name=hf or vllm (single-turn), or max_staleness=0"
        )


def tag_versions(batch: TensorDict, version: int, per_token: list[list[int]] | None = None) -> TensorDict:
    """Add :data:`POLICY_VERSION`, :data:`TOKEN_POLICY_VERSION` of a group sampled by ``version``; in place.

    Args:
        batch: A rollout batch (``prompt_len``, ``response_len``, ``input_ids`` ``[B, T]``).
        version: Updates contained in the sampling weights (of the first token, with ``per_token``).
        per_token: Partial rollouts: per row, the version of each response token; a row's
            ``policy_version`` is then its first token's (its oldest), ``version`` where it has none.
    """
    if per_token is not None:
        batch[TOKEN_POLICY_VERSION] = place_token_versions(batch, per_token)
        batch[POLICY_VERSION] = torch.tensor([v[0] if v else version for v in per_token], dtype=torch.long)
        return batch
    b, t = batch[schema.INPUT_IDS].shape
    start = batch[schema.PROMPT_LEN].view(-1, 1)
    end = start + batch[schema.RESPONSE_LEN].view(-1, 1)
    pos = torch.arange(t).view(1, -1)
    response = (pos >= start) & (pos < end)
    batch[POLICY_VERSION] = torch.full((b,), version, dtype=torch.long)
    batch[TOKEN_POLICY_VERSION] = torch.where(response, torch.tensor(version), torch.tensor(-1))
    return batch


@dataclass
class _Group:
    """The samples of one step: its prompts, the version admitted with, the outcome."""

    step: int
    prompt_batch: TensorDict | None
    """``None`` for a group restored from a checkpoint (already done)."""
    prompts: list[list[int]]
    prompt_index: torch.Tensor
    version: int
    batch: TensorDict | None = None
    error: BaseException | None = None
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def matches(self, prompts: list[list[int]], prompt_index: torch.Tensor) -> bool:
        """Whether it was generated for these prompts (the step's batch is the one read ahead)."""
        return torch.equal(self.prompt_index, prompt_index) and self.prompts == prompts


class AsyncRollout:
    """The queue of groups generated on a background thread (see the module docstring).

    Args:
        stage: The rollout stage it wraps (its ``sample`` runs on the thread; ``weights.actor`` is exported
            on the training thread).
        peek_next: The trainer's read-ahead: ``peek_next(count)`` -> the prompt batches of the next up to
            ``count`` steps (fewer, or none, where unknown).
        max_staleness: ``k >= 1``.
        dp_group: The DP process group (``None``: one process); the failure agreement runs over it.
        dp_rank: This rank's DP rank (named in errors).
    """

    def __init__(self, stage: RolloutStage, peek_next: Callable[[int], list[TensorDict]],
                 max_staleness: int, dp_group: Any = None, dp_rank: int = 0) -> None:
        check_async_rollout(stage.rollout)
        if max_staleness < 1:
            raise ValueError(f"AsyncRollout max_staleness={max_staleness} must be >= 1 (0 is synchronous)")
        self.stage = stage
        self.peek_next = peek_next
        self.k = max_staleness
        self.partial = bool(stage.rollout.config.partial_rollout)
        self.dp_group = dp_group
        self.dp_rank = dp_rank
        self.queue: deque[_Group] = deque()
        """Admitted groups in step order; the thread generates them front to back."""
        self.published: dict[int, WeightSnapshot] = {}
        self.published_at: int | None = None
        """Version of the newest snapshot (``None``: none yet)."""
        self.loaded: int | None = None
        """Version in the rollout's model (``None``: the checkpoint's weights as built)."""
        self._lock = threading.Condition()
        self._model_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._todo: deque[_Group] = deque()
        self._busy_s = 0.0
        self._mark: tuple[float, float] | None = None

    # -------------------------------------------------------------------------------------- weights
    def publish(self, step: int) -> float:
        """Export the actor's weights as version ``step`` (a collective: every rank, same point).

        Returns:
            Seconds spent exporting (0 when version ``step`` is already published and not stale).
        """
        weights = self.stage.weights
        if self.published_at == step and not weights.stale:
            return 0.0
        start = time.perf_counter()
        snapshot = weights.export()  # the merged model, or the adapters alone (rollout.lora_sync)
        with self._lock:
            self.published[step] = snapshot
            self.published_at = step
        weights.stale = False
        if weights.dp_rank is not None:
            self.stage.rollout.data_rank = weights.dp_rank
        return time.perf_counter() - start

    def _load(self, version: int) -> None:
        """Load snapshot ``version`` into the rollout model (model lock held); free older snapshots."""
        if self.loaded != version:
            with self._lock:
                snapshot = self.published[version]
            self.stage.weights.load(snapshot)
            self.loaded = version
        with self._lock:
            for old in [v for v in self.published if v < version]:
                del self.published[old]

    # --------------------------------------------------------------------------------------- thread
    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._todo:
                    self._thread = None
                    return
                group = self._todo.popleft()
            start = time.perf_counter()
            try:
                with self._model_lock, torch.no_grad():
                    group.batch = self._sample_partial(group) if self.partial else self._sample(group)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread
                group.error = exc
            group.seconds = time.perf_counter() - start
            with self._lock:
                self._busy_s += group.seconds
            group.done.set()

    def _sample(self, group: _Group) -> TensorDict:
        """The group with the weights it was admitted with (model lock held)."""
        self._load(group.version)
        return tag_versions(self.stage.sample(group.prompt_batch, group.step, {}), group.version)

    def _sample_partial(self, group: _Group) -> TensorDict:
        """The group in chunks, each with the newest published version ``<= group.step`` (lock held).

        The chunked sampler serves the group's samples only (one call); a rollout part after them (ReMax's
        greedy baseline) samples whole, with the weights loaded last.
        """
        rollout = self.stage.rollout

        def before_chunk(chunk: int) -> int:
            with self._lock:
                newest = max(v for v in self.published if v <= group.step)
            if newest != self.loaded:
                self._load(newest)
            return newest

        sampler = ChunkedSampler(rollout.generate_token_ids, rollout.eos_token_ids,
                                 rollout.config.partial_chunk_tokens, before_chunk)

        def once(prompts: list[list[int]], config: Any, seeds: list[int]) -> Any:
            rollout.token_sampler = None
            return sampler(prompts, config, seeds)

        rollout.token_sampler = once
        try:
            batch = self.stage.sample(group.prompt_batch, group.step, {})
        finally:
            rollout.token_sampler = None
        return tag_versions(batch, group.version, sampler.versions)

    def _admit(self, prompt_batch: TensorDict, step: int, version: int) -> _Group:
        group = _Group(step=step, prompt_batch=prompt_batch, prompts=prompt_token_lists(prompt_batch),
                       prompt_index=prompt_batch[schema.UID].clone(), version=version)
        self.queue.append(group)
        with self._lock:
            self._todo.append(group)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"async-rollout-rank{self.dp_rank}",
                                                daemon=True)
                self._thread.start()
        return group

    def _wait_for(self, group: _Group) -> None:
        """Block until ``group`` is done; a thread that died without finishing it is an error."""
        while not group.done.wait(_POLL_S):
            with self._lock:
                thread = self._thread
            if thread is None or not thread.is_alive():
                if group.done.is_set():
                    return
                group.error = RuntimeError(f"the rollout thread of dp rank {self.dp_rank} ended without "
                                           f"finishing the group of step {group.step + 1}")
                return

    def wait(self) -> None:
        """Let every queued group finish (their results are kept for their steps)."""
        for group in list(self.queue):
            self._wait_for(group)

    def _agree(self, group: _Group) -> None:
        """Raise on every DP rank when the group failed on any (a collective)."""
        failed = torch.zeros(dist.get_world_size(self.dp_group) if self._distributed else 1)
        if group.error is not None:
            failed[dist.get_rank(self.dp_group) if self._distributed else 0] = 1.0
        if self._distributed:
            dist.all_reduce(failed, group=self.dp_group)
        ranks = failed.nonzero().flatten().tolist()
        if not ranks:
            return
        if group.error is not None:
            raise RolloutWorkerError(f"async rollout of step {group.step + 1} failed on dp rank "
                                     f"{self.dp_rank}: {type(group.error).__name__}: {group.error}"
                                     ) from group.error
        raise RolloutWorkerError(f"async rollout of step {group.step + 1} failed on dp rank(s) {ranks} "
                                 f"(this is rank {self.dp_rank}; see that rank's error)")

    @property
    def _distributed(self) -> bool:
        return self.dp_group is not None and dist.is_available() and dist.is_initialized()

    def close(self) -> None:
        """Drop the groups not yet started, wait for the running one, empty the queue."""
        with self._lock:
            self._todo.clear()
            thread = self._thread
        if thread is not None:
            thread.join()
        self.queue.clear()

    # ----------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The queued groups' samples (tensors and plain data); waits for every queued group to finish.

        Returns:
            ``{"version", "max_staleness", "partial", "groups": [{"step", "version", "prompts",
            "prompt_index", "batch", "seconds"}]}`` for the groups in step order, up to the first failed
            one (a failed group and those after it are generated again on resume; the running fit raises
            at its step).
        """
        self.wait()
        groups = []
        for group in self.queue:
            if group.error is not None or group.batch is None:
                break
            groups.append({"step": group.step, "version": group.version, "prompts": group.prompts,
                           "prompt_index": group.prompt_index.clone(), "batch": batch_state(group.batch),
                           "seconds": group.seconds})
        return {"version": QUEUE_STATE_VERSION, "max_staleness": self.k, "partial": self.partial,
                "groups": groups}

    def load_state_dict(self, state: Mapping[str, Any]) -> bool:
        """Queue the groups :meth:`state_dict` saved, done (before this run's first step).

        Groups saved with another ``max_staleness`` or ``partial_rollout`` setting are dropped: their
        versions would not be this run's schedule. A group whose prompts are not its step's batch (another
        data order) is dropped at its step by :meth:`generate`, and generated again.

        Returns:
            Whether the groups were queued.
        """
        if state.get("max_staleness") != self.k or bool(state.get("partial")) != self.partial:
            if state.get("groups"):
                warnings.warn(f"the checkpoint's {len(state['groups'])} queued rollout groups were generated "
                              f"with max_staleness={state.get('max_staleness')}, partial_rollout="
                              f"{bool(state.get('partial'))}; this run has max_staleness={self.k}, "
                              f"partial_rollout={self.partial}: they are generated again with the restored "
                              "weights (not the uninterrupted run's samples)", stacklevel=2)
            return False
        self.close()
        for saved in state["groups"]:
            group = _Group(step=int(saved["step"]), prompt_batch=None,
                           prompts=[list(map(int, p)) for p in saved["prompts"]],
                           prompt_index=saved["prompt_index"], version=int(saved["version"]),
                           batch=batch_from_state(saved["batch"]), seconds=float(saved["seconds"]))
            group.done.set()
            self.queue.append(group)
        return True

    # ----------------------------------------------------------------------------------------- step
    def before_validation(self, step: int) -> None:
        """Validation samples with the current weights: drain the queue, then load version ``step``."""
        self.wait()
        self.publish(step)
        with self._model_lock:
            self._load(step)

    def after_update(self, outputs: Mapping[str, Any]) -> None:
        """Nothing: the weights are published at the next step's start."""

    def generate(self, prompt_batch: TensorDict, step: int, metrics: StepMetrics) -> TensorDict:
        """The responses this step trains on; admits the groups of the next ``k`` steps before returning.

        Args:
            prompt_batch: This rank's prompt batch of the step (``uid``: the prompts' dataset indices).
            step: ``trainer.global_step``.
            metrics: Receives the ``rollout/*`` and ``timing/*`` entries of the module docstring.

        Returns:
            The rollout batch (as :meth:`RolloutStage.sample` returns it) with the version fields.

        Raises:
            RolloutWorkerError: The group of this step failed on any DP rank (on every rank).
        """
        start = time.perf_counter()
        sync_s = self.publish(step)  # every rank, every step: the export is a collective
        head = self.queue[0] if self.queue else None
        if head is None or head.step != step or not head.matches(prompt_token_lists(prompt_batch),
                                                                 prompt_batch[schema.UID]):
            self.close()  # the read-ahead is not this step's data: admit it now with the current weights
            head = self._admit(prompt_batch, step, step)
        self._wait_for(head)
        idle = time.perf_counter() - start - sync_s
        self._agree(head)
        self.queue.popleft()
        known = {g.step for g in self.queue}
        for offset, upcoming in enumerate(self.peek_next(self.k), start=1):
            if step + offset not in known:
                self._admit(upcoming, step + offset, step)
        self._log(head, step, metrics)
        metrics["timing/idle_s"] = idle
        metrics["timing/weight_sync_s"] = sync_s
        return head.batch

    def _log(self, group: _Group, step: int, metrics: StepMetrics) -> None:
        batch, now = group.batch, time.perf_counter()
        real = schema.real_mask(batch)
        staleness = (step - batch[POLICY_VERSION][real]).float()  # a sample's oldest token
        if staleness.numel():
            metrics["rollout/staleness"] = Metric.mean(staleness.mean(), weight=staleness.numel())
            metrics["rollout/staleness_min"] = Metric.min(staleness.min())
            metrics["rollout/staleness_max"] = Metric.max(staleness.max())
        token_versions = batch[TOKEN_POLICY_VERSION][real]
        token_versions = token_versions[token_versions >= 0]
        for d in range(self.k + 1):
            count = (token_versions == step - d).sum().float()
            metrics[f"rollout/tokens_at_staleness_{d}"] = Metric.sum(count)
        metrics["rollout/queued"] = Metric.max(torch.tensor(float(len(self.queue))))
        metrics["timing/rollout_s"] = group.seconds
        with self._lock:
            busy = self._busy_s
        if self._mark is not None:
            metrics["timing/rollout_idle_s"] = max(0.0, (now - self._mark[0]) - (busy - self._mark[1]))
        self._mark = (now, busy)

    @property
    def weights(self) -> Any:
        """The wrapped stage's weight sync."""
        return self.stage.weights
