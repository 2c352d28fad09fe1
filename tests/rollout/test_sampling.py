"""Row-seeded sampling: a response depends on its seed only (not its batch, chunk or decoding loop), the
draws follow the sampled distribution, and the returned log-probs are those of the warped distribution."""

import math

import torch

from verl_trainer.data import schema
from verl_trainer.rollout import HFRollout, RolloutConfig
from verl_trainer.rollout.sampling import logits_warpers, row_uniforms, sample_dropping_finished, sample_rows

from .test_decoding import EOS, _prompts, _with_eos_bias, constant_eos_model, peaked_model_path  # noqa: F401

SAMPLING = dict(max_new_tokens=12, temperature=0.7, top_k=20, top_p=0.9)


def test_a_response_depends_on_its_seed_only(peaked_model_path, tokenizer):  # noqa: F811
    """Same seeds, any batch order / chunking / decoding loop: the same responses and log-probs."""
    prompts = _prompts(tokenizer, 2)
    seeds = list(range(100, 100 + len(prompts)))
    model = _with_eos_bias(peaked_model_path, 3.0)
    sampling = {**SAMPLING, "max_new_tokens": 8}
    runs = []
    loops = (("drop_finished", None, 1), ("drop_finished", None, -1), ("generate", 7, 1))
    for decoding, chunk, order in loops:
        cfg = RolloutConfig(decoding=decoding, generation_batch_size=chunk, **sampling)
        ids, lps = HFRollout(cfg, model, tokenizer).generate_token_ids(prompts[::order], cfg, seeds[::order])
        cut = [i[: i.index(EOS) + 1] if EOS in i else i for i in ids[::order]]  # generate pads after eos
        runs.append((cut, [lp[: len(i)] for lp, i in zip(lps[::order], cut)]))
    (ref_ids, ref_lps), *others = runs
    for ids, lps in others:
        assert ids == ref_ids
        # log-probs to the round-off of other batch shapes (rows dropped or not)
        torch.testing.assert_close(torch.tensor(sum(lps, [])), torch.tensor(sum(ref_lps, [])),
                                   atol=1e-4, rtol=1e-5)
    assert len({len(i) for i in ref_ids}) > 2  # rows stop at different steps (rows were dropped)
    assert len({tuple(i) for i in ref_ids}) > len(prompts) // 2  # different seeds, different samples


def test_log_probs_are_the_warped_distribution(peaked_model_path, tokenizer):  # noqa: F811
    """Recomputed with a plain forward: log_softmax of the logits after temperature, top-k, top-p."""
    cfg = RolloutConfig(n=3, decoding="drop_finished", **SAMPLING)
    model = _with_eos_bias(peaked_model_path, 2.0)
    rollout = HFRollout(cfg, model, tokenizer)
    items = [{"input_ids": p, "index": i} for i, p in enumerate(_prompts(tokenizer, 1))]
    batch = rollout.generate(items, step=4)
    warpers = logits_warpers(rollout.generation_config(cfg))
    with torch.no_grad():
        for row in range(batch.batch_size[0]):
            n = int(batch[schema.SEQ_LEN][row])
            ids = batch[schema.INPUT_IDS][row, :n]
            logits = model(input_ids=ids[None]).logits[0].float()  # position t predicts t + 1
            start = int(batch[schema.PROMPT_LEN][row])
            for t in range(start, n):
                scores = warpers(ids[None, :t], logits[t - 1][None])
                want = torch.log_softmax(scores, -1)[0, ids[t]]
                got = batch[schema.ROLLOUT_LOG_PROBS][row, t]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert torch.count_nonzero(batch[schema.ROLLOUT_LOG_PROBS][row, :start]) == 0
            assert torch.count_nonzero(batch[schema.ROLLOUT_LOG_PROBS][row, n:]) == 0


def test_inverse_cdf_draws_follow_the_distribution():
    """50k draws over 5 tokens (one removed by top-k, -inf): frequencies within 4 sigma, never the -inf."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    scores = probs.log().expand(50_000, 5).contiguous()
    tokens, lps = sample_rows(scores, row_uniforms(range(50_000), 1, torch.device("cpu"))[:, 0])
    freq = torch.bincount(tokens, minlength=5).double() / 50_000
    sigma = (probs.double() * (1 - probs.double()) / 50_000).sqrt()
    assert ((freq - probs.double()).abs() <= 4 * sigma + 1e-12).all(), freq
    torch.testing.assert_close(lps, probs.log()[tokens])


def test_seeded_drop_finished_length_distribution(rollout_model_path, tokenizer):
    """p(eos) = 1/8 at every step: row-seeded lengths are geometric capped at 12 (rows dropped)."""
    model = constant_eos_model(rollout_model_path)
    rollout = HFRollout(RolloutConfig(max_new_tokens=12, decoding="drop_finished"), model, tokenizer)
    input_ids, mask = rollout._left_pad(_prompts(tokenizer, 200))
    out, _ = sample_dropping_finished(model, input_ids, mask, rollout.generation_config(rollout.config),
                                      seeds=list(range(len(input_ids))))
    lengths = torch.tensor([len(r) for r in out], dtype=torch.float64)
    p = 1 / 8
    expected = (1 - (1 - p) ** 12) / p
    assert abs(lengths.mean().item() - expected) < 4 * lengths.std() / math.sqrt(len(out))
