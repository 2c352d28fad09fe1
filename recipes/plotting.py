"""A PNG of a run's reward and response length per step, from the CSV log (matplotlib, Agg backend).

::

    plot_training_curves("outputs/grpo/lightning_logs/version_0/metrics.csv")
    # -> outputs/grpo/lightning_logs/version_0/metrics.png

The CSV is Lightning's ``CSVLogger`` file: a ``step`` column and one column per metric, empty where a
metric was not logged at that step (validation metrics appear only on validation steps).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["plot_training_curves", "read_metrics_csv"]

Series = dict[str, list[tuple[int, float]]]


def read_metrics_csv(path: str | os.PathLike) -> Series:
    """Each metric's ``(step, value)`` points, in file order (empty cells skipped).

    Args:
        path: A ``metrics.csv`` with a ``step`` column.

    Returns:
        ``{metric: [(step, value), ...]}``.
    """
    series: Series = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step_text = row.pop("step", "")
            if not step_text:
                continue
            step = int(float(step_text))
            for key, text in row.items():
                if text in ("", None):
                    continue
                try:
                    value = float(text)
                except ValueError:
                    continue
                if math.isfinite(value):
                    series.setdefault(key, []).append((step, value))
    return series


def _last_per_step(points: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    """One value per step (the last logged), sorted by step."""
    by_step = dict(points)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_training_curves(
    csv_path: str | os.PathLike,
    out_path: str | os.PathLike | None = None,
    reward_keys: Sequence[str] = ("reward/mean",),
    val_reward_keys: Sequence[str] = ("val/reward/mean",),
    length_keys: Sequence[str] = ("response_length/mean",),
    title: str | None = None,
) -> Path:
    """Write a two-panel PNG: reward (train per step, validation points) and response length per step.

    Args:
        csv_path: The run's ``metrics.csv``.
        out_path: The PNG; default ``metrics.png`` next to the CSV.
        reward_keys: Training reward metrics (one line each, where present).
        val_reward_keys: Validation reward metrics (markers).
        length_keys: Response-length metrics.
        title: Figure title (default: the CSV's directory).

    Returns:
        The PNG path.

    Raises:
        ValueError: None of the requested metrics is in the CSV.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    csv_path = Path(csv_path)
    out = Path(out_path) if out_path is not None else csv_path.with_name("metrics.png")
    series = read_metrics_csv(csv_path)
    wanted = [*reward_keys, *val_reward_keys, *length_keys]
    if not any(k in series for k in wanted):
        raise ValueError(f"{csv_path} has none of the metrics {wanted}; it has {sorted(series)}")

    fig, (ax_reward, ax_len) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for key in reward_keys:
        if key in series:
            ax_reward.plot(*_last_per_step(series[key]), label=f"train {key}", linewidth=1.2)
    for key in val_reward_keys:
        if key in series:
            ax_reward.plot(*_last_per_step(series[key]), "o--", label=key, markersize=5)
    ax_reward.set_ylabel("reward")
    ax_reward.grid(alpha=0.3)
    ax_reward.legend(loc="lower right", fontsize=8)
    for key in length_keys:
        if key in series:
            ax_len.plot(*_last_per_step(series[key]), label=key, color="tab:green", linewidth=1.2)
    ax_len.set_ylabel("response length (tokens)")
    ax_len.set_xlabel("step")
    ax_len.grid(alpha=0.3)
    ax_len.legend(loc="upper right", fontsize=8)
    fig.suptitle(title or str(csv_path.parent))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
