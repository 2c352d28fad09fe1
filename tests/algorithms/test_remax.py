"""ReMax from the GRPO recipe (issue 30, item 3): each prompt's greedy response, scored like the samples, is
the baseline of its samples (``reward_baselines``); it is never trained on.

The step test runs a real ``Trainer`` on spawned gloo ranks (dp=1 and dp=2) and checks the baselines
against a separate greedy ``generate`` of the same prompts with the same (initial) weights.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.algorithms.short_grpo import make_assets, short_grpo_config
from tests.trainer.common import tiny_model
from verl_trainer.algorithms import GRPO, GRPOConfig
from verl_trainer.algorithms.config import RewardConfig
from verl_trainer.algorithms.greedy_baseline import GreedyBaseline, attach_reward_baselines
from verl_trainer.algorithms.stages.signal import Scorer
from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.data.prompts import collate_prompts
from verl_trainer.rollout import RESPONSE_TEXT, HFRollout, RolloutConfig

REWARD = "tests.algorithms.test_remax:text_reward"
PROMPTS = [[5, 9, 3], [7, 7], [11, 4, 6, 8]]


def text_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A reward that varies with the response text (a tiny random model rarely does arithmetic)."""
    if ground_truth == "boom":
        raise RuntimeError("this reward call fails on purpose")
    return (sum(map(ord, solution_str)) % 7) / 6


def _prompt_batch(truths: list[str]) -> object:
    return collate_prompts([{"input_ids": p, "index": i, "ground_truth": t}
                            for i, (p, t) in enumerate(zip(PROMPTS, truths))])


# ----------------------------------------------------------------------------------------- config
def test_remax_runs_from_grpo_even_with_one_sample_per_prompt():
    one = dataclasses.replace(GRPOConfig().rollout, n=1)
    assert GRPO(GRPOConfig(adv_estimator="remax", rollout=one)).greedy_baseline  # the paper's setting
    for name in ("grpo", "rloo", "reinforce_plus_plus"):
        assert not GRPO(GRPOConfig(adv_estimator=name)).greedy_baseline


def test_each_prompts_baseline_goes_to_its_samples_and_a_missing_one_is_named():
    samples = make_batch([[4, 5]] * 4, [[6], [6, 7], [6], [6, 7, 8]], uids=[3, 3, 8, 8])
    baseline = make_batch([[4, 5]] * 2, [[6], [7]], uids=[3, 8])
    orphans = attach_reward_baselines(samples, baseline, torch.tensor([0.25, 1.0]))
    assert samples[schema.REWARD_BASELINES].tolist() == [0.25, 0.25, 1.0, 1.0] and not orphans.any()
    schema.mark_padding(baseline, torch.tensor([False, True]))  # dropped: its prompt has no baseline
    orphans = attach_reward_baselines(samples, baseline, torch.tensor([0.25, 1.0]))
    assert orphans.tolist() == [False, False, True, True]
    assert samples[schema.REWARD_BASELINES].tolist() == [0.25, 0.25, 0.0, 0.0]
    with pytest.raises(RuntimeError, match="does not answer the prompts of the step's 4 samples in order"):
        attach_reward_baselines(samples, make_batch([[4, 5]] * 2, [[6], [7]], uids=[8, 3]), torch.zeros(2))


# ------------------------------------------------------------------- one rank, no Trainer: scoring
@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("remax") / "model")


def _stages(model: str, on_error: str = "error") -> tuple:
    """A ReMax module's scorer with the greedy baseline part, and a rollout (no Trainer, no engines)."""
    rollout_cfg = RolloutConfig(n=2, max_new_tokens=4, seed=3)
    module = GRPO(GRPOConfig(model_path=model, adv_estimator="remax", rollout=rollout_cfg,
                             reward=RewardConfig(name=text_reward, on_error=on_error)))
    part = GreedyBaseline()
    overlong = module.config.reward.overlong_buffer
    scorer = Scorer(module.reward_fn, module.guard, rollout_cfg, overlong, parts=[part])
    return module, HFRollout(rollout_cfg, model), part, scorer


