"""Per-sample vision fields: padding, indexing with the samples, and the model's concatenated form back."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from verl_trainer.data import schema
from verl_trainer.data.vision import model_vision_inputs, pad_vision


def _sample(grids: list[list[int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    return torch.randn(int(g.prod(-1).sum()), 6, generator=torch.Generator().manual_seed(seed)), g


def test_round_trip_through_indexing():
    samples = [_sample([[1, 2, 2]], 0), _sample([], 1), _sample([[1, 2, 4], [1, 2, 2]], 2)]
    fields = pad_vision([p for p, _ in samples], [g for _, g in samples])
    assert fields[schema.PIXEL_VALUES].shape == (3, 12, 6)
    assert fields[schema.IMAGE_GRID_THW].shape == (3, 2, 3)
    assert schema.patch_counts(fields[schema.IMAGE_GRID_THW]).tolist() == [4, 0, 12]
    batch = TensorDict(fields, batch_size=[3])
    picked = batch[torch.tensor([2, 0])]  # balancing / micro-batching select rows like this
    inputs = model_vision_inputs(picked)
    assert torch.equal(inputs["pixel_values"], torch.cat([samples[2][0], samples[0][0]]))
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 4], [1, 2, 2], [1, 2, 2]]
    assert model_vision_inputs(batch[torch.tensor([1])]) == {}


def test_errors_name_the_sample():
    pixels, grid = _sample([[1, 2, 2]], 0)
    with pytest.raises(ValueError, match="sample 0: image_grid_thw"):
        pad_vision([pixels[:3]], [grid])
    with pytest.raises(schema.BatchSchemaError, match="needs both"):
        model_vision_inputs(TensorDict({schema.PIXEL_VALUES: torch.zeros(1, 1, 6)}, batch_size=[1]))
