"""The asynchronous rollout (``algorithm.rollout.max_staleness``, ``async_rollout.py``).

* ``max_staleness=0`` is the synchronous run: same code path (no background generation), same metrics
  and bitwise the same weights as a run whose config has no such key;
* ``max_staleness=1``: step 1 equals the synchronous step 1; later steps train on responses sampled with
  the weights of the step before (checked against a fresh rollout holding those weights), staleness 1;
* ``max_staleness=2`` at dp=1 and dp=2: staleness 0, 1, 2, 2; step 3 is sampled by the initial weights
  (a fresh rollout gives the same tokens); the version fields tag every sample and response token; the
  two dp sizes give the same tokens and weights to 2e-6; a failing rollout thread on dp rank 1 makes both
  ranks raise, naming rank 1 (no hang); a run resumed from step 2 with the queue in its checkpoint
  trains the same samples and ends with bitwise the same metrics and weights as the run that wrote it,
  without and with partial rollouts; the queue's state loads pickle-free;
* unsupported combinations are refused before any model loads;
* (slow) at 2 gloo ranks the demo task's reward rises with ``max_staleness=1``; resumed from step 15, step
  16 is trained from the checkpoint's queue (staleness 1, the first run's reward, length and loss).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.algorithms.short_grpo import (
    ROOT,
    StepRecord,
    make_varied_reward_assets,
    short_grpo_config,
)
from verl_trainer.testing import run_distributed

STEPS = 3
VERSION_KEYS = ("policy_version", "token_policy_version")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_varied_reward_assets(tmp_path_factory.mktemp("one_step_off"))


def _grpo_fit(model: str, data: str, root: str, *overrides: str, devices: int = 1, steps: int = STEPS,
              checkpoint_every: int | None = None, ckpt_path: str | None = None,
              val_every: int | None = None) -> dict:
    """A short GRPO fit; per step: the prompt batch, the rollout batch and the logged metrics."""
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.callbacks import ModelCheckpoint
    from verl_trainer.models.loading import load_tokenizer

    class Record(StepRecord):
        def __init__(self) -> None:
            super().__init__()
            self.micro: list = []

        def on_micro_batches(self, trainer, module, micro_batches) -> None:  # after balancing and splitting
            keys = (*VERSION_KEYS, "prompt_len", "response_len")
            self.micro.append([{k: mb[k].clone() for k in keys if k in mb.keys()} for mb in micro_batches])

    cfg = short_grpo_config(model, data, f"algorithm.reward.name={Path(model).parent / 'reward.py'}:length",
                            *overrides)
    record = Record()
    every = checkpoint_every
    checkpoints = [ModelCheckpoint(every_n_train_steps=every, keep_last_k=None)] if every else []
    trainer = Trainer(devices=devices, max_steps=steps, logger=False, enable_checkpointing=bool(checkpoints),
                      enable_progress_bar=False, default_root_dir=root, val_check_interval=val_every,
                      callbacks=[record, *checkpoints], seed=7)
    module = GRPO(cfg.algorithm)
    trainer.fit(module, datamodule=PromptDataModule(cfg.data, load_tokenizer(model)), ckpt_path=ckpt_path)
    return {"record": record, "module": module, "config": cfg.algorithm, "root": root,
            "params": {n: t.detach().clone() for n, t in module.actor.get_per_tensor_param()}}


def _without_timing(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith("timing/")}


def _staleness_zero_is_the_synchronous_run(assets: Path, tmp_path: Path) -> None:
    args = (str(assets / "model"), str(assets / "data"))
    plain = _grpo_fit(*args, str(tmp_path / "plain"))
    zero = _grpo_fit(*args, str(tmp_path / "zero"), "algorithm.rollout.max_staleness=0")
    partial = _grpo_fit(*args, str(tmp_path / "partial"), "algorithm.rollout.max_staleness=0",
                        "algorithm.rollout.partial_rollout=true", "algorithm.rollout.partial_chunk_tokens=1")
    assert partial["module"].async_rollout is None  # nothing in flight at an update: the synchronous run
    for a, b in zip(plain["record"].rollouts, partial["record"].rollouts, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])
    for a, b in zip(plain["record"].metrics, partial["record"].metrics, strict=True):
        assert _without_timing(a) == _without_timing(b)
    for name, tensor in plain["params"].items():
        assert torch.equal(partial["params"][name], tensor), name
    assert zero["module"].async_rollout is None and plain["module"].async_rollout is None  # the same path
    assert plain["config"] == zero["config"]
    assert all(m["actor/grad_norm"] > 0 for m in plain["record"].metrics)  # every step changes the weights
    for a, b in zip(plain["record"].metrics, zero["record"].metrics, strict=True):
        assert _without_timing(a) == _without_timing(b)
        assert "rollout/staleness" not in b and "timing/idle_s" not in b  # nothing added to the sync run
    for name, tensor in plain["params"].items():
        assert torch.equal(zero["params"][name], tensor), name


def _staleness_one_samples_with_the_weights_of_the_step_before(assets: Path, tmp_path: Path) -> None:
    from verl_trainer.data import schema
    from verl_trainer.rollout import HFRollout

    args = (str(assets / "model"), str(assets / "data"))
    sync = _grpo_fit(*args, str(tmp_path / "sync"))
    one = _grpo_fit(*args, str(tmp_path / "one"), "algorithm.rollout.max_staleness=1")
    metrics = one["record"].metrics
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0]
    assert all(m["timing/idle_s"] <= m["timing/step_s"] for m in metrics)
    first_sync, first_one = _without_timing(sync["record"].metrics[0]), _without_timing(metrics[0])
    async_keys = ("rollout/staleness", "rollout/tokens_at", "rollout/queued")
    for key in [k for k in first_one if k.startswith(async_keys)]:
        first_one.pop(key)
    assert first_one == first_sync  # step 1 generates now, with the initial weights: the same step
    assert abs(metrics[0]["rollout_corr/log_prob_abs_diff_max"]) < 1e-4
    assert metrics[0]["actor/grad_norm"] > 0
    assert metrics[1]["rollout_corr/log_prob_abs_diff_max"] > 1e-3  # trained by weights one update newer
    # step 2's responses are exactly what the initial weights sample (step 1 trained meanwhile)
    prompts, trained = one["record"].prompts[1], one["record"].rollouts[1]
    fresh = HFRollout(one["config"].rollout, str(assets / "model"))
    again = fresh.generate(prompts.clone(), step=1, prompt_index=prompts[schema.UID].clone())
    assert torch.equal(again[schema.INPUT_IDS], trained[schema.INPUT_IDS])
    torch.testing.assert_close(again[schema.ROLLOUT_LOG_PROBS], trained[schema.ROLLOUT_LOG_PROBS])
    assert not one["module"].async_rollout.queue  # the last step reads nothing ahead
    assert not all(torch.equal(one["params"][n], t) for n, t in sync["params"].items())


def _by_prompt(batch) -> dict:
    """Prompt + response token ids -> the version fields of the real samples with those tokens."""
    from verl_trainer.algorithms.async_rollout import POLICY_VERSION, TOKEN_POLICY_VERSION
    from verl_trainer.data import schema

    out = {}
    for row in range(batch.batch_size[0]):
        if bool(batch[schema.IS_PADDING][row]) if schema.IS_PADDING in batch.keys() else False:
            continue
        start, length = int(batch[schema.PROMPT_LEN][row]), int(batch[schema.RESPONSE_LEN][row])
        ids = tuple(batch[schema.INPUT_IDS][row, : start + length].tolist())
        out.setdefault(ids, []).append((int(batch[POLICY_VERSION][row]),
                                        tuple(batch[TOKEN_POLICY_VERSION][row].tolist()), start, length))
    return out


def _staleness_two(assets: Path, tmp_path: Path) -> dict:
    """k=2, 4 steps at this process group's dp size; at dp=1 also the resume runs; at dp=2 a failing rank."""
    import torch.distributed as dist

    from verl_trainer.algorithms.async_rollout import POLICY_VERSION, RolloutWorkerError
    from verl_trainer.data import schema
    from verl_trainer.rollout import HFRollout

    dp = dist.get_world_size()
    args = (str(assets / "model"), str(assets / "data"))
    two = _grpo_fit(*args, str(tmp_path / f"two_dp{dp}"), "algorithm.rollout.max_staleness=2", devices=dp,
                    steps=4,
                    checkpoint_every=2 if dp == 1 else None)
    for step, micro in enumerate(two["record"].micro):  # the fields reach the update's micro-batches
        assert micro
        for mb in micro:
            for row in range(mb["policy_version"].shape[0]):
                start, length = int(mb["prompt_len"][row]), int(mb["response_len"][row])
                tokens = mb["token_policy_version"][row]
                assert (tokens[start: start + length] == mb["policy_version"][row]).all()
                assert (tokens[start + length:] == -1).all() and (tokens[:start] == -1).all()
            assert ((mb["policy_version"] == step - min(step, 2)) | (mb["response_len"] == 0)).all()
    metrics, rollouts = two["record"].metrics, two["record"].rollouts
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 2.0, 2.0]
    assert [m["rollout/staleness_max"] for m in metrics] == [0.0, 1.0, 2.0, 2.0]
    for step, (m, batch) in enumerate(zip(metrics, rollouts, strict=True)):
        version = step - int(m["rollout/staleness"])
        real = schema.real_mask(batch)
        assert (batch[POLICY_VERSION][real] == version).all()
        for tagged in _by_prompt(batch).values():
            for v, per_token, start, length in tagged:
                assert per_token == (-1,) * start + (v,) * length + (-1,) * (len(per_token) - start - length)
        tokens = sum(m[f"rollout/tokens_at_staleness_{d}"] for d in range(3))
        assert tokens == m[f"rollout/tokens_at_staleness_{int(m['rollout/staleness'])}"] > 0
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    # step 3 (index 2) is sampled by version 0: the initial weights, although two updates ran meanwhile
    prompts = two["record"].prompts[2]
    fresh = HFRollout(two["config"].rollout, str(assets / "model"))
    fresh.data_rank = dist.get_rank()
    again = fresh.generate(prompts.clone(), step=2, prompt_index=prompts[schema.UID].clone())
    assert torch.equal(again[schema.INPUT_IDS], rollouts[2][schema.INPUT_IDS])
    out = {"samples": [_by_prompt(b) for b in rollouts], "params": two["params"]}
    if dp == 1:  # partial rollouts: tokens may come from newer weights than their sample's first token
        from verl_trainer.algorithms.async_rollout import TOKEN_POLICY_VERSION

        partial = ("algorithm.rollout.max_staleness=2", "algorithm.rollout.partial_rollout=true",
                   "algorithm.rollout.partial_chunk_tokens=1")
        part = _grpo_fit(*args, str(tmp_path / "partial"), *partial, steps=4, checkpoint_every=2)
        for step, (m, batch) in enumerate(zip(part["record"].metrics, part["record"].rollouts, strict=True)):
            assert m["actor/grad_norm"] > 0 and m["rollout/staleness_max"] <= min(step, 2)
            real = schema.real_mask(batch)
            versions, first = batch[TOKEN_POLICY_VERSION][real], batch[POLICY_VERSION][real]
            response = versions >= 0
            assert int(response.sum()) == int(batch[schema.RESPONSE_LEN][real].sum()) == sum(
                m[f"rollout/tokens_at_staleness_{d}"] for d in range(3))
            assert ((versions <= step) & (versions >= step - 2) | ~response).all()
            for row, cols in zip(versions, response, strict=True):  # never older along a response
                seq = row[cols]
                assert (seq[1:] >= seq[:-1]).all()
            assert torch.equal(first, torch.stack([row[cols][0] for row, cols in zip(versions, response)]))
        # resume from step 2, its queue (steps 2, 3 sampled by versions 0, 1) in the checkpoint: the same
        # samples, metrics and weights as the uninterrupted run (whose tokens dp=2, not checkpointed, shares)
        for run, overrides in ((two, ()), (part, partial)):
            step2 = Path(run["root"]) / "checkpoints" / "step_000002"
            resumed = _grpo_fit(*args, str(tmp_path / f"resumed_{len(overrides)}"),
                                "algorithm.rollout.max_staleness=2",
                                *overrides, steps=4, ckpt_path=str(step2))
            assert len(resumed["record"].rollouts) == 2
            for a, b in zip(run["record"].rollouts[2:], resumed["record"].rollouts, strict=True):
                for key in ("input_ids", "rollout_log_probs", *VERSION_KEYS):
                    assert torch.equal(a[key], b[key]), key
            for a, b in zip(run["record"].metrics[2:], resumed["record"].metrics, strict=True):
                assert _without_timing(a) == _without_timing(b)
            for name, tensor in run["params"].items():
                assert torch.equal(resumed["params"][name], tensor), name
    else:  # dp rank 1's rollout thread fails at step 3: both ranks raise, naming rank 1
        broken = tmp_path / "broken_rollout.py"
        if dist.get_rank() == 0:
            broken.parent.mkdir(parents=True, exist_ok=True)
            broken.write_text(
                "import torch.distributed as dist\n"
                "from verl_trainer.rollout import HFRollout\n\n"
                "class Broken(HFRollout):\n"
                "    def generate_token_ids(self, prompts, config, seeds):\n"
                "        self.seen = getattr(self, 'seen', 0) + 1\n"
                "        if self.seen == 3 and dist.get_rank() == 1:\n"
                "            raise RuntimeError('rollout worker killed')\n"
                "        return super().generate_token_ids(prompts, config, seeds)\n")
        dist.barrier()
        from verl_trainer.training.failure import RankFailedError

        named = r"step 3 failed on dp rank(\(s\) \[1\]| 1)"
        with pytest.raises((RolloutWorkerError, RankFailedError), match=named):
            _grpo_fit(*args, str(tmp_path / "broken"), "algorithm.rollout.max_staleness=2",
                      f"algorithm.rollout.name={broken}:Broken", devices=dp, steps=4)
    return out