def test_the_baseline_is_the_greedy_response_scored_like_a_sample_and_the_advantage_subtracts_it(model):
    module, rollout, part, scorer = _stages(model)
    batch = rollout.generate(_prompt_batch(["1"] * 3), step=0)
    timings: dict = {}
    part.after_rollout(rollout, _prompt_batch(["1"] * 3), 0, torch.arange(3), timings)
    baseline = part._responses[0]
    greedy = HFRollout(RolloutConfig(n=1, max_new_tokens=4), model).generate(
        _prompt_batch(["1"] * 3), do_sample=False)  # a separate greedy generate, same weights
    assert list(baseline[RESPONSE_TEXT]) == list(greedy[RESPONSE_TEXT])
    assert "timing/baseline_rollout_s" in timings
    metrics: dict = {}
    scores = scorer.score(batch, 1, metrics)  # step 1: the greedy responses generated at global_step 0
    want = torch.tensor([text_reward("", t, "1") for t in greedy[RESPONSE_TEXT]])
    torch.testing.assert_close(batch[schema.REWARD_BASELINES], want.repeat_interleave(2))
    assert float(metrics["reward/baseline_mean"].aggregate()) == pytest.approx(float(want.mean()))
    assert metrics["reward/baseline_errors"] == 0.0 and "reward/mean" in metrics
    module.compute_advantages(batch, scores, metrics)
    mask = batch[schema.RESPONSE_MASK].bool()
    adv = batch[schema.ADVANTAGES]
    for i in range(len(batch)):  # the sample's reward minus its prompt's greedy reward, on every token
        tokens = int(mask[i].sum())
        assert adv[i][mask[i]].tolist() == pytest.approx([float(scores[i] - want[i // 2])] * tokens)
    assert (adv[~mask] == 0).all() and batch.batch_size[0] == 6  # the greedy responses are not in it


def test_a_dropped_greedy_response_drops_its_prompts_samples(model):
    module, rollout, part, scorer = _stages(model, on_error="drop")
    batch = rollout.generate(_prompt_batch(["1"] * 3), step=0)
    part.after_rollout(rollout, _prompt_batch(["1", "boom", "1"]), 0, torch.arange(3), {})
    metrics: dict = {}
    scorer.score(batch, 1, metrics)
    assert schema.real_mask(batch).tolist() == [True, True, False, False, True, True]
    assert metrics["reward/baseline_errors"] == 1.0 and metrics["reward/baseline_dropped_samples"] == 1.0
    assert metrics["reward/errors"] == 0.0  # the samples' own count is kept apart
    assert module.guard.dropped > 0  # the step knows samples went (all dropped: it skips the update)


# ------------------------------------------------------------- real steps on spawned ranks, dp 1 vs 2
def _remax_fit(model: str, data: str, root: str) -> dict:
    import torch.distributed as dist

    from verl_trainer import Trainer
    from verl_trainer.algorithms import PromptDataModule
    from verl_trainer.callbacks import Callback
    from verl_trainer.models.loading import load_tokenizer

    keys = (schema.INPUT_IDS, schema.PROMPT_LEN, schema.SEQ_LEN, schema.RESPONSE_MASK, schema.ADVANTAGES,
            schema.TOKEN_LEVEL_REWARDS, schema.REWARD_BASELINES)

    class Record(Callback):
        def __init__(self) -> None:
            self.batches: list[dict] = []
            self.metrics: list[dict] = []

        def on_rollout_end(self, trainer, module, batch) -> None:
            self.batches.append({k: batch[k].clone() for k in keys})

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.metrics.append(dict(trainer.callback_metrics))

    cfg = short_grpo_config(model, data, "algorithm.adv_estimator=remax", f"algorithm.reward.name={REWARD}",
                            "algorithm.rollout.n=2")
    record = Record()
    trainer = Trainer(devices=dist.get_world_size(), max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root, val_check_interval=None,
                      callbacks=[record], seed=7)
    trainer.fit(GRPO(cfg.algorithm), datamodule=PromptDataModule(cfg.data, load_tokenizer(model)))
    return {"batches": record.batches, "metrics": record.metrics}


def _samples(batch: dict) -> dict[tuple, tuple[list[int], float, float, list[float]]]:
    """``{(prompt, response) ids: (prompt ids, reward, baseline, advantages on the response)}``."""
    out = {}
    for i, (p, n) in enumerate(zip(batch[schema.PROMPT_LEN].tolist(), batch[schema.SEQ_LEN].tolist())):
        ids = batch[schema.INPUT_IDS][i, :n].tolist()
        adv = batch[schema.ADVANTAGES][i][batch[schema.RESPONSE_MASK][i].bool()].tolist()
        reward, baseline = batch[schema.TOKEN_LEVEL_REWARDS][i].sum(), batch[schema.REWARD_BASELINES][i]
        out[tuple(ids)] = (ids[:p], float(reward), float(baseline), adv)
    return out


@pytest.mark.slow
def test_remax_steps_at_dp1_and_dp2_use_the_greedy_baseline_and_agree(tmp_path):
    assets = make_assets(tmp_path / "assets")
    args = (str(assets / "model"), str(assets / "data"))
    from verl_trainer.testing import run_distributed

    one = run_distributed(_remax_fit, 1, *args, str(tmp_path / "dp1"), timeout=600)[0]
    two = run_distributed(_remax_fit, 2, *args, str(tmp_path / "dp2"), timeout=600)
    first = _samples(one["batches"][0])
    prompts = sorted({tuple(p) for p, *_ in first.values()})
    greedy = HFRollout(RolloutConfig(n=1, max_new_tokens=4), args[0]).generate(
        [{"input_ids": list(p), "index": i} for i, p in enumerate(prompts)], do_sample=False)
    want = {p: text_reward("", t, None) for p, t in zip(prompts, greedy[RESPONSE_TEXT])}  # initial weights
    assert len(set(want.values())) > 1  # the check can tell prompts apart
    for prompt, reward, baseline, adv in first.values():
        assert baseline == pytest.approx(want[tuple(prompt)], abs=1e-6)
        assert adv == pytest.approx([reward - baseline] * len(adv), abs=1e-6)
    for step in range(2):
        run = _samples(one["batches"][step])
        merged = {**_samples(two[0]["batches"][step]), **_samples(two[1]["batches"][step])}
        assert merged.keys() == run.keys() and len(run) == 8  # 4 prompts x n=2, no greedy row trained
        for key, (_, reward, baseline, adv) in run.items():
            assert merged[key][1:3] == pytest.approx((reward, baseline), abs=1e-5), (step, key)
            assert merged[key][3] == pytest.approx(adv, abs=1e-5)
        want_m, got = one["metrics"][step], two[0]["metrics"][step]
        for key in ("reward/baseline_mean", "reward/mean", "actor/pg_loss", "actor/grad_norm"):
            assert got[key] == pytest.approx(want_m[key], rel=1e-4, abs=1e-5), (step, key)
    means = [float(b) for _, _, b, _ in first.values()]
    assert one["metrics"][0]["reward/baseline_mean"] == pytest.approx(sum(means) / len(means), abs=1e-5)


def _remax_one_step_off(model: str, data: str, root: str) -> dict:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import PromptDataModule
    from verl_trainer.callbacks import Callback
    from verl_trainer.data.schema import prompt_token_lists
    from verl_trainer.models.loading import load_tokenizer

    class Record(Callback):
        def __init__(self) -> None:
            self.prompts: list = []
            self.baselines: list = []
            self.metrics: list[dict] = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            self.prompts.append([{"input_ids": ids, "index": i} for i, ids in
                                 zip(batch[schema.UID].tolist(), prompt_token_lists(batch))])

        def on_rollout_end(self, trainer, module, batch) -> None:
            self.baselines.append(batch[schema.REWARD_BASELINES].clone())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.metrics.append(dict(trainer.callback_metrics))

    cfg = short_grpo_config(model, data, "algorithm.adv_estimator=remax", f"algorithm.reward.name={REWARD}",
                            "algorithm.rollout.n=2", "algorithm.rollout.max_staleness=1")
    record = Record()
    trainer = Trainer(devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root, val_check_interval=None,
                      callbacks=[record], seed=7)
    module = GRPO(cfg.algorithm)
    trainer.fit(module, datamodule=PromptDataModule(cfg.data, load_tokenizer(model)))
    newer = module.rollout.generate(record.prompts[1], do_sample=False)  # weights after step 1's update
    return {"prompts": record.prompts, "baselines": record.baselines, "metrics": record.metrics,
            "newer": list(newer[RESPONSE_TEXT])}


@pytest.mark.slow
def test_one_step_off_remax_takes_its_baseline_from_the_weights_that_sampled(tmp_path):
    """``max_staleness=1``: step 2 is sampled by the initial weights on the background thread, and so is
    its greedy baseline (not by the weights after step 1's update)."""
    from verl_trainer.testing import run_distributed

    assets = make_assets(tmp_path / "assets")
    model = str(assets / "model")
    run = run_distributed(_remax_one_step_off, 1, model, str(assets / "data"), str(tmp_path / "run"),
                          timeout=600)[0]
    assert [m["rollout/staleness"] for m in run["metrics"]] == [0.0, 1.0]
    assert run["metrics"][0]["actor/grad_norm"] > 0  # step 1 changed the weights
    rollout = HFRollout(RolloutConfig(n=1, max_new_tokens=4), model)  # the initial weights
    greedy = rollout.generate(run["prompts"][1], do_sample=False)
    want = torch.tensor([text_reward("", t, None) for t in greedy[RESPONSE_TEXT]])
    torch.testing.assert_close(run["baselines"][1], want.repeat_interleave(2))
    assert run["newer"] != list(greedy[RESPONSE_TEXT])  # the updated weights would have given others
