"""Optimizer part: the LR schedule built from :class:`OptimConfig`, and the step logic.

The optimizer itself is built by ``engine/optimizers.py`` (AdamW by default, or any class by name).

:class:`OptimizerMixin` gives an engine ``optimizer_zero_grad``, ``optimizer_step`` (clip; a non-finite
total grad norm zeroes the grads and skips the step; float16 compute: loss scaling, ``engine/loss_scale.py``)
and ``lr_scheduler_step``. Backends override
:meth:`OptimizerMixin._clip_grad_norm` (e.g. FSDP1's own ``clip_grad_norm_``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from verl_trainer.engine.config import OptimConfig
from verl_trainer.engine.optimizers import optimizer_kwargs
from verl_trainer.engine.topology import Topology
from verl_trainer.utils.distributed import all_reduce


class WarmupSchedule:
    """LR multiplier: linear warmup, then constant, or cosine / linear decay to ``min_lr_ratio``.

    A callable object with plain attributes, so ``LambdaLR.state_dict()`` stores them as plain data.

    Args:
        warmup_steps: Steps ``s < warmup_steps`` get ``(s + 1) / warmup_steps``.
        kind: ``"constant"``, ``"cosine"`` or ``"linear"``.
        total_steps: Last step of the decay (``None`` for constant).
        min_lr_ratio: Floor of the decay.

    """

    def __init__(
        self, warmup_steps: int, kind: str, total_steps: int | None = None, min_lr_ratio: float = 0.0
    ) -> None:
        if kind != "constant" and total_steps is not None and total_steps < 0:
            raise ValueError(
                f"lr_scheduler={kind!r} with total_training_steps={total_steps} (verl's 'set by the "
                "program'): nothing set the run's length; set OptimConfig.total_training_steps to the "
                "optimizer steps of the run (the recipes do it from trainer.max_steps / max_epochs)"
            )
        self.warmup_steps = int(warmup_steps)
        self.kind = str(kind)
        self.total_steps = None if total_steps is None else int(total_steps)
        self.min_lr_ratio = float(min_lr_ratio)

    def __call__(self, step: int) -> float:
        """Multiplier of the peak lr at scheduler step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant" or self.total_steps is None:
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        decay = 1.0 - progress if self.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig) -> LambdaLR:
    """Build the ``LambdaLR`` of :class:`WarmupSchedule` for ``config``."""
    schedule = WarmupSchedule(
        config.warmup_steps, config.lr_scheduler, config.total_training_steps, config.min_lr_ratio
    )
    return LambdaLR(optimizer, schedule)


def _mesh_of(t: torch.Tensor) -> object:
    return t.device_mesh if isinstance(t, DTensor) else None


