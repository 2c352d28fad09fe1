"""SFT data formats: multi-turn chats (loss on assistant turns only), column names, HF-style dict batches at
the boundary, joined batches (accumulate_grad_batches) and iterable datasets sharded over real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from verl_trainer.data.hf_batch import from_hf_batch, to_schema_batch
from verl_trainer.data.packing import make_batch
from verl_trainer.data.schema import BatchSchemaError, concat_batches
from verl_trainer.data.sft import IterableSFTDataset, SFTDataset, TokenMask, encode_chat_example
from verl_trainer.data.sharded_stream import IterableShardedLoader
from verl_trainer.models.tiny import build_tokenizer
from verl_trainer.testing.ranks import run_distributed

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"}, {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _trained(tok, batch, i: int) -> str:
    return tok.decode(batch["input_ids"][i][batch["loss_mask"][i].bool()])


def test_chat_trains_assistant_turns_only(tok):
    ds = SFTDataset([{"conv": CHAT}, {"q": "a", "a": "bc"}], tok, messages_key="conv", prompt_key="q",
                    response_key="a")
    assert isinstance(ds[0], TokenMask)
    batch = ds.collate([ds[0], ds[1]])
    full = tok.decode(batch["input_ids"][0][: int(batch["seq_len"][0])])
    assert full == "system: be brief\nuser: hi\nassistant: yo\nuser: 2+2\nassistant: 4\n"
    assert _trained(tok, batch, 0) == "yo\n4\n"  # the content and end of turn, no role header, no user text
    assert _trained(tok, batch, 1) == "bc<eos>"
    assert batch["loss_mask"][:, 0].sum() == 0


@pytest.mark.parametrize(("rows", "kwargs", "match"), [
    ([{"x": 1}], {}, "needs 'prompt' and 'response' \\(or 'completion'\\) columns, a 'messages' column.*"
                      "it has \\['x'\\]"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], {}, "no assistant turn"),
    ([{"messages": [{"role": "user"}]}], {}, "message 0 must be a mapping with 'role' and 'content'"),
    ([{"messages": CHAT}], {"max_length": 10}, "tokens > max_length=10"),
])
def test_sft_row_errors(tok, rows, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SFTDataset(rows, tok, **kwargs)


def test_chat_needs_a_prefix_stable_template(tok):
    class Rewriting:  # renders the last assistant turn differently from earlier ones
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return "|".join(m["content"] for m in messages[::-1]) + ("|" if add_generation_prompt else "")

        def encode(self, text, add_special_tokens):
            return tok.encode(text, add_special_tokens=False)

    with pytest.raises(ValueError, match="does not render the conversation up to turn 2 as a prefix"):
        encode_chat_example(Rewriting(), CHAT)


def test_hf_batch_becomes_schema():
    hf = {"input_ids": torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]]),
          "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
          "labels": torch.tensor([[-100, -100, -100, 6, 7], [-100, -100, 7, 8, 9]])}
    b = to_schema_batch(hf)
    assert b["input_ids"].tolist() == [[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]]  # left padding undone
    assert b["loss_mask"].tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]]
    assert b["seq_len"].tolist() == [3, 5] and b["uid"].tolist() == [0, 1]
    no_labels = from_hf_batch({"input_ids": [[4, 5, 6]]})
    assert no_labels["loss_mask"].tolist() == [[0, 1, 1]]
    td = make_batch([[1]], [[2]])
    assert to_schema_batch(td) is td


@pytest.mark.parametrize(("batch", "match"), [
    ({"text": ["hi"]}, "a dict batch needs 'input_ids'.*\\['text'\\]"),
    ({"input_ids": torch.tensor([[4, 5, 6]]), "labels": torch.tensor([[-100, 6, 7]])}, "pre-shifted"),
    ({"input_ids": torch.tensor([[4, 5, 6]]), "attention_mask": torch.tensor([[1, 0, 1]])}, "has holes"),
    ({"input_ids": torch.tensor([4, 5, 6])}, "must be \\[B, T\\]"),
])
def test_hf_batch_errors(batch, match):
    with pytest.raises(BatchSchemaError, match=match):
        to_schema_batch(batch)


def test_concat_batches_pads_and_keeps_groups_apart():
    a, b = make_batch([[1, 2]], [[3, 4, 5]]), make_batch([[1], [2]], [[3], [4]])
    c = concat_batches([a, b])
    assert c["input_ids"].tolist() == [[1, 2, 3, 4, 5], [1, 3, 0, 0, 0], [2, 4, 0, 0, 0]]
    assert c["loss_mask"][1:].sum() == 2 and c["uid"].tolist() == [0, 1, 2]
    with pytest.raises(BatchSchemaError, match="different keys"):
        concat_batches([a, b.exclude("uid")])


def _stream_rank(n_rows: int, batch_size: int) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [([4 + i], [5 + i]) for i in range(n_rows)]
    ds = IterableSFTDataset(rows)
    loader = IterableShardedLoader(DataLoader(ds, batch_size=batch_size, collate_fn=ds.collate), rank, world)
    seen = []
    for batch in loader.epoch_batches():
        seen.append(batch["input_ids"][:, 0].tolist())
        loader.advance()
        dist.all_reduce(torch.ones(1))  # a step's collective: a rank left waiting here would hang
    state = loader.state_dict()
    loader.next_epoch()
    loader.load_state_dict({"epoch": 1, "samples": batch_size * world})  # resume after one batch
    resumed = [b["input_ids"][:, 0].tolist() for b in loader.epoch_batches()]
    return {"seen": seen, "ended": loader.exhausted(), "state": state, "resumed": resumed}


@pytest.mark.slow  # two spawned ranks: ~60 s on the shared 2-core machine
def test_iterable_sft_is_sharded_and_ends_together_on_two_ranks():
    # 13 rows, batch 2: rank 0 reads rows 0, 2, .., 12 (4 batches, the last short), rank 1 rows 1, .., 11
    # (3 batches): both stop after 3, the uneven tail is dropped, nobody waits in a collective.
    r0, r1 = run_distributed(_stream_rank, 2, 13, 2, timeout=120)
    assert r0["seen"] == [[4, 6], [8, 10], [12, 14]] and r1["seen"] == [[5, 7], [9, 11], [13, 15]]
    assert r0["ended"] and r1["ended"] and r0["state"] == {"epoch": 0, "samples": 12}
    assert r0["resumed"] == [[8, 10], [12, 14]] and r1["resumed"] == [[9, 11], [13, 15]]


def test_iterable_limits():
    ds = IterableSFTDataset([([4], [5])] * 10)
    with pytest.raises(ValueError, match="fractional batch limit"):
        IterableShardedLoader(DataLoader(ds, batch_size=2, collate_fn=ds.collate), 0, 1, limit=0.5)
    loader = IterableShardedLoader(DataLoader(ds, batch_size=2, collate_fn=ds.collate), 0, 1, limit=2)
    got = 0
    for _ in loader.epoch_batches():
        loader.advance()
        got += 1
    assert got == 2 and loader.exhausted()
