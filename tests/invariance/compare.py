"""Relative differences between a case's step and its reference step.

* outputs (the forward of the initial parameters, before the step): per key (``log_probs`` and
  ``entropy``, or ``values``), norm-wise over every real sample's positions 1 .. L - 1, matched by uid;
  a sample missing on one side is ``inf``;
* scalars (loss, grad norm, each reduced metric): ``|got - want| / max(|got|, |want|)`` (0 when both are
  0);
* parameters: per tensor, norm-wise ``||got - want|| / ||want||``, the max over tensors; and the same for
  the *update* ``p_after - p_before``, which is ~lr x gradient with the test optimizer (see
  ``runner.OPTIM``), so it measures the gradient of every tensor, not just that the parameters moved
  little. Norm-wise rather than element-wise: an element whose gradient is pure round-off has no
  meaningful relative error, while the tensor as a whole does.
"""

from __future__ import annotations

from typing import Any

import torch

RTOL = 1e-5


def scalar_rel(got: float, want: float) -> float:
    """Relative difference of two numbers (0 when both are 0, inf when one is not finite)."""
    got, want = float(got), float(want)
    if not (torch.isfinite(torch.tensor(got)) and torch.isfinite(torch.tensor(want))):
        return 0.0 if got == want else float("inf")
    scale = max(abs(got), abs(want))
    return 0.0 if scale == 0 else abs(got - want) / scale


def tensor_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 (0 when both are 0)."""
    got, want = got.double(), want.double()
    diff = float((got - want).norm())
    scale = float(want.norm())
    if scale == 0:
        return 0.0 if diff == 0 else float("inf")
    return diff / scale


def metric_diffs(got: dict[str, float], want: dict[str, float]) -> dict[str, float]:
    """Per metric; a metric missing on one side is ``inf``."""
    return {name: scalar_rel(got[name], want[name]) if name in got and name in want else float("inf")
            for name in sorted(set(got) | set(want))}


def output_diffs(got: dict[int, dict[str, torch.Tensor]],
                 want: dict[int, dict[str, torch.Tensor]]) -> dict[str, float]:
    """Per output key, ``||got - want|| / ||want||`` over all samples (matched by uid)."""
    if set(got) != set(want):
        return {"samples": float("inf")}
    keys = sorted({k for outs in (*got.values(), *want.values()) for k in outs})
    out = {}
    for key in keys:
        if any(key not in got[u] or key not in want[u] for u in want):
            out[key] = float("inf")
            continue
        uids = sorted(want)
        out[key] = tensor_rel(torch.cat([got[u][key] for u in uids]), torch.cat([want[u][key] for u in uids]))
    return out


def param_diffs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                before: dict[str, torch.Tensor] | None = None) -> dict[str, dict[str, float]]:
    """``{"params": {name: rel}, "update": {name: rel}}`` (``update`` only with ``before``)."""
    names = sorted(set(got) | set(want))
    out: dict[str, dict[str, float]] = {"params": {}, "update": {}}
    for name in names:
        if name not in got or name not in want:
            out["params"][name] = float("inf")
            continue
        out["params"][name] = tensor_rel(got[name], want[name])
        if before is not None:
            out["update"][name] = tensor_rel(got[name] - before[name], want[name] - before[name])
    return out


def _max(values: dict[str, float]) -> float:
    return max(values.values(), default=0.0)


def compare(result: dict[str, Any], reference: dict[str, Any],
            before: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Every relative difference of ``result`` against ``reference``, with the max of each group.

    Returns:
        ``{"outputs", "loss", "grad_norm", "metrics", "params", "update": max rel diff (float),
        "detail": {"outputs": {key: rel}, "metrics": {name: rel}, "params": {name: rel},
        "update": {name: rel}}, "rank_loss_spread": max rel diff between ranks' logged losses,
        "sp_output_spread": max rel diff between the SP / TP ranks of a DP group for the same sample}``.

    """
    outputs = output_diffs(result["outputs"], reference["outputs"])
    metrics = metric_diffs(result["metrics"], reference["metrics"])
    params = param_diffs(result["params"], reference["params"], before)
    losses = result.get("rank_losses", [result["loss"]])
    return {
        "outputs": _max(outputs),
        "loss": scalar_rel(result["loss"], reference["loss"]),
        "grad_norm": scalar_rel(result["grad_norm"], reference["grad_norm"]),
        "metrics": _max(metrics),
        "params": _max(params["params"]),
        "update": _max(params["update"]),
        "rank_loss_spread": max(scalar_rel(x, losses[0]) for x in losses),
        "sp_output_spread": result.get("sp_output_spread", 0.0),
        "detail": {"outputs": outputs, "metrics": metrics, **params},
    }


COMPARED = ("outputs", "loss", "grad_norm", "metrics", "params", "update")
CHECKED = (*COMPARED, "rank_loss_spread", "sp_output_spread")


def failures(diffs: dict[str, Any], rtol: float = RTOL) -> dict[str, Any]:
    """What exceeds ``rtol``: ``{group: max}`` plus the offending names per group."""
    bad: dict[str, Any] = {}
    for key in CHECKED:
        if not diffs[key] <= rtol:  # NaN fails too
            bad[key] = diffs[key]
            detail = diffs["detail"].get(key)
            if detail:
                bad[f"{key}_worst"] = sorted(detail.items(), key=lambda kv: -kv[1])[:5]
    return bad