def total_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float | None,
    sum_over: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Total L2 norm of the gradients (over all shards for DTensor grads), clipping to ``max_norm``.

    Under TP + FSDP the gradients live on two meshes (the ``(dp, tp)`` mesh of the split projections
    and the ``dp`` mesh of the replicated rest), which one ``clip_grad_norm_`` cannot stack: the norm
    of each mesh's group is reduced to a plain number first, then combined, then every gradient is
    scaled by the same clip coefficient. Under PP each stage holds other parameters: its squared norm
    is summed over the pipeline group (``sum_over``) before the coefficient is taken.

    Args:
        parameters: Parameters whose ``.grad`` count.
        max_norm: Clip threshold; ``None`` only measures.
        sum_over: The group whose ranks hold disjoint parameters (the pipeline stages), or ``None``.

    Returns:
        A plain scalar tensor (the norm before clipping), the same on every rank of ``sum_over``.

    """
    params = [p for p in parameters if p.grad is not None]
    clip = float("inf") if max_norm is None else float(max_norm)
    groups: dict[int, list[torch.Tensor]] = {}  # by the id of the gradients' mesh (None: plain)
    for grad in (p.grad for p in params):
        if grad is not None:
            groups.setdefault(id(_mesh_of(grad)), []).append(grad)
    if sum_over is None:
        if not params:
            return torch.zeros(())
        if len(groups) == 1:
            norm = torch.nn.utils.clip_grad_norm_(params, clip, error_if_nonfinite=False, foreach=True)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            return norm
    dtype = torch.float32 if sum_over is None else torch.float64  # a stage may hold no gradient at all
    norms = [torch.zeros((), dtype=dtype)]
    for grads in groups.values():
        group_norm = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=True)
        norms.append(group_norm.full_tensor() if isinstance(group_norm, DTensor) else group_norm)
    norm = torch.linalg.vector_norm(torch.stack([n.to(dtype).cpu() for n in norms]))
    if sum_over is not None:
        norm = all_reduce(norm * norm, sum_over).sqrt().float()
    if clip != float("inf"):
        coef = min(1.0, clip / (float(norm) + 1e-6))  # clip_grad_norm_'s coefficient, clamped at 1
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return norm


class OptimizerMixin:
    """``optimizer_zero_grad`` / ``optimizer_step`` / ``lr_scheduler_step`` for a torch optimizer.

    Attributes read: ``optimizer``, ``lr_scheduler``, ``optim_config``, ``module``, ``grad_scaler``
    (float16 compute: a ``torch.amp.GradScaler`` / ``ShardedGradScaler``, see ``engine/loss_scale.py``).
    Attributes written: ``skipped_steps`` (number of steps skipped for a non-finite grad norm).
    """

    optimizer: torch.optim.Optimizer | None
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None
    optim_config: OptimConfig | None
    module: torch.nn.Module | None
    topology: Topology | None
    grad_scaler: torch.amp.GradScaler | None = None
    skipped_steps: int = 0

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError(
                f"{type(self).__name__} has no optimizer (built without optim_config, or not "
                f"initialized); pass an OptimConfig and call initialize() first"
            )
        return self.optimizer

    def _clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Total grad norm before clipping (summed over the pipeline stages); clips when ``max_norm``."""
        assert self.module is not None and self.topology is not None
        return total_grad_norm(self.module.parameters(), max_norm, sum_over=self.topology.pp_group)

    def optimizer_zero_grad(self) -> None:
        """Set every gradient to ``None``."""
        self._require_optimizer().zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        """Unscale (float16), clip and step; a non-finite grad norm zeroes the grads and skips the step.

        With a loss scaler the gradients are unscaled first, so the norm and the clipping see the true
        gradients; the norm is global (all shards, all ranks), so every rank skips alike. The scaler's
        ``update`` then halves the scale after an inf/NaN gradient, or grows it after enough clean steps.

        Returns:
            The total grad norm before clipping (``nan``/``inf`` when the step was skipped).

        """
        optimizer = self._require_optimizer()
        scaler = self.grad_scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
        cfg = self.optim_config
        max_norm = cfg.clip_grad if cfg is not None and (cfg.clip_grad or 0) > 0 else None  # a positive clip
        norm = float(self._clip_grad_norm(max_norm))
        if not math.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
        else:
            # the gradients are unscaled and all finite, so a plain step is what scaler.step would do
            # (and it keeps fused AdamW off the scaler's found-inf path, whose shapes FSDP1's differ)
            optimizer.step()
        if scaler is not None:
            scaler.update()  # from the inf check unscale_ recorded: halve, or grow after enough clean steps
        return norm

    def apply_optim_config(self) -> None:
        """Make the optimizer and LR schedule follow :attr:`optim_config` again after a checkpoint load.

        Loading restores the optimizer's ``lr``/``betas``/``eps``/``weight_decay`` (``momentum``, ...) and
        the schedule's peak lr and shape from the checkpoint; a resume whose config changed them would
        silently keep the old ones. This puts the config's values back while keeping the moments and the
        schedule's position (``last_epoch``), so a new learning rate or schedule applies from the next step.
        Unchanged settings change nothing (the lr is recomputed with the formula ``LambdaLR`` uses).
        """
        cfg, scheduler = self.optim_config, self.lr_scheduler
        if cfg is None or self.optimizer is None:
            return
        groups = scheduler.optimizer.param_groups if scheduler is not None else self.optimizer.param_groups
        settings = optimizer_kwargs(type(self.optimizer), cfg)  # betas/eps/... as this class takes them
        for group in groups:
            group.update({k: v for k, v in settings.items() if k in group and k != "lr"}, initial_lr=cfg.lr)
        if scheduler is None:
            for group in groups:
                group["lr"] = cfg.lr
            return
        fresh = WarmupSchedule(cfg.warmup_steps, cfg.lr_scheduler, cfg.total_training_steps, cfg.min_lr_ratio)
        scheduler.base_lrs = [cfg.lr] * len(groups)
        for schedule in scheduler.lr_lambdas:
            if isinstance(schedule, WarmupSchedule):
                schedule.__dict__.update(fresh.__dict__)
        for group, base, schedule in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * schedule(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in groups]

    def lr_scheduler_step(self) -> float:
        """Advance the schedule one step; returns the new learning rate."""
        optimizer = self._require_optimizer()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return float(optimizer.param_groups[0]["lr"])
