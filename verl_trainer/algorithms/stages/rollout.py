"""The RL step's rollout: the training responses of a prompt batch, and the rollout copy kept in sync.

:class:`RolloutStage` is the plain stage: it gives the step's prompts uids unique over the DP ranks,
samples ``rollout.n`` responses per prompt with the rollout's current weights (:class:`BaseRollout`: hf,
vLLM, the multi-turn agent loop), then runs its parts on the same prompts and weights (ReMax's greedy
responses: :class:`~verl_trainer.algorithms.greedy_baseline.GreedyBaseline`). :class:`WeightSync` copies the
actor's weights into the rollout's copy: before a generation when stale, and after each update that trained
the actor. The asynchronous rollout (:class:`~verl_trainer.algorithms.async_rollout.AsyncRollout`) wraps
any stage with the same three methods.

Sampling is seeded per response from ``(rollout.seed, global step, the prompt's dataset index, sample
index)``, so the responses of a step do not depend on the dp size (:mod:`verl_trainer.rollout.base`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from tensordict import TensorDict

from verl_trainer.algorithms.stages import StepMetrics
from verl_trainer.data import schema
from verl_trainer.engine.base import BaseEngine
from verl_trainer.rollout import BaseRollout
from verl_trainer.rollout.config import RolloutConfig
from verl_trainer.rollout.divergence import DivergenceError
from verl_trainer.rollout.lora_sync import peft_config_dict

__all__ = ["RolloutPart", "RolloutStage", "WeightSnapshot", "WeightSync", "unique_uids"]

_SERIALS = itertools.count()
"""Export numbers, unique in the process: a rollout outlives the stages (a second fit builds new ones)."""


def unique_uids(prompt_batch: TensorDict, dp_rank: int) -> TensorDict:
    """Give this rank's prompts uids unique over the DP ranks (a repeated prompt is a new group); in place."""
    b = prompt_batch.batch_size[0]
    prompt_batch[schema.UID] = dp_rank * b + torch.arange(b, dtype=torch.long)
    return prompt_batch


class RolloutPart(Protocol):
    """A part run after the samples, on the same prompts and weights (e.g. ReMax's greedy responses)."""

    def after_rollout(self, rollout: BaseRollout, prompt_batch: TensorDict, step: int,
                      prompt_index: torch.Tensor, metrics: StepMetrics) -> None:
        """Generate what the part needs; ``metrics`` receives its timings."""


@dataclass(frozen=True)
class WeightSnapshot:
    """The actor's weights as the rollout receives them, CPU copies (:meth:`WeightSync.export`).

    Attributes:
        tensors: ``{hf_name: tensor}`` (merged), or the adapters under peft's file names (``adapter``).
        peft_config: The adapter's ``adapter_config.json`` content; ``None`` for merged weights.
        serial: The export's number (increasing, unique in the process): the adapter's version in the rollout.
    """

    tensors: dict[str, torch.Tensor]
    peft_config: dict[str, Any] | None
    serial: int


