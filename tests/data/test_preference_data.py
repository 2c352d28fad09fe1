"""Preference data formats, their batches and their errors; the loss's config and pair errors."""

from __future__ import annotations

import pytest
import torch

from verl_trainer.core_algos.preference import PreferenceLossConfig, preference_loss
from verl_trainer.data import schema
from verl_trainer.data.preference import PreferenceDataset, extract_prompt
from verl_trainer.data.prompts import save_rows
from verl_trainer.models.tiny import CHAT_TEMPLATE, build_tokenizer


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_explicit_implicit_and_verl_layouts_encode_to_the_same_pair(tok, tmp_path):
    eos = [tok.eos_token_id]
    explicit = PreferenceDataset([{"prompt": "3+4=", "chosen": "7", "rejected": "8"}], tok)
    implicit = PreferenceDataset([{"chosen": "3+4=7", "rejected": "3+4=8"}], tok)
    assert explicit.examples == implicit.examples
    assert explicit.examples[0] == (_ids(tok, "3+4="), _ids(tok, "7") + eos, _ids(tok, "8") + eos)
    row = {"prompt": [{"role": "user", "content": "3+4="}], "chosen": "7", "rejected": "8",
           "data_source": "arith", "reward_model": {"ground_truth": "7"}}
    path = save_rows([row], tmp_path / "p.parquet")
    verl = PreferenceDataset(path, tok).examples[0]  # chat-list prompt through the template
    assert verl.prompt_ids == tok.encode("user: 3+4=\nassistant: ", add_special_tokens=False)
    assert verl.chosen_ids == _ids(tok, "7") + eos


def test_conversational_pairs_train_on_the_assistant_turn_only(tok):
    row = {"prompt": [{"role": "user", "content": "3+4="}], "chosen": [{"role": "assistant", "content": "7"}],
           "rejected": [{"role": "assistant", "content": "9"}]}
    ex = PreferenceDataset([row], tok).examples[0]
    assert ex.prompt_ids == _ids(tok, "user: 3+4=\nassistant: ")
    assert ex.chosen_ids == _ids(tok, "7\n") and ex.rejected_ids == _ids(tok, "9\n")
    implicit = {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]}
    assert PreferenceDataset([implicit], tok).examples[0] == ex


def test_extract_prompt_keeps_the_space_with_the_completions():
    assert extract_prompt("Sky is blue", "Sky is green") == ("Sky is", " blue", " green")


def test_pair_batch_and_unpaired_batch_layout(tok):
    pairs = PreferenceDataset([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 2, tok)
    batch = pairs.collate(pairs.examples)
    assert batch[schema.GROUP_ID].tolist() == [0, 0, 1, 1]
    assert batch[schema.PREFERRED].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert batch[schema.LOSS_MASK].sum(-1).tolist() == [2.0] * 4  # answer + eos
    rows = [{"prompt": "1+1=", "completion": "2", "label": True},
            {"prompt": "2+2=", "completion": "5", "label": 0},
            {"prompt": "3+3=", "completion": "6", "label": True}]
    unpaired = PreferenceDataset(rows, tok, unpaired=True, kl_chunk_size=3)
    assert [e.kl_ids for e in unpaired.examples] == [e.completion_ids for e in unpaired.examples[-1:]
                                                     + unpaired.examples[:-1]]  # TRL's rotation by one
    batch = unpaired.collate(unpaired.examples)
    assert batch[schema.KL_SAMPLE].tolist() == [False, True] * 3
    assert batch[schema.PREFERRED].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    pair = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    kto_from_pairs = PreferenceDataset([pair], tok, unpaired=True, kl_chunk_size=2)
    assert [e.desirable for e in kto_from_pairs.examples] == [True, False]


@pytest.mark.parametrize(("row", "unpaired", "message"), [
    ({"prompt": "1+1=", "chosen": "2"}, False, r"row 0: a preference row needs 'prompt', 'chosen'"),
    ({"chosen": "abc", "rejected": "xyz"}, False, "row 0: an implicit-prompt pair needs"),
    ({"chosen": "1+1=2", "rejected": "1+1=2"}, False, "share a prompt prefix and then differ"),
    ({"prompt": "1+1=", "chosen": [{"role": "assistant", "content": "2"}], "rejected": "3"}, False,
     "'chosen' is a message list but 'prompt' is not"),
    ({"prompt": "1+1=", "completion": "2", "label": "yes"}, True, "'label' must be true or false"),
    ({"prompt": "1+1=", "completion": "2", "label": True}, False, "unpaired row .* in pair data"),
    ({"prompt": "1+1=", "chosen": "2" * 40, "rejected": "3"}, False, "row 0: 45 tokens > max_length=32"),
])
def test_bad_rows_name_the_row_and_the_fix(tok, row, unpaired, message):
    with pytest.raises(ValueError, match=message):
        PreferenceDataset([row], tok, max_length=32, unpaired=unpaired)


@pytest.mark.parametrize(("settings", "message"), [
    ({"loss_type": "dpo"}, "loss_type='dpo'; choose one of sigmoid, ipo, robust, simpo, orpo, kto"),
    ({"beta": 0.0}, "beta=0.0 must be > 0"),
    ({"loss_type": "robust", "label_smoothing": 0.5}, r"label_smoothing=0.5 must be in \[0, 0.5\)"),
    ({"loss_type": "ipo", "label_smoothing": 0.1}, "has no effect with loss_type='ipo'"),
    ({"loss_type": "kto", "undesirable_weight": 0.0}, "undesirable_weight=0.0 must be > 0"),
])
def test_bad_loss_settings_fail_when_the_config_is_built(settings, message):
    with pytest.raises(ValueError, match=message):
        PreferenceLossConfig(**settings)


def test_a_pair_split_over_micro_batches_is_refused(tok):
    pairs = PreferenceDataset([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 2, tok)
    batch = pairs.collate(pairs.examples)[:3]  # pair 1 lost its rejected row
    batch[schema.REF_LOG_PROB] = torch.zeros(batch[schema.LOSS_MASK].shape)
    with pytest.raises(ValueError, match=r"group_id -> \[chosen, rejected\] here: \{1: \[1, 0\]\}"):
        preference_loss()({"log_probs": torch.zeros(batch[schema.LOSS_MASK].shape)}, batch)


def test_sigmoid_label_smoothing_is_conservative_dpo():
    """cDPO: (1 - eps) x the loss of the pair + eps x the loss of the swapped pair."""
    from verl_trainer.core_algos.preference_losses import pair_losses

    c, r, rc, rr, n = (torch.tensor([v]) for v in (-3.0, -5.0, -4.0, -4.5, 2))
    plain = pair_losses("sigmoid", c, r, rc, rr, n, n, beta=0.3).losses
    swapped = pair_losses("sigmoid", r, c, rr, rc, n, n, beta=0.3).losses
    smoothed = pair_losses("sigmoid", c, r, rc, rr, n, n, beta=0.3, label_smoothing=0.2).losses
    torch.testing.assert_close(smoothed, 0.8 * plain + 0.2 * swapped)
