"""Images in a batch: per-sample padded vision fields and the model inputs gathered from them.

A vision-language model takes ``pixel_values`` ``[N, D]`` (the patch rows of every image of the forward,
concatenated in sample and image order) and ``image_grid_thw`` ``[num_images, 3]``. A batch stores them per
sample (``schema.PIXEL_VALUES`` ``[B, P, D]``, ``schema.IMAGE_GRID_THW`` ``[B, I, 3]``,
zero-padded) so that indexing, balancing and micro-batching move a sample's images with it;
:func:`pad_vision` builds the per-sample form and :func:`model_vision_inputs` gives the model's form back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict

from verl_trainer.data import schema


def pad_vision(
    pixel_values: Sequence[torch.Tensor], image_grid_thw: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Per-sample vision fields from each sample's own tensors.

    Args:
        pixel_values: one ``[n_i, D]`` tensor per sample (``n_i`` may be 0: a sample without images).
        image_grid_thw: one ``[I_i, 3]`` long tensor per sample, ``sum(prod(row)) == n_i``.

    Returns:
        ``{PIXEL_VALUES: [B, P, D], IMAGE_GRID_THW: [B, I, 3]}``, zero-padded (``P, I >= 1``).

    Raises:
        ValueError: a sample's grid does not count its patch rows, or the lists differ in length or ``D``.
    """
    if len(pixel_values) != len(image_grid_thw):
        raise ValueError(
            f"{len(pixel_values)} pixel tensors for {len(image_grid_thw)} grids: one of each per sample"
        )
    dims = {int(p.shape[-1]) for p in pixel_values if p.numel()}
    if len(dims) > 1:
        raise ValueError(f"patch rows of different widths {sorted(dims)} in one batch")
    width = dims.pop() if dims else 1
    rows = max([int(p.shape[0]) for p in pixel_values] + [1])
    images = max([int(g.shape[0]) for g in image_grid_thw] + [1])
    pixels = torch.zeros(len(pixel_values), rows, width, dtype=torch.float32)
    grids = torch.zeros(len(pixel_values), images, 3, dtype=torch.long)
    for i, (p, g) in enumerate(zip(pixel_values, image_grid_thw, strict=True)):
        g = g.reshape(-1, 3).to(torch.long)
        if int(g.prod(-1).sum()) != p.shape[0]:
            raise ValueError(
                f"sample {i}: image_grid_thw {g.tolist()} counts {int(g.prod(-1).sum())} patch rows, "
                f"pixel_values has {p.shape[0]}"
            )
        pixels[i, : p.shape[0]] = p
        grids[i, : g.shape[0]] = g
    return {schema.PIXEL_VALUES: pixels, schema.IMAGE_GRID_THW: grids}


def sample_images(batch: TensorDict) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Each sample's own images: ``(pixel_values [n_i, D], image_grid_thw [I_i, 3])`` (zero rows dropped).

    Returns ``None`` when the batch carries no vision fields.

    Raises:
        schema.BatchSchemaError: one of the two vision fields is missing.
    """
    keys = batch.keys()
    if (schema.PIXEL_VALUES in keys) != (schema.IMAGE_GRID_THW in keys):
        raise schema.BatchSchemaError(
            f"a batch with images needs both {schema.PIXEL_VALUES!r} and {schema.IMAGE_GRID_THW!r}; it has "
            "only one (build them together with data.vision.pad_vision)"
        )
    if schema.PIXEL_VALUES not in keys:
        return None
    grids = batch[schema.IMAGE_GRID_THW]
    return [(batch[schema.PIXEL_VALUES][i, : int(n)], grids[i][grids[i].prod(-1) > 0])
            for i, n in enumerate(schema.patch_counts(grids).tolist())]


def model_vision_inputs(batch: TensorDict) -> dict[str, torch.Tensor]:
    """The model's ``pixel_values`` ``[N, D]`` and ``image_grid_thw`` ``[num_images, 3]`` of the rows.

    Returns ``{}`` when the batch carries no images at all.

    Raises:
        schema.BatchSchemaError: one of the two vision fields is missing.
    """
    images = sample_images(batch)
    if not images or all(g.shape[0] == 0 for _, g in images):
        return {}
    return {"pixel_values": torch.cat([p for p, _ in images]),
            "image_grid_thw": torch.cat([g for _, g in images])}
