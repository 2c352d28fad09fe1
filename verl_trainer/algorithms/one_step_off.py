"""One-step-off asynchronous rollout (``algorithm.rollout.max_staleness=1``; verl's one-step-off policy).

Step ``t`` of an RL run, on every rank::

    wait for the responses of this step's prompts (started during step t-1, on a background thread)
      → weights of the actor (after t-1 updates) copied into the rollout's own copy     [training thread]
      → start generating step t+1's prompts (read ahead: ``trainer.peek_next_batch()``)  [background]
      → rewards, advantages, update of step t                                           [training thread]

so step t trains on responses sampled with the weights after ``t - 2`` updates: staleness 1 (the first
step, and a step whose read-ahead is unknown, generate now: staleness 0). The losses see both: the
trainer's ``old_log_probs`` (recomputed, or the update's own on a single update) and the sampler's
``rollout_log_probs``; ``rollout_correction`` (required) weights the policy loss by their ratio.

**Why it is safe.** The rollout model is a private copy (never the actor's storage), written only by the
weight copy at the start of a step, when no generation runs; a generation therefore samples with the
weights of the step it was started from. The background thread runs only the rollout's own ``generate``
(local: each rank samples its own prompts, seeded per response), never a collective; every collective
(the weight export, rewards from a reward model, balancing, the update) stays on the training thread.
Validation waits for the running generation, then syncs the current weights. torch releases the GIL in
its kernels, so generation and training overlap.

**Resume.** The read-ahead batch is not counted as consumed (the loader does not move), and the batch in
flight is not saved: a run resumed from a checkpoint of step ``t`` generates step ``t+1``'s responses
again, with the restored weights (staleness 0 for that step), then continues one step off.

:class:`OneStepOffRollout` wraps any rollout stage that can sample off the training thread (the plain
:class:`~verl_trainer.algorithms.stages.rollout.RolloutStage` with its parts: ReMax's greedy responses come
from the same weights); it holds the stage, its weight sync and the trainer's read-ahead, not the module.

Logged: ``rollout/staleness`` (per sample: updates between the sampling weights and the trained ones;
mean), ``timing/rollout_s`` (generation of the trained batch, wherever it ran), ``timing/idle_s`` (the
training thread waiting for it; the rest of ``timing/rollout_s`` overlapped the step before),
``timing/weight_sync_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from verl_trainer.algorithms.stages import StepMetrics
from verl_trainer.algorithms.stages.rollout import RolloutStage
from verl_trainer.data import schema
from verl_trainer.data.schema import prompt_token_lists
from verl_trainer.metrics import Metric
from verl_trainer.rollout import BaseRollout

__all__ = ["OneStepOffRollout", "check_async_rollout"]


def check_async_rollout(rollout: BaseRollout) -> None:
    """Refuse a built rollout backend that cannot generate on a background thread (after ``auto``).

    Raises:
        ValueError: Naming the backend and the fix.
    """
    if not type(rollout).one_step_off or rollout.agent_loop is not None:  # declared by the backend class
        raise ValueError(
            f"rollout max_staleness=1 needs a single-turn rollout whose backend declares one_step_off "
            f"(hf does), got {type(rollout).__name__}"
            f"{' with a multi-turn agent loop' if rollout.agent_loop is not None else ''} (name='auto' may "
            "pick vllm): set algorithm.rollout.name=hf, or max_staleness=0"
        )


@dataclass
class _Generation:
    """One generation on the background thread: its prompts, the weights' version, the outcome."""

    prompts: list[list[int]]
    """The prompt ids it was started with (to check the step's batch is the read-ahead one)."""
    prompt_index: torch.Tensor
    """``[B]`` the prompts' dataset indices (the sampling seeds)."""
    version: int
    """``global_step`` when the sampling weights were copied (updates they contain)."""
    thread: threading.Thread | None = None
    batch: TensorDict | None = None
    error: BaseException | None = None
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def matches(self, prompts: list[list[int]], prompt_index: torch.Tensor) -> bool:
        """Whether it generated for these prompts (the step's batch is the one read ahead)."""
        return torch.equal(self.prompt_index, prompt_index) and self.prompts == prompts


