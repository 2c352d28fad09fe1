"""The Bradley–Terry reward-model loss against TRL 1.16's ``RewardTrainer``: one batch, the same model, fp32.

TRL's trainer runs as shipped (``RewardTrainer(...).compute_loss`` on its own first batch, then backward) on a
tiny ``Qwen2ForSequenceClassification`` (one label, a seeded head). Its rows are given tokenised
(``chosen_ids`` / ``rejected_ids``, TRL's processed-dataset columns) with the ids our
:class:`~verl_trainer.data.reward_pairs.RewardPairDataset` makes — the reward model's inference encoding,
prompt + completion without an eos (TRL's text path would append one; docs/reward_models.md). Our side
loads the same checkpoint as the engine's bias-free token classifier
(:func:`~verl_trainer.algorithms.reward_training.load_trainable_reward_model`), forms the value engine's
next-token-aligned output and calls :class:`~verl_trainer.core_algos.reward_modeling.RewardModelLoss`.
Loss, accuracy, margin and every parameter's gradient agree to 1e-5, with a per-pair margin column and with
``center_rewards_coefficient``. TRL shuffles its batch; every compared value is a mean over pairs.
"""

from __future__ import annotations

import pytest
import torch

from verl_trainer.core_algos.reward_modeling import RewardLossConfig, RewardModelLoss
from verl_trainer.data import schema
from verl_trainer.data.reward_pairs import RewardPairDataset

trl = pytest.importorskip("trl", minversion="1.16")
datasets = pytest.importorskip("datasets")

PAIRS = [
    {"prompt": "3+4=", "chosen": "7", "rejected": "8", "margin": 0.5},
    {"prompt": "12+9=", "chosen": "21", "rejected": "3", "margin": 2.0},
    {"prompt": "5*5=", "chosen": "25", "rejected": "125", "margin": 1.0},
    {"prompt": "7-2=", "chosen": "5", "rejected": "-5", "margin": 0.0},
    {"prompt": "8+8=", "chosen": "16", "rejected": "61", "margin": 1.5},
]
TOL = 1e-5


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A tiny ``Qwen2ForSequenceClassification`` (one label, head drawn from a seed) with its tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from verl_trainer.models.tiny import make_tiny_model

    base = str(tmp_path_factory.mktemp("base"))
    make_tiny_model(base, hidden_size=32, num_hidden_layers=1, seed=3)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)  # scores far enough from 0 that pairs differ
    tok = AutoTokenizer.from_pretrained(base)
    model.config.pad_token_id = tok.pad_token_id
    out = str(tmp_path_factory.mktemp("rm"))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _trl_step(rm_dir, rows, tmp_path, **config):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_dir)
    args = trl.RewardConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(rows),
                            report_to=[], use_cpu=True, bf16=False, max_length=None, **config)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32)
    trainer = trl.RewardTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    return float(loss.detach()), metrics, grads


def _ours(rm_dir, batch, config):
    from verl_trainer.algorithms.reward_training import load_trainable_reward_model

    model = load_trainable_reward_model(rm_dir)
    logits = model(input_ids=batch[schema.INPUT_IDS], attention_mask=batch[schema.ATTENTION_MASK]).logits
    values = torch.zeros(batch[schema.INPUT_IDS].shape)
    values[:, 1:] = logits[:, :-1, 0]  # the value engine's convention: position t reads the head at t - 1
    loss, metrics = RewardModelLoss(config)({"values": values}, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return float(loss.detach()), {k: float(m.aggregate()) for k, m in metrics.items()}, grads


@pytest.mark.parametrize(("margin", "center"), [(False, None), (True, None), (True, 0.3)],
                         ids=["plain", "margin", "margin+center"])
def test_bradley_terry_matches_trl_reward_trainer(rm_dir, tmp_path, margin, center):
    from transformers import AutoTokenizer

    rows = PAIRS if margin else [{k: v for k, v in r.items() if k != "margin"} for r in PAIRS]
    dataset = RewardPairDataset(rows, AutoTokenizer.from_pretrained(rm_dir), max_length=32)
    tokenised = [{"chosen_ids": p.chosen_ids, "rejected_ids": p.rejected_ids,
                  **({"margin": p.margin} if margin else {})} for p in dataset.pairs]
    assert all(0 not in p.chosen_ids + p.rejected_ids for p in dataset.pairs)  # TRL reads the last non-pad
    trl_loss, trl_metrics, trl_grads = _trl_step(rm_dir, tokenised, tmp_path,
                                                 center_rewards_coefficient=center)
    loss, metrics, grads = _ours(rm_dir, dataset.collate(dataset.pairs),
                                 RewardLossConfig(center_rewards_coefficient=center))
    assert loss == pytest.approx(trl_loss, abs=TOL, rel=TOL)
    assert metrics["rm/loss"] == pytest.approx(trl_loss, abs=TOL, rel=TOL)
    assert metrics["rm/accuracy"] == pytest.approx(trl_metrics["accuracy"], abs=TOL)
    assert metrics["rm/margin"] == pytest.approx(trl_metrics["margin"], abs=TOL, rel=TOL)
    assert 0.0 < metrics["rm/accuracy"] < 1.0  # both outcomes occur: the comparison can fail
    assert grads.keys() == trl_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], atol=TOL, rtol=TOL, msg=name)
    assert max(g.abs().max() for g in grads.values()) > 1e-4
