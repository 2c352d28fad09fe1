"""The preference losses against TRL 1.16's trainers: one step on the same tiny model and rows, fp32.

Each case builds TRL's trainer (DPOTrainer for sigmoid / ipo / robust, the experimental CPOTrainer for
SimPO, ORPOTrainer for ORPO, KTOTrainer for KTO) on a policy that differs from its reference (perturbed
weights, so the rewards are not zero), takes its first batch (sequential sampling), computes its loss with
``compute_loss`` and back-propagates; our side tokenises the same rows with
:class:`~verl_trainer.data.preference.PreferenceDataset` (the token ids must match TRL's), computes
log-probs with a plain forward and calls :class:`~verl_trainer.core_algos.preference.PreferenceLoss`.
Loss, rewards/chosen, rewards/rejected, margins and every parameter's gradient agree to 1e-5 (ORPO: the
odds-ratio term and the rewards; its NLL term is defined differently, see the test).
"""

from __future__ import annotations

import pytest
import torch

from verl_trainer.core_algos.aggregation import masked_sum
from verl_trainer.core_algos.preference import PreferenceLossConfig, preference_loss
from verl_trainer.core_algos.preference_losses import kto_reference_point
from verl_trainer.data import schema
from verl_trainer.data.preference import PreferenceDataset

trl = pytest.importorskip("trl", minversion="1.16")
datasets = pytest.importorskip("datasets")

PAIRS = [
    {"prompt": "3+4=", "chosen": "7", "rejected": "8"},
    {"prompt": "12+9=", "chosen": "21", "rejected": "3"},
    {"prompt": "5*5=", "chosen": "25", "rejected": "125"},
    {"prompt": "7-2=", "chosen": "5", "rejected": "-5"},
]
BOS_PAIRS = [dict(r, prompt="<bos>" + r["prompt"]) for r in PAIRS]  # CPO / ORPO prepend a bos when missing
UNPAIRED = [
    {"prompt": "3+4=", "completion": "7", "label": True},
    {"prompt": "12+9=", "completion": "3", "label": False},
    {"prompt": "5*5=", "completion": "25", "label": True},
    {"prompt": "7-2=", "completion": "-5", "label": False},
    {"prompt": "8+8=", "completion": "16", "label": True},
]
TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``(policy_dir, ref_dir)``: a tiny model and a copy with perturbed weights."""
    from transformers import AutoModelForCausalLM

    from verl_trainer.models.tiny import make_tiny_model

    ref = str(tmp_path_factory.mktemp("ref"))
    make_tiny_model(ref, hidden_size=32, num_hidden_layers=1, seed=3)
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    policy = str(tmp_path_factory.mktemp("policy"))
    model.save_pretrained(policy)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(ref).save_pretrained(policy)
    return policy, ref


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _log_probs(model, batch):
    """``[B, T]`` next-token log-probs aligned with ``input_ids`` (the engine's convention)."""
    ids = batch[schema.INPUT_IDS]
    logits = model(input_ids=ids, attention_mask=batch[schema.ATTENTION_MASK]).logits.float()
    out = torch.zeros(ids.shape, dtype=torch.float32)
    out[:, 1:] = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return out * batch[schema.ATTENTION_MASK]


def _trl_trainer(kind, policy, ref, rows, tmp_path, **config):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref)
    common = {"output_dir": str(tmp_path / "trl"), "per_device_train_batch_size": len(rows), "report_to": [],
              "use_cpu": True, "bf16": False, "max_length": None}
    data = datasets.Dataset.from_list(rows)
    if kind == "dpo":
        args = trl.DPOConfig(**common, train_sampling_strategy="sequential", **config)
        return trl.DPOTrainer(model=_load(policy), ref_model=_load(ref), args=args, train_dataset=data,
                              processing_class=tok)
    if kind == "kto":
        args = trl.KTOConfig(**common, train_sampling_strategy="sequential", **config)
        return trl.KTOTrainer(model=_load(policy), ref_model=_load(ref), args=args, train_dataset=data,
                              processing_class=tok)
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    config_cls, trainer_cls = (CPOConfig, CPOTrainer) if kind == "cpo" else (ORPOConfig, ORPOTrainer)
    args = config_cls(**{**common, "max_length": 64}, **config)
    return trainer_cls(model=_load(policy), args=args, train_dataset=data, processing_class=tok)


def _trl_step(trainer):
    """TRL's loss, its logged metrics and the gradients of its first batch."""
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    stored = getattr(trainer, "_metrics", None)
    if not (stored and stored.get("train")):  # the experimental trainers store them elsewhere
        stored = trainer._stored_metrics
    metrics = dict(stored["train"])
    metrics = {k.removeprefix("train_"): v[-1] for k, v in metrics.items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return batch, float(loss.detach()), metrics, grads


def _ours(policy, ref, batch, config):
    model = _load(policy)
    if config.needs_reference:
        with torch.no_grad():
            batch[schema.REF_LOG_PROB] = _log_probs(_load(ref), batch)
    loss, metrics = preference_loss(config)({"log_probs": _log_probs(model, batch)}, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return float(loss), {k: float(m.aggregate()) for k, m in metrics.items()}, grads


def _check(ours, theirs, names):
    loss, metrics, grads = ours
    trl_loss, trl_metrics, trl_grads = theirs
    assert loss == pytest.approx(trl_loss, abs=TOL, rel=TOL)
    for name in names:
        assert metrics[name] == pytest.approx(trl_metrics[name], abs=TOL, rel=TOL), name
    assert grads.keys() == trl_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], atol=TOL, rtol=TOL, msg=name)
    assert max(g.abs().max() for g in grads.values()) > 1e-4  # the step moved something


