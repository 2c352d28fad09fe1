"""Reward-model training's parts: the data encoded as the reward model reads it at inference, the loss's pair
handling, the export as a sequence classifier that ``algorithm.reward.model`` loads, the early errors; and
online DPO's pair selection (best vs worst, ties dropped and counted) and its config checks."""

from __future__ import annotations

import pytest
import torch

from verl_trainer.algorithms.config import RewardModelConfig
from verl_trainer.algorithms.online_dpo import OnlineDPOConfig, select_online_pairs
from verl_trainer.algorithms.reward_model import RewardModel
from verl_trainer.algorithms.reward_training import RewardModelTrainingConfig, load_trainable_reward_model
from verl_trainer.core_algos.preference import PreferenceLossConfig
from verl_trainer.core_algos.reward_modeling import RewardLossConfig, RewardModelLoss, bradley_terry_losses
from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.data.reward_pairs import PAIR_MARGIN, RewardPairDataset
from verl_trainer.data.reward_task import WRONG_KINDS, reward_model_rows
from verl_trainer.engine.config import EngineConfig
from verl_trainer.rollout.config import RolloutConfig


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A tiny ``Qwen2ForSequenceClassification``, one label, with its tokenizer (it has a chat template)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from verl_trainer.models.tiny import make_tiny_model

    base = str(tmp_path_factory.mktemp("base"))
    make_tiny_model(base, hidden_size=32, num_hidden_layers=1)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    tok = AutoTokenizer.from_pretrained(base)
    model.config.pad_token_id = tok.pad_token_id
    out = str(tmp_path_factory.mktemp("rm"))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


ROWS = [
    {"prompt": "3+4=", "chosen": "7", "rejected": "8"},
    {"prompt": [{"role": "user", "content": "12+9="}], "chosen": [{"role": "assistant", "content": "21"}],
     "rejected": [{"role": "assistant", "content": "3"}]},
]


