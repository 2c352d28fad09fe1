import pytest
import torch
from tensordict import TensorDict

from verl_trainer.data import schema
from verl_trainer.data.packing import (
    PackedBatch,
    jagged_to_padded,
    make_batch,
    next_token_log_probs_and_entropy,
    pack_batch,
    padded_to_jagged,
    position_ids_from_cu_seqlens,
    seq_lens_to_cu_seqlens,
    unpack_to_padded,
)
from verl_trainer.data.schema import sequence_lengths

# prompt + response pairs covering: an empty response, a length-1 sequence, a long one.
PROMPTS = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
RESPONSES = [[20, 21], [], [22, 23, 24, 25, 26], [27]]


@pytest.fixture
def batch() -> TensorDict:
    return make_batch(PROMPTS, RESPONSES, uids=[0, 0, 1, 1], width=10)


def test_make_batch_follows_schema(batch):
    assert batch.batch_size == torch.Size([4])
    assert batch[schema.INPUT_IDS].shape == (4, 10)
    assert batch[schema.SEQ_LEN].tolist() == [5, 1, 7, 5]
    assert batch[schema.PROMPT_LEN].tolist() == [3, 1, 2, 4]
    assert batch[schema.RESPONSE_LEN].tolist() == [2, 0, 5, 1]
    assert batch[schema.UID].tolist() == [0, 0, 1, 1]
    assert not batch[schema.IS_PADDING].any()
    assert batch[schema.INPUT_IDS][0].tolist() == [5, 6, 7, 20, 21, 0, 0, 0, 0, 0]
    assert batch[schema.ATTENTION_MASK].sum(-1).tolist() == [5, 1, 7, 5]
    assert batch[schema.POSITION_IDS][2].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 0, 0]
    assert batch[schema.LOSS_MASK][0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0]
    assert batch[schema.LOSS_MASK][1].sum() == 0  # empty response: zero-length loss mask
    assert batch[schema.LOSS_MASK].dtype == torch.float32
    assert torch.equal(batch[schema.RESPONSE_MASK], batch[schema.LOSS_MASK])


def test_make_batch_default_width_and_uids():
    b = make_batch(PROMPTS, RESPONSES)
    assert b[schema.INPUT_IDS].shape == (4, 7)
    assert b[schema.UID].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="width"):
        make_batch(PROMPTS, RESPONSES, width=3)
    with pytest.raises(ValueError, match="responses"):
        make_batch(PROMPTS, RESPONSES[:2])


def test_cu_seqlens_and_positions():
    cu = seq_lens_to_cu_seqlens(torch.tensor([2, 0, 3]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 2, 5]
    assert position_ids_from_cu_seqlens(cu).tolist() == [[0, 1, 0, 1, 2]]


def test_pack_batch(batch):
    packed = pack_batch(batch)
    assert isinstance(packed, PackedBatch)
    n = 5 + 1 + 7 + 5
    assert packed.input_ids.shape == (1, n) and packed.num_tokens == n and packed.batch_size == 4
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 5, 6, 13, 18]
    assert packed.max_seqlen == 7 and packed.width == 10
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]]
    expected_ids = [t for p, r in zip(PROMPTS, RESPONSES) for t in (*p, *r)]
    assert packed.input_ids[0].tolist() == expected_ids
    assert set(packed.fields) == {schema.LOSS_MASK, schema.RESPONSE_MASK}
    loss_mask = [0, 0, 0, 1, 1] + [0] + [0, 0, 1, 1, 1, 1, 1] + [0, 0, 0, 0, 1]
    assert packed.fields[schema.LOSS_MASK][0].tolist() == loss_mask
    only = pack_batch(batch, keys=[schema.LOSS_MASK])
    assert set(only.fields) == {schema.LOSS_MASK}


def test_seq_lens_from_attention_mask_when_no_seq_len(batch):
    del batch[schema.SEQ_LEN]
    assert sequence_lengths(batch).tolist() == [5, 1, 7, 5]
    assert pack_batch(batch).cu_seqlens.tolist() == [0, 5, 6, 13, 18]


def test_pack_rejects_misaligned_field(batch):
    batch["values"] = torch.zeros(4, 9)
    with pytest.raises(ValueError, match="aligned with input_ids"):
        pack_batch(batch, keys=["values"])


@pytest.mark.parametrize("key", [schema.INPUT_IDS, schema.LOSS_MASK, schema.POSITION_IDS])
def test_round_trip_padded_packed(batch, key):
    packed = pack_batch(batch, keys=[key])
    back = packed.unpack(packed.fields[key])
    assert torch.equal(back, batch[key])
    assert torch.equal(unpack_to_padded(packed.fields[key][0], packed.cu_seqlens, 10), batch[key])


def test_round_trip_padded_jagged_packed(batch):
    ids, lens = batch[schema.INPUT_IDS], batch[schema.SEQ_LEN]
    nt = padded_to_jagged(ids, lens)
    assert nt.is_nested and nt.layout == torch.jagged
    assert nt.offsets().tolist() == [0, 5, 6, 13, 18]
    assert torch.equal(nt.values(), pack_batch(batch).input_ids[0])
    assert torch.equal(jagged_to_padded(nt, width=10), ids)
    assert torch.equal(jagged_to_padded(nt), ids[:, :7])
    assert torch.equal(nt[2], ids[2, :7])


def test_trailing_dims_and_pad_value():
    x = torch.randn(3, 6, 2, 4)
    lens = torch.tensor([1, 6, 0])
    nt = padded_to_jagged(x, lens)
    out = jagged_to_padded(nt, width=6, pad_value=-1.0)
    assert out.shape == x.shape
    assert torch.equal(out[0, :1], x[0, :1]) and (out[0, 1:] == -1).all()
    assert torch.equal(out[1], x[1])
    assert (out[2] == -1).all()


def test_unpack_errors():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens describes 5"):
        unpack_to_padded(torch.zeros(1, 4), cu, 5)
    with pytest.raises(ValueError, match="exceeds the padded width"):
        unpack_to_padded(torch.zeros(5), cu, 2)


def test_packed_log_probs_next_token_convention(batch):
    packed = pack_batch(batch)
    v = 30
    logits = torch.randn(1, packed.num_tokens, v)
    lp, ent = next_token_log_probs_and_entropy(logits, packed.input_ids, packed.cu_seqlens)
    assert lp.shape == (packed.num_tokens,) and ent is None
    padded = packed.unpack(lp)  # [B, T], schema convention
    for i, length in enumerate(batch[schema.SEQ_LEN].tolist()):
        start = int(packed.cu_seqlens[i])
        ids = batch[schema.INPUT_IDS][i]
        assert padded[i, 0] == 0
        for t in range(1, length):
            expected = torch.log_softmax(logits[0, start + t - 1], -1)[ids[t]]
            torch.testing.assert_close(padded[i, t], expected)
        assert (padded[i, length:] == 0).all()
    lp_t, ent_t = next_token_log_probs_and_entropy(
        logits, packed.input_ids, packed.cu_seqlens, temperature=2.0, calculate_entropy=True
    )
    expected = torch.log_softmax(logits[0, 0] / 2.0, -1)[packed.input_ids[0, 1]]
    torch.testing.assert_close(lp_t[1], expected)
    p = torch.softmax(logits[0, 0] / 2.0, -1)
    torch.testing.assert_close(ent_t[1], -(p * p.log()).sum())
    assert ent_t[0] == 0


def test_packed_batch_to(batch):
    packed = pack_batch(batch).to("cpu")
    assert packed.cu_seqlens.device.type == "cpu" and packed.max_seqlen == 7
