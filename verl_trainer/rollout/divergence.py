"""Diverged weights show up first in the rollout, as non-finite logits: say so, with the step.

When an update drives the policy's weights to NaN or inf, the next rollout's logits are non-finite and
sampling fails inside ``torch.multinomial`` ("probability tensor contains either inf, nan or element < 0")
— a message about the sampler, not the model — or, greedy, silently picks token 0. The HF rollout's sampler
checks the logits first (``rollout/sampling.py: check_logits``) and the rollout turns both into
:class:`DivergenceError`, naming the non-finite parameters it finds in its copy of the policy;
the RL module adds the step (``algorithms/rl.py``).
"""

from __future__ import annotations

import torch

from verl_trainer.utils.listing import first_of

__all__ = ["DivergenceError", "diverged", "is_sampler_error"]

_SAMPLER_MESSAGE = "probability tensor contains either"
_SHOWN = 3


class DivergenceError(RuntimeError):
    """The policy produced non-finite logits: its weights have diverged."""


def is_sampler_error(exc: BaseException) -> bool:
    """Whether ``exc`` is ``torch.multinomial``'s error on non-finite probabilities."""
    return isinstance(exc, RuntimeError) and _SAMPLER_MESSAGE in str(exc)


def diverged(model: torch.nn.Module, cause: BaseException | None = None) -> DivergenceError:
    """A :class:`DivergenceError` naming ``model``'s non-finite parameters (the last update's weights)."""
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    total = sum(1 for _ in model.parameters())
    if bad:
        where = f"{len(bad)} of its {total} parameter tensors are non-finite ({first_of(bad, _SHOWN)})"
    else:
        where = "its parameters are finite, so an activation overflowed"
    sampler = cause is not None and is_sampler_error(cause)
    detail = f" (the sampler said: {str(cause).splitlines()[0]})" if sampler else ""
    return DivergenceError(
        f"training diverged: the policy's logits are non-finite, and {where}{detail}. Lower the learning "
        f"rate, clip gradients (optim.clip_grad), or resume from an earlier checkpoint"
    )
