"""The distillation estimators and loss terms (core_algos/distill.py, data/topk_log_probs.py).

Checked against TRL 1.16's GKD loss (``GKDTrainer.generalized_jsd_loss``: ``beta=0`` is
``KL(teacher || student)``, ``beta=1`` is ``KL(student || teacher)``, both over the full vocabulary, a
token mean with ``reduction="batchmean"``): the top-k forward KL at ``k = V`` equals its ``beta=0`` loss
and gradient; each reverse-KL estimator's expectation under the student (summed over the vocabulary)
equals its ``beta=1`` value, and the expected gradients of the estimators as losses are what
docs/distillation.md says (k2: the reverse KL's, k3: the forward KL's, k1: zero).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from verl_trainer.core_algos.aggregation import GlobalBatchInfo
from verl_trainer.core_algos.distill import DistillLoss, DistillLossConfig, reverse_kl, topk_forward_kl
from verl_trainer.data.topk_log_probs import gathered_log_probs, topk_log_probs
from verl_trainer.metrics import reduce_metrics

B, T, V = 3, 5, 11


def _logits(seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(B, T, V, generator=g, dtype=torch.float64)).requires_grad_(True)


def _mask() -> torch.Tensor:
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2, :2] = False
    return mask


def _trl_loss(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    trl_gkd = pytest.importorskip("trl.experimental.gkd")
    labels = torch.where(mask, 0, -100)
    return trl_gkd.GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta,
                                                   reduction="batchmean")


def _token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum()


@pytest.mark.parametrize("normalization", ["renorm", "tail"])
def test_topk_forward_kl_at_full_vocab_is_trl_gkd_beta0(normalization):
    student, teacher, mask = _logits(0), _logits(1).detach(), _mask()
    want = _trl_loss(student, teacher, mask, beta=0.0)
    (want_grad,) = torch.autograd.grad(want, student)
    t_log = torch.log_softmax(teacher, -1)
    ids = torch.argsort(t_log, -1, descending=True)  # the "top-V", in the teacher's order
    s_log = torch.log_softmax(student, -1).gather(-1, ids)
    got = _token_mean(topk_forward_kl(t_log.gather(-1, ids), s_log, normalization), mask)
    (got_grad,) = torch.autograd.grad(got, student)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)


def test_topk_forward_kl_below_full_vocab():
    student, teacher = _logits(0).detach(), _logits(1).detach()
    t_log, s_log = torch.log_softmax(teacher, -1), torch.log_softmax(student, -1)
    full = (t_log.exp() * (t_log - s_log)).sum(-1)
    top_t, ids = torch.topk(t_log, 4, -1)
    tail = topk_forward_kl(top_t, s_log.gather(-1, ids), "tail")
    assert (tail >= -1e-12).all() and (tail <= full + 1e-9).all()  # data processing: never above the full KL
    # renorm is 0 when the student has the teacher's shape on the top-k, whatever its mass there
    assert torch.allclose(topk_forward_kl(top_t, top_t - 3.0, "renorm"), torch.zeros(B, T, dtype=top_t.dtype))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reverse_kl_estimators_against_trl_gkd_beta1(estimator):
    """E_{x ~ pi_s}[estimator] and the estimators' expected loss gradients, summed over the vocabulary."""
    student, teacher, mask = _logits(2), _logits(3).detach(), _mask()
    s_log, t_log = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    p_s = s_log.exp().detach()  # the sampling distribution: not differentiated (the samples are fixed)
    per_token = reverse_kl(s_log, t_log, estimator)  # [B, T, V]: the estimator at every candidate token
    expected = _token_mean((p_s * per_token).sum(-1), mask)
    reverse = _trl_loss(student, teacher, mask, beta=1.0)
    forward = _trl_loss(student, teacher, mask, beta=0.0)
    if estimator != "k2":  # k1 and k3 are unbiased estimators of the reverse KL; k2 only to second order
        torch.testing.assert_close(expected, reverse.to(expected.dtype), rtol=1e-6, atol=1e-8)
    (grad,) = torch.autograd.grad(expected, student)
    want = {"k1": None, "k2": reverse, "k3": forward}[estimator]
    if want is None:
        torch.testing.assert_close(grad, torch.zeros_like(grad), rtol=0, atol=1e-9)
    else:
        torch.testing.assert_close(grad, torch.autograd.grad(want, student)[0], rtol=1e-5, atol=1e-8)