def test_staleness_two_reproducible_at_dp1_and_dp2(assets, tmp_path):
    one = run_distributed(_staleness_two, 1, assets, tmp_path / "dp1", timeout=600)[0]
    two = run_distributed(_staleness_two, 2, assets, tmp_path / "dp2", timeout=600)
    for step, samples in enumerate(one["samples"]):
        joined: dict = {}
        for rank in two:
            for key, tagged in rank["samples"][step].items():
                joined.setdefault(key, []).extend(x[0] for x in tagged)
        assert {k: sorted(v) for k, v in joined.items()} == \
            {k: sorted(x[0] for x in v) for k, v in samples.items()}, step
    for name, tensor in one["params"].items():
        torch.testing.assert_close(two[0]["params"][name], tensor, atol=2e-6, rtol=0)


# Each runs its fits on one spawned rank: a Trainer in the pytest process would leave its process group
# and launch variables to every later test.
def test_staleness_zero_is_the_synchronous_run(assets, tmp_path):
    run_distributed(_staleness_zero_is_the_synchronous_run, 1, assets, tmp_path, timeout=600)


def test_staleness_one_samples_with_the_weights_of_the_step_before(assets, tmp_path):
    run_distributed(_staleness_one_samples_with_the_weights_of_the_step_before, 1, assets, tmp_path,
                    timeout=600)


