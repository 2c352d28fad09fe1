"""Ulysses communication primitives: padding/slicing, the all-to-alls and the output gather (+ backward)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from verl_trainer.models.ulysses import (
    SeqAllToAll,
    all_to_all_tensor,
    gather_heads_scatter_seq,
    gather_outputs_and_unpad,
    gather_seq_scatter_heads,
    get_ulysses_sequence_parallel_group,
    get_ulysses_sequence_parallel_rank,
    get_ulysses_sequence_parallel_world_size,
    set_ulysses_sequence_parallel_group,
    slice_input_tensor,
    ulysses_pad,
    ulysses_pad_and_slice_inputs,
    ulysses_sequence_parallel_group,
)
from verl_trainer.testing import run_distributed


def test_ulysses_pad_odd_total_gets_its_own_segment():
    ids = torch.arange(1, 8)[None]  # N = 7
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    out_ids, out_pos, pad = ulysses_pad(ids, pos, sp_size=2)
    assert pad == 1 and out_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]
    assert out_pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]  # the padding restarts at 0
    out_ids, out_pos, pad = ulysses_pad(ids, pos, sp_size=4)
    assert pad == 1 and out_pos[0, -1] == 0
    out_ids, out_pos, pad = ulysses_pad(ids[:, :5], pos[:, :5], sp_size=4)
    assert pad == 3 and out_pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]] and out_ids.shape == (1, 8)
    assert ulysses_pad(ids, pos, sp_size=1) == (ids, pos, 0)
    assert ulysses_pad(ids[:, :6], None, sp_size=2)[1:] == (None, 0)


def test_ulysses_pad_multi_axis_positions_and_shape_errors():
    ids, pos = torch.arange(5)[None], torch.arange(5).expand(3, 1, 5)  # [C, 1, N] (multi-axis rotary)
    _, out_pos, pad = ulysses_pad(ids, pos, sp_size=2)
    assert pad == 1 and out_pos.shape == (3, 1, 6) and (out_pos[..., -1] == 0).all()
    with pytest.raises(ValueError, match="must be"):
        ulysses_pad(ids, torch.arange(4)[None], sp_size=2)


def test_without_group_everything_is_the_identity():
    assert get_ulysses_sequence_parallel_group() is None
    assert get_ulysses_sequence_parallel_world_size() == 1 and get_ulysses_sequence_parallel_rank() == 0
    x = torch.randn(1, 4, 6, 3)
    assert gather_seq_scatter_heads(x, seq_dim=2, head_dim=1) is x
    assert gather_heads_scatter_seq(x, head_dim=1, seq_dim=2) is x
    assert gather_outputs_and_unpad(x, gather_dim=2, unpad_dim=2, padding_size=1) is x
    assert slice_input_tensor(x, dim=2) is x and all_to_all_tensor(x, 1, 2) is x
    ids, pos, pad = ulysses_pad_and_slice_inputs(torch.arange(5)[None], torch.arange(5)[None], sp_size=1)
    assert ids.shape == (1, 5) and pad == 0
    with pytest.raises(ValueError, match="sp_size=2 but the current Ulysses SP group has 1"):
        ulysses_pad_and_slice_inputs(torch.arange(5)[None], sp_size=2)


def test_group_context_restores_the_previous_group():
    sentinel = object()
    set_ulysses_sequence_parallel_group(sentinel)  # type: ignore[arg-type]
    try:
        with ulysses_sequence_parallel_group(None):
            assert get_ulysses_sequence_parallel_group() is None
        assert get_ulysses_sequence_parallel_group() is sentinel
    finally:
        set_ulysses_sequence_parallel_group(None)


def _primitives() -> None:
    rank, sp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    full = torch.randn(1, 4, 6, 3, generator=g)  # [1, H, N, D], the same on every rank
    weight = torch.randn(1, 4, 6, 3, generator=g)
    h, n = 4 // sp, 6 // sp

    # gather_seq_scatter_heads: [1, H, N/sp, D] -> [1, H/sp, N, D]; backward = mirror all-to-all.
    local = full[:, :, rank * n:(rank + 1) * n].clone().requires_grad_()
    out = gather_seq_scatter_heads(local, seq_dim=2, head_dim=1, group=group)
    assert torch.equal(out, full[:, rank * h:(rank + 1) * h])
    (out * weight[:, rank * h:(rank + 1) * h]).sum().backward()  # summed over ranks: (full * weight).sum()
    assert torch.equal(local.grad, weight[:, :, rank * n:(rank + 1) * n])

    # gather_heads_scatter_seq is its inverse (values and gradients).
    heads = full[:, rank * h:(rank + 1) * h].clone().requires_grad_()
    back = gather_heads_scatter_seq(heads, head_dim=1, seq_dim=2, group=group)
    assert torch.equal(back, full[:, :, rank * n:(rank + 1) * n])
    (back * weight[:, :, rank * n:(rank + 1) * n]).sum().backward()
    assert torch.equal(heads.grad, weight[:, rank * h:(rank + 1) * h])

    # The SeqAllToAll function itself, on the [1, N/sp, H, D] layout.
    bshd = full.transpose(1, 2)[:, rank * n:(rank + 1) * n]
    expected = full.transpose(1, 2)[:, :, rank * h:(rank + 1) * h]
    assert torch.equal(SeqAllToAll.apply(group, bshd, 2, 1), expected)

    # An odd sequence (5 tokens): gather_heads_scatter_seq pads, gather_seq_scatter_heads unpads.
    odd = full[:, rank * h:(rank + 1) * h, :5]
    sliced = gather_heads_scatter_seq(odd, head_dim=1, seq_dim=2, group=group)  # [1, H, 3, D]
    assert sliced.shape == (1, 4, 3, 3)
    again = gather_seq_scatter_heads(sliced, seq_dim=2, head_dim=1, unpadded_dim_size=5, group=group)
    assert torch.equal(again, odd)
    with pytest.raises(ValueError, match="not divisible by the sequence-parallel size"):
        all_to_all_tensor(full[:, :3], scatter_dim=1, gather_dim=2, group=group)

    # gather_outputs_and_unpad: forward gathers and unpads; backward keeps this rank's slice (x sp).
    for scaler, factor in ((True, sp), (False, 1)):
        lp = torch.randn(6, generator=torch.Generator().manual_seed(1))
        mine = lp[rank * n:(rank + 1) * n].clone().requires_grad_()
        gathered = gather_outputs_and_unpad(mine, gather_dim=0, unpad_dim=0, padding_size=1,
                                            grad_scaler=scaler, group=group)
        assert torch.equal(gathered, lp[:5])
        (gathered * weight.reshape(-1)[:5]).sum().backward()
        expected = torch.cat([weight.reshape(-1)[:5], torch.zeros(1)])[rank * n:(rank + 1) * n] * factor
        assert torch.equal(mine.grad, expected)

    # ulysses_pad_and_slice_inputs with the process-wide group.
    with ulysses_sequence_parallel_group(group):
        assert get_ulysses_sequence_parallel_world_size() == sp
        assert get_ulysses_sequence_parallel_rank() == rank
        ids, pos, pad = ulysses_pad_and_slice_inputs(torch.arange(1, 8)[None], torch.arange(7)[None], sp)
        assert pad == (sp - 7 % sp) % sp and ids.shape == (1, (7 + pad) // sp)
        padded_ids = torch.cat([torch.arange(1, 8), torch.zeros(pad, dtype=torch.long)])
        padded_pos = torch.cat([torch.arange(7), torch.arange(pad)])
        assert torch.equal(ids[0], padded_ids.chunk(sp)[rank])
        assert torch.equal(pos[0], padded_pos.chunk(sp)[rank])
        _, whole_pos, _ = ulysses_pad_and_slice_inputs(torch.arange(7)[None], torch.arange(7)[None], sp,
                                                       skip_position_ids_rmpad=True)
        assert whole_pos.shape == (1, 7 + pad)
        zero_padded = torch.cat([torch.arange(7), torch.zeros(pad, dtype=torch.long)])
        assert torch.equal(slice_input_tensor(torch.arange(7)[None], dim=1)[0], zero_padded.chunk(sp)[rank])
        with pytest.raises(ValueError, match="cannot slice"):
            slice_input_tensor(torch.arange(7)[None], dim=1, padding=False)
    assert get_ulysses_sequence_parallel_group() is None


def test_primitives_on_2_ranks():
    run_distributed(_primitives, 2)