def _pair_ids(batch):
    """Our pair batch as TRL's token rows: all chosen, then all rejected (right-padded ids, masks)."""
    order = torch.cat([torch.arange(0, batch.batch_size[0], 2), torch.arange(1, batch.batch_size[0], 2)])
    return batch[schema.INPUT_IDS][order], batch[schema.LOSS_MASK][order]


def _same_tokens(ids, mask, trl_ids, trl_mask):
    width = min(ids.shape[1], trl_ids.shape[1])
    assert torch.equal(ids[:, :width] * (ids[:, :width] != 0), trl_ids[:, :width] * (trl_ids[:, :width] != 0))
    assert torch.equal(mask[:, :width].long(), trl_mask[:, :width].long())


PAIR_CASES = [
    ("sigmoid", {}, {}),
    ("ipo", {}, {}),
    ("robust", {"label_smoothing": 0.1}, {"label_smoothing": 0.1}),
]


@pytest.mark.parametrize(("loss_type", "ours_cfg", "trl_cfg"), PAIR_CASES, ids=[c[0] for c in PAIR_CASES])
def test_dpo_losses_match_trl_dpo_trainer(models, tmp_path, loss_type, ours_cfg, trl_cfg):
    policy, ref = models
    trainer = _trl_trainer("dpo", policy, ref, PAIRS, tmp_path, beta=0.2, loss_type=[loss_type], **trl_cfg)
    trl_batch, *theirs = _trl_step(trainer)
    batch = PreferenceDataset(PAIRS, trainer.processing_class).collate(
        PreferenceDataset(PAIRS, trainer.processing_class).examples)
    _same_tokens(*_pair_ids(batch), trl_batch["input_ids"], trl_batch["completion_mask"])
    ours = _ours(policy, ref, batch, PreferenceLossConfig(loss_type=loss_type, beta=0.2, **ours_cfg))
    _check(ours, theirs, ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"))


def test_simpo_matches_trl_cpo_trainer(models, tmp_path):
    policy, ref = models
    trainer = _trl_trainer("cpo", policy, ref, BOS_PAIRS, tmp_path, beta=2.0, loss_type="simpo",
                           simpo_gamma=0.5, cpo_alpha=0.0)
    _, *theirs = _trl_step(trainer)
    dataset = PreferenceDataset(BOS_PAIRS, trainer.processing_class)
    ours = _ours(policy, ref, dataset.collate(dataset.examples),
                 PreferenceLossConfig(loss_type="simpo", beta=2.0, simpo_gamma=0.5))
    _check(ours, theirs, ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"))


def test_orpo_odds_ratio_and_rewards_match_trl_orpo_trainer(models, tmp_path):
    """ORPO's odds-ratio term and rewards equal TRL's; the NLL terms differ by definition (TRL averages over
    prompt and completion tokens, the paper and this project over the completion's), so each side's loss is
    checked as its own ``nll - beta * log_odds_ratio``."""
    policy, ref = models
    trainer = _trl_trainer("orpo", policy, ref, BOS_PAIRS, tmp_path, beta=0.3)
    _, trl_loss, trl_metrics, _ = _trl_step(trainer)
    dataset = PreferenceDataset(BOS_PAIRS, trainer.processing_class)
    loss, metrics, _ = _ours(policy, ref, dataset.collate(dataset.examples),
                             PreferenceLossConfig(loss_type="orpo", beta=0.3))
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert metrics[name] == pytest.approx(trl_metrics[name], abs=TOL, rel=TOL), name
    assert metrics["orpo/log_odds_ratio"] == pytest.approx(trl_metrics["log_odds_ratio"], abs=TOL, rel=TOL)
    assert metrics["orpo/log_odds_chosen"] == pytest.approx(trl_metrics["log_odds_chosen"], abs=TOL, rel=TOL)
    assert loss == pytest.approx(metrics["orpo/nll_loss"] - 0.3 * metrics["orpo/log_odds_ratio"], abs=TOL)
    assert trl_loss == pytest.approx(trl_metrics["nll_loss"] - 0.3 * trl_metrics["log_odds_ratio"], abs=TOL)


def test_kto_matches_trl_kto_trainer(models, tmp_path):
    policy, ref = models
    trainer = _trl_trainer("kto", policy, ref, UNPAIRED, tmp_path, beta=0.2, desirable_weight=1.0,
                           undesirable_weight=1.5)
    trl_batch, *theirs = _trl_step(trainer)
    dataset = PreferenceDataset(UNPAIRED, trainer.processing_class, unpaired=True,
                                kl_chunk_size=len(UNPAIRED))
    batch = dataset.collate(dataset.examples)
    kl_rows = batch[schema.KL_SAMPLE]
    ids, mask = batch[schema.INPUT_IDS], batch[schema.LOSS_MASK]
    _same_tokens(ids[~kl_rows], mask[~kl_rows], trl_batch["input_ids"], trl_batch["completion_mask"])
    _same_tokens(ids[kl_rows], mask[kl_rows], trl_batch["KL_input_ids"], trl_batch["KL_completion_mask"])
    kl, main = batch[kl_rows], batch[~kl_rows]
    with torch.no_grad():
        mask = kl[schema.LOSS_MASK].bool()
        z0 = kto_reference_point(masked_sum(_log_probs(_load(policy), kl), mask, -1),
                                 masked_sum(_log_probs(_load(ref), kl), mask, -1))
    assert float(z0) == pytest.approx(theirs[1]["kl"], abs=TOL)
    main.set(schema.KL_REFERENCE, z0.expand(main.batch_size[0]).clone())
    ours = _ours(policy, ref, main, PreferenceLossConfig(loss_type="kto", beta=0.2, undesirable_weight=1.5))
    _check(ours, theirs, ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"))