class WeightSync:
    """Keeps the rollout's copy of the policy at the actor's weights.

    Args:
        actor: The actor engine.
        rollout: The rollout whose copy it writes.
        config: ``algorithm.rollout`` (``share_weights``, ``max_staleness``).
        dp_rank: This rank's DP rank (the SP / TP ranks of one DP rank sample the same responses);
            ``None``: one process, the rollout's own.

    Invariant: :attr:`stale` is ``True`` whenever the actor may hold weights the rollout has not seen
    (at start, after a checkpoint is restored) until :meth:`sync` runs.
    """

    def __init__(self, actor: BaseEngine, rollout: BaseRollout, config: RolloutConfig,
                 dp_rank: int | None = None) -> None:
        self.actor = actor
        self.rollout = rollout
        self.config = config
        self.dp_rank = dp_rank
        self.stale = True  # the actor may not be model_path's weights (e.g. saved LoRA adapters)
        self.adapter = config.lora_sync == "adapter"
        """Adapter-only sync (``rollout.lora_sync=adapter``): the rollout serves the adapters as a LoRA
        request over its base weights (:mod:`verl_trainer.rollout.lora_sync`)."""

    def sync(self) -> None:
        """The actor's weights into the rollout (a collective: call on every rank).

        Where the actor holds its parameters whole on this rank (``engine.get_shareable_params()``) and
        ``rollout.share_weights`` is on, the rollout aliases them (no copy; a no-op after the first
        call); else every tensor is streamed into the rollout's copy (always with ``max_staleness >= 1``:
        the rollout generates while the actor trains). With ``lora_sync=adapter`` only the adapters are
        exported and become the rollout's newest LoRA version (:meth:`export`, :meth:`load`).
        """
        if self.adapter:
            self.load(self.export())
            self._synced()
            return
        share = self.config.share_weights and not self.config.max_staleness
        with self.actor.eval_mode():
            shareable = self.actor.get_shareable_params() if share else None
            if shareable is not None:
                self.rollout.share_weights(shareable)
            else:
                self.rollout.update_weights(self.actor.get_per_tensor_param())
        self._synced()

    def _synced(self) -> None:
        if self.dp_rank is not None:  # SP / TP ranks of one DP rank sample the same responses
            self.rollout.data_rank = self.dp_rank
        self.stale = False

    def export(self) -> WeightSnapshot:
        """The actor's weights as CPU copies: the merged model, or the adapters alone (a collective).

        The asynchronous rollout keeps up to ``max_staleness + 1`` of them; with ``lora_sync=adapter`` each
        is the adapters' size, not the model's.
        """
        with self.actor.eval_mode():
            stream = self.actor.get_per_tensor_param(adapters_only=self.adapter)
            tensors = {name: t.detach().to("cpu", copy=True) for name, t in stream}
        config = peft_config_dict(self.actor.peft_model) if self.adapter else None
        return WeightSnapshot(tensors, config, next(_SERIALS))

    def load(self, snapshot: WeightSnapshot) -> None:
        """Write ``snapshot`` into the rollout (no collective: any thread, between generations).

        Merged weights are streamed into the rollout's copy; adapters become the rollout's newest LoRA
        version (``rollout.load_adapter``).
        """
        if snapshot.peft_config is None:
            self.rollout.update_weights(snapshot.tensors.items())
        else:
            self.rollout.load_adapter(snapshot.serial, snapshot.tensors, snapshot.peft_config)

    def refresh(self) -> None:
        """Sync when :attr:`stale` (before a generation)."""
        if self.stale:
            self.sync()


class RolloutStage:
    """The plain rollout stage (see the module docstring).

    Args:
        rollout: The rollout backend (a private copy of the policy, or one aliasing the actor's weights).
        weights: Keeps that copy at the actor's weights.
        dp_rank: This rank's DP rank (the uids' offset).
        parts: Run after the samples, in order.
    """

    def __init__(self, rollout: BaseRollout, weights: WeightSync, dp_rank: int = 0,
                 parts: Sequence[RolloutPart] = ()) -> None:
        self.rollout = rollout
        self.weights = weights
        self.dp_rank = dp_rank
        self.parts = list(parts)

    def sample(self, prompt_batch: TensorDict, step: int, metrics: StepMetrics) -> TensorDict:
        """The responses to ``prompt_batch`` with the rollout's current weights (no sync: any thread).

        Args:
            prompt_batch: This rank's prompts (``uid``: their dataset indices, the sampling seeds; replaced
                in place by uids unique over the ranks).
            step: ``trainer.global_step`` (updates done), seeding the sampling.
            metrics: Receives ``timing/rollout_s`` and the parts' timings.

        Raises:
            DivergenceError: The weights are non-finite (naming step ``step + 1``).
        """
        start = time.perf_counter()
        prompt_index = prompt_batch[schema.UID].clone()  # dataset indices: the seeds, at any dp size
        prompt_batch = unique_uids(prompt_batch, self.dp_rank)
        try:
            samples = self.rollout.generate(prompt_batch, step=step, prompt_index=prompt_index)
            for part in self.parts:
                part.after_rollout(self.rollout, prompt_batch, step, prompt_index, metrics)
        except DivergenceError as exc:  # the update before this step made the weights non-finite
            raise DivergenceError(f"step {step + 1} (its rollout): {exc}") from None
        metrics["timing/rollout_s"] = time.perf_counter() - start
        return samples

    def generate(self, prompt_batch: TensorDict, step: int, metrics: StepMetrics) -> TensorDict:
        """Sync the copy when stale (a collective), then :meth:`sample`."""
        self.weights.refresh()
        return self.sample(prompt_batch, step, metrics)

    def after_update(self, outputs: Mapping[str, Any]) -> None:
        """After the step's update: sync when it trained the actor (``outputs`` has ``actor/grad_norm``)."""
        if "actor/grad_norm" in outputs:
            self.weights.sync()

    def before_validation(self, step: int) -> None:
        """Validation samples with the current weights: sync when stale (``step``: ``global_step``)."""
        self.weights.refresh()