def test_pairs_are_encoded_as_the_reward_model_scores_rollouts(rm_dir):
    model = RewardModel(RewardModelConfig(enable=True, path=rm_dir, max_length=64))
    dataset = RewardPairDataset(ROWS, model.tokenizer, max_length=64)
    batch = dataset.collate(dataset.pairs)
    prompts = [ROWS[0]["prompt"]] * 2 + [ROWS[1]["prompt"]] * 2
    inference, truncated = model.inputs(prompts, ["7", "8", "21", "3"])
    assert truncated == 0
    assert torch.equal(batch[schema.INPUT_IDS], inference[schema.INPUT_IDS])
    assert torch.equal(batch[schema.SEQ_LEN], inference[schema.SEQ_LEN])
    assert batch[schema.GROUP_ID].tolist() == [0, 0, 1, 1]
    assert batch[schema.PREFERRED].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_the_engine_score_is_the_sequence_classifier_score(rm_dir):
    """The trainable token classifier's value at ``seq_len - 1`` (the value engine's convention) is what
    ``AutoModelForSequenceClassification`` returns for the same text."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    dataset = RewardPairDataset(ROWS[:1], AutoTokenizer.from_pretrained(rm_dir), max_length=64)
    batch = dataset.collate(dataset.pairs)
    model = load_trainable_reward_model(rm_dir)
    logits = model(input_ids=batch[schema.INPUT_IDS], attention_mask=batch[schema.ATTENTION_MASK]).logits
    values = torch.zeros(batch[schema.INPUT_IDS].shape)
    values[:, 1:] = logits[:, :-1, 0]
    _, metrics = RewardModelLoss()({"values": values}, batch)
    classifier = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    with torch.no_grad():
        expected = [float(classifier(input_ids=torch.tensor([ids])).logits[0, 0])
                    for ids in (dataset.pairs[0].chosen_ids, dataset.pairs[0].rejected_ids)]
    assert float(metrics["rm/rewards_chosen"].aggregate()) == pytest.approx(expected[0], abs=1e-5)
    assert float(metrics["rm/rewards_rejected"].aggregate()) == pytest.approx(expected[1], abs=1e-5)


def test_loss_reads_the_margin_and_refuses_half_a_pair():
    batch = make_batch([[5, 6]] * 4, [[2]] * 4)
    batch.set(schema.GROUP_ID, torch.tensor([0, 0, 1, 1]))
    batch.set(schema.PREFERRED, torch.tensor([0.0, 1.0, 1.0, 0.0]))  # pair 0 listed rejected first
    batch.set(PAIR_MARGIN, torch.tensor([0.5, 0.5, 2.0, 2.0]))
    values = torch.zeros(4, 3)
    values[:, 2] = torch.tensor([1.0, 3.0, 0.0, -1.0])  # seq_len 3: the score sits at position 2
    loss_fn = RewardModelLoss(RewardLossConfig(center_rewards_coefficient=0.1))
    loss, metrics = loss_fn({"values": values}, batch)
    expected = bradley_terry_losses(torch.tensor([3.0, 0.0]), torch.tensor([1.0, -1.0]),
                                    torch.tensor([0.5, 2.0]), 0.1).mean()
    assert float(loss) == pytest.approx(float(expected))
    assert float(expected) == pytest.approx(
        float(-torch.nn.functional.logsigmoid(torch.tensor([1.5, -1.0])).mean() + 0.1 * (16 + 1) / 2))
    assert float(metrics["rm/accuracy"].aggregate()) == 1.0
    assert float(metrics["rm/margin"].aggregate()) == pytest.approx(1.5)
    with pytest.raises(ValueError, match=r"group_id -> \[chosen, rejected\] here: \{1: \[1, 0\]\}"):
        RewardModelLoss()({"values": values[:3]}, batch[:3])


@pytest.mark.parametrize(("rows", "match"), [
    ([{"prompt": "1+1=", "chosen": "2"}], r"row 0: a reward-model pair needs 'chosen' and 'rejected'"),
    ([{"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": "big"}], "'margin' must be a number"),
    ([{"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 1.0},
      {"prompt": "1+2=", "chosen": "3", "rejected": "4"}], "'margin' is given on some rows and not others"),
    ([{"prompt": "1+1=" * 20, "chosen": "2", "rejected": "3"}], r"> data.max_length=16"),
    ([{"prompt": "1+1=", "chosen": [{"role": "user", "content": "2"}], "rejected": "3"}],
     "must be text or one assistant message"),
])
def test_bad_rows_are_named(rm_dir, rows, match):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match=match):
        RewardPairDataset(rows, AutoTokenizer.from_pretrained(rm_dir), max_length=16)


def test_settings_are_checked_when_the_config_is_built():
    with pytest.raises(ValueError, match=r"center_rewards_coefficient=-0.1 must be >= 0"):
        RewardLossConfig(center_rewards_coefficient=-0.1)
    with pytest.raises(ValueError, match="lora_rank=8: reward-model training trains the whole model"):
        RewardModelTrainingConfig(engine=EngineConfig(lora_rank=8))


def test_demo_pairs_cover_every_kind_of_wrong_answer():
    rows = reward_model_rows([{"prompt": "3+4=", "response": "7"}, {"prompt": "0+0=", "response": "0"}])
    assert len(rows) == 2 * (19 + len(WRONG_KINDS))
    assert all(r["chosen"] != r["rejected"] for r in rows)
    assert {"", "77", "8", "19", "0"} <= {r["rejected"] for r in rows if r["chosen"] == "7"}


# ---------------------------------------------------------------- online DPO
def _rollout(scores):
    """A rollout batch: prompt ``i // 4`` has responses ``4i .. 4i + 3`` with ``scores``."""
    n = len(scores)
    batch = make_batch([[3, 4]] * n, [[10 + i] for i in range(n)], uids=torch.arange(n) // 4)
    return batch, torch.tensor(scores)


def test_online_pairs_take_the_best_and_the_worst_and_drop_ties():
    batch, scores = _rollout([0.1, 1.0, 0.0, 1.0,   0.5, 0.5, 0.5, 0.5,   0.0, 0.1, 0.1, 0.0])
    pairs, any_pair, metrics = select_online_pairs(batch, scores)
    assert any_pair
    ids = pairs[schema.INPUT_IDS][:, 2].tolist()
    assert ids == [11, 12, 19, 18]  # prompt 0: the first 1.0 vs the 0.0; prompt 1 tied; prompt 2: 0.1 vs 0.0
    assert pairs[schema.GROUP_ID].tolist() == [0, 0, 1, 1]
    assert pairs[schema.PREFERRED].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert float(metrics["online_dpo/tied_prompt_frac"].aggregate()) == pytest.approx(1 / 3)
    assert float(metrics["online_dpo/pairs"].aggregate()) == 2
    assert float(metrics["online_dpo/score_gap"].aggregate()) == pytest.approx(0.55)


def test_a_step_of_ties_trains_nothing():
    batch, scores = _rollout([1.0] * 4)
    pairs, any_pair, metrics = select_online_pairs(batch, scores)
    assert not any_pair
    assert pairs[schema.IS_PADDING].tolist() == [True]
    assert float(metrics["online_dpo/tied_prompt_frac"].aggregate()) == 1.0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"rollout": RolloutConfig(n=1)}, r"rollout.n=1: online DPO pairs the best and the worst"),
    ({"loss": PreferenceLossConfig(loss_type="kto")}, "loss_type='kto' is unpaired"),
])
def test_online_dpo_config_refuses_what_cannot_make_pairs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OnlineDPOConfig(**kwargs)

