"""Preference optimisation (DPO and variants, SimPO, ORPO, KTO) as a ``TrainingModule``.

One trained engine (``"actor"``) and, for the objectives with a reference (all but SimPO and ORPO), the
frozen reference: a ``"ref"`` engine, or the LoRA actor with its adapters disabled (``ref.in_actor``, the RL
recipes' reference machinery: :func:`~verl_trainer.algorithms.stages.update.compute_log_probs`). A step::

    on_before_update (SequenceBalancing: whole pairs / examples per rank)
    -> KTO: the reference point z0 over the whole step (its KL rows: actor and reference forwards, one
       all-reduce of (sum, count) over the DP group), then the KL rows leave the batch
    -> reference log-probs (ref_log_prob)
    -> actor.train_batch(batch, preference_loss)   (pairs whole in each micro-batch)

The loss and its metrics: :mod:`verl_trainer.core_algos.preference`; the data:
:mod:`verl_trainer.data.preference`. Validation logs the same metrics under ``val/`` (``val/loss``,
``val/rewards/accuracies``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from verl_trainer.algorithms.config import RefConfig
from verl_trainer.algorithms.non_finite import NonFiniteConfig
from verl_trainer.algorithms.preference_data import unique_group_ids
from verl_trainer.algorithms.stages.guard import NonFiniteGuard
from verl_trainer.algorithms.stages.update import compute_log_probs
from verl_trainer.core_algos.aggregation import masked_sum
from verl_trainer.core_algos.preference import PreferenceLossConfig, preference_loss
from verl_trainer.data import schema
from verl_trainer.engine.config import EngineConfig, OptimConfig
from verl_trainer.module import EngineSpec, StepOutput, TrainingModule
from verl_trainer.utils.distributed import all_reduce

__all__ = ["PreferenceConfig", "PreferenceModule", "kto_step_reference_point"]


@dataclass
class PreferenceConfig:
    """What preference optimisation trains and how.

    Attributes:
        model_path: The initial policy (HF directory); also the reference unless ``ref.engine.model_path``.
        engine: The actor's engine settings (micro-batching, LoRA, ...).
        optim: Optimizer and LR schedule.
        loss: The objective (``loss_type``, ``beta``, ...): :class:`PreferenceLossConfig`.
        ref: The reference (``engine``; ``in_actor``: the LoRA actor with adapters disabled; ``null``: on
            with LoRA). Unused by SimPO and ORPO.
        non_finite: A non-finite loss / gradient: stop (``error``) or skip the step.
    """

    model_path: str = ""
    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    non_finite: NonFiniteConfig = field(default_factory=NonFiniteConfig)

    @property
    def ref_in_actor(self) -> bool:
        """Whether the reference is the actor with its LoRA adapters disabled."""
        return self.engine.lora_enabled if self.ref.in_actor is None else self.ref.in_actor

    def __post_init__(self) -> None:
        if self.ref.in_actor and not self.engine.lora_enabled:
            raise ValueError("algorithm.ref.in_actor=true makes the reference the actor with its LoRA "
                             "adapters disabled, but the actor has none; set algorithm.engine.lora_rank > 0 "
                             "or ref.in_actor=false (a separate reference engine)")


def kto_step_reference_point(engines: dict[str, Any], kl_batch: TensorDict, ref_in_actor: bool,
                             dp_group: Any, dp_size: int) -> float:
    """KTO's ``z0`` over the whole step: ``max(0, mean over every KL row of every rank of log-ratio sums)``.

    Args:
        engines: The module's engines (``actor``; ``ref`` unless ``ref_in_actor``).
        kl_batch: This rank's KL rows (``kl_sample``; padding rows count nothing).
        ref_in_actor: The reference is the actor with adapters disabled.
        dp_group: The DP group (one all-reduce of two numbers).
        dp_size: Its size.

    Returns:
        The reference point, the same on every rank (TRL's estimate: mismatched pairs, detached, clamped).
    """
    actor = engines["actor"]
    with actor.eval_mode():
        policy = actor.infer_batch(kl_batch)["model_output"]["log_probs"]
    compute_log_probs(engines, kl_batch, False, True, ref_in_actor)
    mask = kl_batch[schema.LOSS_MASK].bool()
    real = schema.real_mask(kl_batch)
    ratios = masked_sum(policy - kl_batch[schema.REF_LOG_PROB], mask, -1)[real]
    totals = torch.stack([ratios.double().sum(), torch.tensor(float(ratios.numel()), dtype=torch.float64)])
    if dp_size > 1:
        totals = all_reduce(totals, dp_group)
    return max(float(totals[0] / totals[1].clamp_min(1)), 0.0)


class PreferenceModule(TrainingModule):
    """Preference optimisation of one causal LM (see the module docstring).

    Args:
        config: See :class:`PreferenceConfig`.
    """

    def __init__(self, config: PreferenceConfig) -> None:
        super().__init__()
        self.config = config
        self.loss_fn = preference_loss(config.loss)
        self.non_finite = NonFiniteGuard(config.non_finite, group_estimator=False)

    def configure_engines(self) -> dict[str, EngineSpec]:
        """``actor`` (trained) and, with a reference and no ``ref.in_actor``, ``ref`` (inference only)."""
        cfg = self.config
        if not cfg.model_path:
            raise ValueError("PreferenceModule: config.model_path is empty; set algorithm.model_path")
        actor = cfg.engine.replace(model_path=cfg.model_path)
        specs = {"actor": EngineSpec("language_model", actor, cfg.optim)}
        if cfg.loss.needs_reference and not cfg.ref_in_actor:
            ref = cfg.ref.engine.replace(model_path=cfg.ref.engine.model_path or cfg.model_path)
            specs["ref"] = EngineSpec("language_model", ref, None)
        return specs

    def _prepare(self, batch: TensorDict) -> tuple[TensorDict, dict[str, Any]]:
        """The batch the loss reads: KTO's reference point set and its KL rows gone; reference log-probs."""
        cfg, extra = self.config, {}
        if cfg.loss.loss_type == "kto":
            if schema.KL_SAMPLE not in batch.keys():
                raise KeyError("loss_type=kto needs the batch's KL rows ('kl_sample'); build batches with "
                               "verl_trainer.data.preference.PreferenceDataset(unpaired=True)")
            kl_rows = batch[schema.KL_SAMPLE].bool()
            topo = self.topology
            dp_group, dp_size = (topo.dp_group, topo.dp_size) if topo is not None else (None, 1)
            z0 = kto_step_reference_point(self.engines, batch[kl_rows], cfg.ref_in_actor, dp_group, dp_size)
            batch = batch[~kl_rows]
            batch.set(schema.KL_REFERENCE, torch.full((batch.batch_size[0],), z0, dtype=torch.float32))
            extra["kto/kl"] = z0
        if cfg.loss.needs_reference:
            compute_log_probs(self.engines, batch, False, True, cfg.ref_in_actor)
        return batch, extra

    def training_step(self, batch: TensorDict, batch_idx: int) -> StepOutput:
        """One optimizer step on this rank's batch."""
        batch = unique_group_ids(batch, self.topology)
        if self.trainer is not None:
            batch = self.trainer.call_hook("on_before_update", batch)
        batch, _ = self._prepare(batch)
        actor = self.engines["actor"]
        with actor.train_mode():
            out = actor.train_batch(batch, self.loss_fn, hooks=self.step_hooks)
        step = (self.trainer.global_step if self.trainer is not None else 0) + 1
        return self.non_finite.single_update("actor", out, step)

    def validation_step(self, batch: TensorDict, batch_idx: int) -> StepOutput:
        """The loss and the preference metrics of one validation batch, as ``val/<name>``."""
        batch, _ = self._prepare(batch)
        actor = self.engines["actor"]
        with actor.eval_mode():
            out = actor.infer_batch(batch, self.loss_fn)
        renamed = [{f"val/{k}": v for k, v in m.items() if k != "pref/loss"} for m in out["metrics"]]
        return {"val/loss": out["loss"], "micro_batches": renamed}

    def state_dict(self) -> dict[str, Any]:
        """The count of steps skipped in a row for a non-finite loss (plain data)."""
        return {"non_finite_skipped_in_a_row": self.non_finite.skipped_in_a_row}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.non_finite.skipped_in_a_row = int(state_dict.get("non_finite_skipped_in_a_row", 0))

