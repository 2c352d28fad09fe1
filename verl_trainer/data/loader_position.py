"""Where a sharded loader stands in its data: epoch and batches consumed, as a checkpointable position.

The position is saved as globally consumed samples, so a run can resume it with another DP size as long
as the samples divide into whole steps. :class:`~verl_trainer.data.sharded_loader.ShardedLoader`
(map-style) and :class:`~verl_trainer.data.sharded_stream.IterableShardedLoader` (streams) share it.
"""

from __future__ import annotations

__all__ = ["LoaderPosition", "limited_batches"]


class LoaderPosition:
    """Epoch and batches consumed this epoch (on this rank) of a loader with ``batch_size`` and ``dp_size``.

    Attributes:
        batch_size: Samples per batch on one rank (``None``: a dataset of ready batches).
        dp_size: Data-parallel size.
        epoch: The current epoch.
        batches: Batches of the current epoch consumed on this rank.
    """

    batch_size: int | None
    dp_size: int
    epoch: int = 0
    batches: int = 0

    @property
    def samples_per_batch(self) -> int:
        """Samples one rank consumes per batch (1 for a dataset of ready batches)."""
        return self.batch_size or 1

    def advance(self) -> None:
        """Count one consumed batch."""
        self.batches += 1

    def next_epoch(self) -> None:
        """Move to the start of the next epoch."""
        self.epoch += 1
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        """The position, as globally consumed samples so another DP size can resume it."""
        return {"epoch": self.epoch, "samples": self.batches * self.samples_per_batch * self.dp_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the position of :meth:`state_dict`.

        Raises:
            ValueError: The consumed samples are not a whole number of steps at this batch and DP size.
        """
        per_step = self.samples_per_batch * self.dp_size
        if state["samples"] % per_step:
            raise ValueError(
                f"cannot resume the data position: {state['samples']} samples consumed is not a multiple of "
                f"{per_step} (batch size x DP size); resume with the settings the checkpoint was written with"
            )
        self.epoch = int(state["epoch"])
        self.batches = int(state["samples"]) // per_step


def limited_batches(total: int | None, limit: int | float | None) -> int | None:
    """The number of batches to run out of ``total`` under ``limit`` (``None``: all ``total``).

    A fraction of a loader with an unknown length (an iterable dataset) is an error; a fraction that
    rounds to 0 batches of a non-empty loader runs 1.

    Raises:
        ValueError: A fraction of a loader of unknown length.
    """
    if limit is None:
        return total
    if isinstance(limit, int) and not isinstance(limit, bool):
        return limit if total is None else min(limit, total)
    if total is None:
        raise ValueError(
            f"a fractional batch limit ({limit}) needs a loader with a length; this one (an iterable "
            "dataset) has none: give an int number of batches"
        )
    return max(1, int(total * limit)) if total and limit > 0 else 0