class OneStepOffRollout:
    """Generates step t+1's responses on a background thread while step t trains (see the module docstring).

    Args:
        stage: The rollout stage it wraps (its ``sample`` runs on the background thread; its
            ``weights`` sync the copy on the training thread).
        peek_next: The trainer's read-ahead: the next step's prompt batch, or ``None`` (unknown, or none).
    """

    def __init__(self, stage: RolloutStage, peek_next: Callable[[], TensorDict | None]) -> None:
        check_async_rollout(stage.rollout)
        self.stage = stage
        self.peek_next = peek_next
        self.pending: _Generation | None = None
        self.synced_at: int | None = None
        """``global_step`` of the weights in the rollout copy (``None``: not synced yet)."""

    # -------------------------------------------------------------------------------------- weights
    def sync(self, step: int) -> float:
        """Copy the actor's weights into the rollout when they are newer (a collective; no generation runs).

        Every rank reaches it at the same point with the same ``synced_at``, so all sync together.

        Args:
            step: ``trainer.global_step`` (updates the actor's weights contain).

        Returns:
            Seconds spent copying (0 when the copy was current).
        """
        if self.synced_at == step and not self.stage.weights.stale:
            return 0.0
        start = time.perf_counter()
        self.stage.weights.sync()
        self.synced_at = step
        return time.perf_counter() - start

    def wait(self) -> None:
        """Let the running generation finish (its result is kept for its step)."""
        if self.pending is not None and self.pending.thread is not None:
            self.pending.thread.join()

    def before_validation(self, step: int) -> None:
        """Validation samples with the current weights: wait for the generation, then sync."""
        self.wait()
        self.sync(step)

    def after_update(self, outputs: Mapping[str, Any]) -> None:
        """Nothing: the copy is synced at the next step's start."""

    # ----------------------------------------------------------------------------------------- step
    def _generate(self, gen: _Generation, prompt_batch: TensorDict, step: int) -> None:
        start = time.perf_counter()
        try:
            with torch.no_grad():
                gen.batch = self.stage.sample(prompt_batch, step, {})
        except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread
            gen.error = exc
        gen.seconds = time.perf_counter() - start
        gen.done.set()

    def _start(self, prompt_batch: TensorDict, step: int, background: bool) -> _Generation:
        gen = _Generation(prompts=prompt_token_lists(prompt_batch),
                          prompt_index=prompt_batch[schema.UID].clone(), version=self.synced_at or 0)
        if background:
            gen.thread = threading.Thread(target=self._generate, args=(gen, prompt_batch, step),
                                          name=f"one-step-off-rollout-{step}", daemon=True)
            gen.thread.start()
        else:
            self._generate(gen, prompt_batch, step)
        return gen

    def generate(self, prompt_batch: TensorDict, step: int, metrics: StepMetrics) -> TensorDict:
        """The responses this step trains on; starts the next step's generation before returning.

        Args:
            prompt_batch: This rank's prompt batch of the step (``uid``: the prompts' dataset indices).
            step: ``trainer.global_step``.
            metrics: Receives ``rollout/staleness`` and the ``timing/*`` entries.

        Returns:
            The rollout batch (as :meth:`RolloutStage.sample` returns it).

        Raises:
            DivergenceError: The weights that sampled it are non-finite (as the stage raises it).
        """
        start = time.perf_counter()
        self.wait()
        gen, self.pending = self.pending, None
        sync_s = self.sync(step)  # every rank, every step: the copy is a collective
        if gen is None or not gen.matches(prompt_token_lists(prompt_batch), prompt_batch[schema.UID]):
            gen = self._start(prompt_batch, step, background=False)  # no usable read-ahead: generate now
        idle = time.perf_counter() - start - sync_s
        if gen.error is not None:
            raise gen.error
        upcoming = self.peek_next()
        if upcoming is not None:
            self.pending = self._start(upcoming, step + 1, background=True)
        rollout_batch = gen.batch
        count = schema.num_real(rollout_batch)
        metrics["rollout/staleness"] = Metric.mean(torch.tensor(float(step - gen.version)), weight=count)
        metrics["timing/rollout_s"] = gen.seconds
        metrics["timing/idle_s"] = idle
        metrics["timing/weight_sync_s"] = sync_s
        return rollout_batch

    @property
    def weights(self) -> Any:
        """The wrapped stage's weight sync."""
        return self.stage.weights