@pytest.mark.parametrize(("overrides", "match"), [
    ({"max_staleness": -1}, r"max_staleness=-1 must be an int >= 0"),
    ({"max_staleness": 1.5}, r"max_staleness=1.5 must be an int >= 0"),
    ({"max_staleness": 1, "name": "verl_trainer.rollout.base:BaseRollout"}, "BaseRollout.*use name='hf'"),
    ({"max_staleness": 1, "multi_turn": {"enable": True}}, "multi_turn.enable=true"),
])
def test_unsupported_rollouts_are_refused(overrides, match):
    from verl_trainer.agents.config import MultiTurnConfig
    from verl_trainer.rollout import RolloutConfig

    if "multi_turn" in overrides:
        tools = ["verl_trainer.agents.builtin_tools:calculator"]
        overrides = {**overrides, "multi_turn": MultiTurnConfig(enable=True, tools=tools)}
    with pytest.raises(ValueError, match=match):
        RolloutConfig(**overrides)


def test_staleness_needs_the_importance_correction():
    from verl_trainer.algorithms.config import GRPOConfig
    from verl_trainer.core_algos import RolloutCorrectionConfig
    from verl_trainer.rollout import RolloutConfig

    with pytest.raises(ValueError, match="rollout_correction.level=token"):
        GRPOConfig(model_path="m", rollout=RolloutConfig(n=2, max_staleness=1))
    GRPOConfig(model_path="m", rollout=RolloutConfig(n=2, max_staleness=1),
               rollout_correction=RolloutCorrectionConfig(level="token"))


