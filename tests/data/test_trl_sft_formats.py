"""TRL's SFT dataset formats, standard and conversational, through the recipes' SFT data path (issue 29 item
3): what is trained is the text or the chat template's rendering, never a Python repr; other shapes are
refused naming the row and the formats."""

from __future__ import annotations

import json

import pytest

from verl_trainer.algorithms.data import DataConfig, SFTDataModule
from verl_trainer.data.sft import SFTDataset
from verl_trainer.models.tiny import build_tokenizer

PROMPT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"}]
COMPLETION = [{"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _texts(tok, ds: SFTDataset) -> list[tuple[str, str]]:
    """(whole example, trained tokens) per row."""
    batch = ds.collate(list(ds))
    out = []
    for i in range(len(ds)):
        n = int(batch["seq_len"][i])
        out.append((tok.decode(batch["input_ids"][i][:n]),
                    tok.decode(batch["input_ids"][i][batch["loss_mask"][i].bool()])))
    return out


def test_trl_formats_from_a_jsonl_file_as_the_sft_recipe_reads_it(tok, tmp_path):
    rows = [
        {"text": "2+2=4"},                                                 # language modelling, standard
        {"messages": [*PROMPT, *COMPLETION]},                             # language modelling, conversational
        {"prompt": "2+2=", "completion": "4"},                            # prompt-completion, standard
        {"prompt": PROMPT, "completion": COMPLETION},                     # prompt-completion, conversational
    ]
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = SFTDataModule(DataConfig(train_files=str(path), train_batch_size=4, max_length=64), tok)
    data.check(dp_size=1)
    (text, t_text), (chat, t_chat), (pair, t_pair), (conv, t_conv) = _texts(tok, data._train)
    assert (text, t_text) == ("2+2=4<eos>", "+2=4<eos>")  # every token (position 0 predicts nothing)
    rendered = "system: be brief\nuser: 2+2\nassistant: 4\n"  # the tiny tokenizer's chat template
    assert (chat, t_chat) == (rendered, "4\n")
    assert (pair, t_pair) == ("2+2=4<eos>", "4<eos>")
    assert (conv, t_conv) == (rendered, "4\n")  # the completion only, no assistant header
    assert all("{'role'" not in t and "[{" not in t for t, _ in _texts(tok, data._train))


def test_a_datasets_dataset_is_read_as_its_rows(tok):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": PROMPT, "completion": COMPLETION}] * 2)
    assert _texts(tok, SFTDataset(ds, tok))[0][1] == "4\n"


@pytest.mark.parametrize(("row", "match"), [
    ({"prompt": "2+2=", "completion": COMPLETION},
     r"SFT row 0: 'prompt' is str and 'completion' is list: give both as text \(standard\) or both as "
     r"message"),
    ({"prompt": PROMPT, "completion": {"role": "assistant"}}, r"'completion' is dict"),
    ({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, r"preference data \(chosen/rejected\) is for"),
    ({"prompt": "2+2="}, r"a prompt-only row has nothing to train on \(it is RL data\)"),
    ({"question": "2+2="}, r"needs 'prompt' and 'response' \(or 'completion'\) columns, a 'messages' column "
                           r"\(a chat\) or a 'text' column; it has \['question'\]"),
    ({"prompt": PROMPT, "completion": []}, r"the completion is an empty message list"),
], ids=["mixed", "dict-completion", "preference", "prompt-only", "unknown", "empty-completion"])
def test_other_shapes_are_refused_naming_the_row(tok, row, match):
    with pytest.raises(ValueError, match=match):
        SFTDataset([row], tok)