def test_topk_kernels_match_log_softmax_chunked():
    logits = torch.randn(13, V, dtype=torch.float32, requires_grad=True)
    ids, values = topk_log_probs(logits, 3, temperature=0.7, chunk_elements=2 * V)
    want_values, want_ids = torch.topk(torch.log_softmax(logits.detach() / 0.7, -1), 3, -1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(values, want_values)
    query = torch.randint(0, V, (13, 4))
    got = gathered_log_probs(logits, query, temperature=0.7, chunk_elements=2 * V)
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, query)
    torch.testing.assert_close(got, want)
    weights = torch.randn(13, 4)
    torch.testing.assert_close(torch.autograd.grad((got * weights).sum(), logits)[0],
                               torch.autograd.grad((want * weights).sum(), logits)[0])
    with pytest.raises(ValueError, match="top_k=12"):
        topk_log_probs(logits, 12)


def _distill_batch(seed: int = 4, k: int = 3):
    g = torch.Generator().manual_seed(seed)
    mask = _mask().float()
    topk = torch.log_softmax(torch.randn(B, T, k, generator=g), -1) - 0.2
    data = TensorDict({"loss_mask": mask, "teacher_log_probs": -torch.rand(B, T, generator=g) * mask,
                       "teacher_topk_log_probs": topk}, batch_size=[B])
    log_probs = (-torch.rand(B, T, generator=g) * mask).requires_grad_(True)
    gathered = (torch.log_softmax(torch.randn(B, T, k, generator=g), -1) - 0.5).requires_grad_(True)
    return data, {"log_probs": log_probs, "gathered_log_probs": gathered}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_distill_loss_micro_batches_sum_to_the_whole(mode):
    """Global denominators: the micro-batches' partial losses and gradients add up to the one-piece ones."""
    data, out = _distill_batch()
    loss_fn = DistillLoss(DistillLossConfig(kl_coef=0.5, kl_estimator="k3", top_k_coef=2.0,
                                            top_k_normalization="tail", loss_agg_mode=mode))
    whole, whole_metrics = loss_fn(out, data)
    whole_grads = torch.autograd.grad(whole, [out["log_probs"], out["gathered_log_probs"]])
    info = GlobalBatchInfo.from_batch(data)
    parts, metrics = [], []
    for rows in ([0], [1, 2]):
        part, m = loss_fn({k: v[rows] for k, v in out.items()}, data[rows], info)
        parts.append(part)
        metrics.append(m)
    split = sum(parts)
    split_grads = torch.autograd.grad(split, [out["log_probs"], out["gathered_log_probs"]])
    torch.testing.assert_close(split, whole)
    for got, want in zip(split_grads, whole_grads):
        torch.testing.assert_close(got, want)
    reduced, want = reduce_metrics(metrics), reduce_metrics([whole_metrics])
    assert reduced.keys() == want.keys() == {"actor/distill_kl_loss", "actor/distill_kl",
                                             "actor/distill_topk_kl_loss"}
    for key in want:
        assert reduced[key] == pytest.approx(want[key], rel=1e-6)


def test_distill_loss_config_refusals():
    with pytest.raises(ValueError, match="kl_estimator='k4'.*k1, k2, k3"):
        DistillLossConfig(kl_estimator="k4")
    with pytest.raises(ValueError, match="both 0"):
        DistillLossConfig(kl_coef=0.0, top_k_coef=0.0)
    data, out = _distill_batch()
    with pytest.raises(KeyError, match="gathered_log_probs"):
        DistillLoss(DistillLossConfig(top_k_coef=1.0))({"log_probs": out["log_probs"]}, data)