def _demo(cwd: Path, *overrides: str) -> dict[int, dict[str, float]]:
    """``recipes/grpo.py`` (the demo: tiny model, SFT warm start, arithmetic) at 2 processes in ``cwd``."""
    import os
    import subprocess
    import sys

    from tests.trainer.common import read_csv_metrics

    args = [sys.executable, str(ROOT / "recipes" / "grpo.py"), "trainer.devices=2", "trainer.logger=[csv]",
            "trainer.val_check_interval=null", "trainer.export_hf=false", "algorithm.rollout.max_staleness=1",
            "algorithm.rollout_correction.level=token", *overrides]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return read_csv_metrics(cwd / "outputs" / "grpo")


@pytest.mark.slow  # two recipe launches at 2 processes: about 45 s on the shared 2-core machine
def test_two_processes_one_step_off_train_the_demo_and_resume(tmp_path):
    steps = 30
    metrics = _demo(tmp_path, f"trainer.max_steps={steps}", "trainer.checkpoint.every_n_train_steps=15")
    staleness = [metrics[s]["rollout/staleness"] for s in range(1, steps + 1)]
    assert staleness == [0.0] + [1.0] * (steps - 1)
    first = sum(metrics[s]["reward/mean"] for s in range(1, 6)) / 5
    last = sum(metrics[s]["reward/mean"] for s in range(steps - 4, steps + 1)) / 5
    assert last > first + 0.02, (first, last)  # measured: 0.231 -> 0.295
    assert all(metrics[s]["timing/idle_s"] < metrics[s]["timing/step_s"] for s in range(2, steps + 1))
    # resume from step 15 at 2 processes: step 16's group, queued with version 14, comes from the checkpoint
    ckpt = tmp_path / "outputs" / "grpo" / "checkpoints" / "step_000015"
    resumed = _demo(tmp_path, "trainer.max_steps=17", "trainer.checkpoint.every_n_train_steps=15",
                    f"trainer.ckpt_path={ckpt}")
    assert [resumed[s]["rollout/staleness"] for s in (16, 17)] == [1.0, 1.0]
    for key in ("reward/mean", "response_length/mean", "actor/pg_loss"):
        assert resumed[16][key] == metrics[16][key], key


def test_queued_groups_round_trip_through_a_pickle_free_file(tmp_path):
    from tensordict import NonTensorStack, TensorDict

    from verl_trainer.data.batch_state import batch_from_state, batch_state
    from verl_trainer.utils.safe_load import safe_torch_load

    batch = TensorDict({"input_ids": torch.arange(6).view(2, 3), "rollout_log_probs": torch.rand(2, 3)}, [2])
    batch["ground_truth"] = NonTensorStack.from_list(["4", {"answer": [1, 2.5], "hint": None}])
    torch.save({"queue": batch_state(batch)}, tmp_path / "state.pt")
    back = batch_from_state(safe_torch_load(tmp_path / "state.pt")["queue"])
    assert torch.equal(back["input_ids"], batch["input_ids"])
    assert torch.equal(back["rollout_log_probs"], batch["rollout_log_probs"])
    assert back["ground_truth"].tolist() == ["4", {"answer": [1, 2.5], "hint": None}]
    batch["extra_info"] = NonTensorStack.from_list([object(), object()])
    with pytest.raises(ValueError, match="entry 'extra_info' cannot be stored as plain data.*not JSON data"):
        batch_state(batch)
