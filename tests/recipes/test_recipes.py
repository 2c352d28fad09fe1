"""Each recipe runs 2 steps at 2 ranks (fsdp2; PPO also with DeepSpeed), as `python recipes/<name>.py`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from tests.trainer.common import read_csv_metrics
from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
from verl_trainer.models.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def make_recipe_assets(base: Path, hidden_size: int = 32, num_attention_heads: int = 4,
                       num_key_value_heads: int = 2, task: ArithmeticTaskConfig | None = None) -> Path:
    """A tiny model and the arithmetic task under ``base`` (``model/``, ``data/``), for :func:`run_recipe`.

    ``task`` defaults to 64 training and 4 validation prompts.
    """
    make_tiny_model(base / "model", hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                    num_key_value_heads=num_key_value_heads, seed=1)
    task = task or ArithmeticTaskConfig(num_train=64, num_val=4, holdout_fraction=0.2)
    write_arithmetic_task(base / "data", task)
    return base


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_recipe_assets(tmp_path_factory.mktemp("recipe_assets"))


def run_recipe(name: str, assets: Path, root: Path, *overrides: str, timeout: float = 420
               ) -> dict[int, dict[str, float]]:
    args = [
        sys.executable, str(ROOT / "recipes" / f"{name}.py"),
        "trainer.devices=2", "trainer.max_steps=2", "trainer.val_check_interval=null", "trainer.logger=[csv]",
        f"trainer.default_root_dir={root}", f"model.path={assets / 'model'}",
        "model.make_tiny_if_missing=false",
        f"task.dir={assets / 'data'}", "task.write_if_missing=false", "data.train_batch_size=4",
        *overrides,
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert "before training" in proc.stdout and "after training" in proc.stdout
    metrics = read_csv_metrics(root)
    assert {1, 2} <= set(metrics), f"steps logged: {sorted(metrics)}"
    return metrics


RL_OVERRIDES = ("warm_start.enable=false", "algorithm.rollout.max_new_tokens=3",
                "algorithm.actor.engine.micro_batch_size_per_gpu=2", "algorithm.actor.ppo_mini_batch_size=2")


def test_sft_recipe(assets, tmp_path):
    metrics = run_recipe("sft", assets, tmp_path, "algorithm.engine.micro_batch_size_per_gpu=2",
                         f"export_dir={tmp_path / 'exported'}", "trainer.export_dtype=bfloat16")
    assert all("sft/loss" in metrics[s] for s in (1, 2))
    assert (tmp_path / "exported" / "config.json").exists()
    with safe_open(tmp_path / "exported" / "model.safetensors", "pt") as f:  # half the fp32 size
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    (hparams,) = tmp_path.glob("lightning_logs/version_*/hparams.yaml")  # the whole resolved config
    logged = yaml.safe_load(hparams.read_text())
    assert logged["trainer"]["max_steps"] == 2 and logged["trainer"]["export_dtype"] == "bfloat16"
    assert logged["data"]["train_batch_size"] == 4 and logged["model"]["path"] == str(assets / "model")
    assert logged["algorithm"]["engine"]["micro_batch_size_per_gpu"] == 2
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == ["step_000002"], checkpoints  # the directory's lock was released at the end


def test_grpo_recipe_with_kl_dapo_and_balancing(assets, tmp_path):
    metrics = run_recipe(
        "grpo", assets, tmp_path, *RL_OVERRIDES, "algorithm.rollout.n=2", "trainer.sequence_balancing=true",
        "algorithm.actor.loss.use_kl_loss=true", "algorithm.dynamic_sampling=true",
        "algorithm.reward.overlong_buffer.enable=true", "algorithm.reward.overlong_buffer.len=2",
        "algorithm.actor.loss.clip_ratio_high=0.28",
    )
    step = metrics[2]
    for key in ("reward/mean", "response_length/mean", "dapo/kept_samples", "reward/overlong_penalty"):
        assert key in step, sorted(step)
    assert "val/reward/mean" in metrics[max(metrics)]
    assert list(tmp_path.glob("lightning_logs/version_*/metrics.png"))


@pytest.mark.slow  # 36 s each at 2 ranks (measured 2026-12-03 while other jobs shared the 2 cores)
@pytest.mark.parametrize("estimator", ["remax", "reinforce_plus_plus"])
def test_grpo_recipe_runs_registered_estimators_by_name(assets, tmp_path, estimator):
    """ReMax (with its greedy baseline rollout) and REINFORCE++ from ``recipes/grpo.py`` (issue 30 item 3)."""
    metrics = run_recipe("grpo", assets, tmp_path, *RL_OVERRIDES, "algorithm.rollout.n=2",
                         f"algorithm.adv_estimator={estimator}")
    for step in (1, 2):
        assert "actor/pg_loss" in metrics[step] and "critic/advantages/mean" in metrics[step]
        assert ("reward/baseline_mean" in metrics[step]) == (estimator == "remax"), sorted(metrics[step])


TRL_REWARD = (
    '"""A TRL-signature reward: batched, completions are chat messages for chat prompts."""\n\n\n'
    "def short(prompts, completions, ground_truth, **kwargs):\n"
    "    return [1.0 / (1 + len(c)) for c in completions]\n"
)


def test_dr_grpo_recipe_with_trl_and_verl_rewards_weighted(assets, tmp_path):
    reward = tmp_path / "trl_reward.py"
    reward.write_text(TRL_REWARD)
    metrics = run_recipe("dr_grpo", assets, tmp_path, *RL_OVERRIDES, "algorithm.rollout.n=2",
                         "algorithm.actor.loss.loss_scale_factor=3", "data.val_files=null",
                         "trainer.enable_progress_bar=false",  # both crashed the recipes before
                         f"algorithm.reward.name=[{reward}:short,math]", "algorithm.reward.weights=[0.5,1.0]")
    for step in (1, 2):
        m = metrics[step]
        assert "actor/pg_loss" in m and "reward/short/mean" in m and "reward/math/mean" in m, sorted(m)
        assert m["reward/mean"] == pytest.approx(0.5 * m["reward/short/mean"] + m["reward/math/mean"])


@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed"])
def test_ppo_recipe(assets, tmp_path, strategy):
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
    kl = ["algorithm.use_kl_in_reward=true"] if strategy == "fsdp2" else []  # the reference engine too
    metrics = run_recipe("ppo", assets, tmp_path, *RL_OVERRIDES, f"trainer.strategy={strategy}",
                         "algorithm.rollout.n=2", "algorithm.critic.warmup_steps=1",
                         "algorithm.critic.engine.micro_batch_size_per_gpu=2", *kl)
    assert "critic/vf_loss" in metrics[1] and "actor/pg_loss" not in metrics[1]  # critic warm-up
    assert "critic/vf_loss" in metrics[2] and "actor/pg_loss" in metrics[2]
    assert ("actor/reward_kl_penalty" in metrics[2]) == bool(kl)


def test_grpo_single_update_reuses_its_log_probs_exactly(assets, tmp_path):
    """One actor update per step: skipping the old-log-prob forward gives the recomputed run's step."""
    single = (*RL_OVERRIDES[:3], "algorithm.actor.ppo_mini_batch_size=4", "algorithm.rollout.n=2",
              "algorithm.actor.loss.use_kl_loss=true", "trainer.sequence_balancing=true")
    runs = {reuse: run_recipe("grpo", assets, tmp_path / str(reuse), *single,
                              f"algorithm.actor.reuse_log_probs_on_policy={str(reuse).lower()}")
            for reuse in (False, True)}
    for step in (1, 2):
        recomputed, reused = runs[False][step], runs[True][step]
        assert reused["reward/mean"] == recomputed["reward/mean"]  # same samples at step 2: same update
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
            assert reused[key] == pytest.approx(recomputed[key], rel=1e-4, abs=1e-7), key
        assert reused["actor/ppo_kl"] == 0.0 and abs(recomputed["actor/ppo_kl"]) < 1e-6
        assert reused["actor/old_log_probs_reused"] == 1.0 and recomputed["actor/old_log_probs_reused"] == 0.0


@pytest.mark.slow
def test_grpo_lora_reference_in_the_actor_equals_a_separate_reference(assets, tmp_path):
    """LoRA GRPO (2 ranks): the KL to the adapter-free actor equals the KL to a separately loaded base.

    The actor starts from a saved random adapter (``lora_adapter_path``), so it differs from the base
    from the first step on, and the rollout must be sent its merged weights before the first generate.
    """
    from peft import LoraConfig, get_peft_model

    from verl_trainer.models.loading import load_causal_lm

    adapter = tmp_path / "random_adapter"
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                        task_type="CAUSAL_LM")
    get_peft_model(load_causal_lm(assets / "model"), config).save_pretrained(str(adapter))
    lora = (*RL_OVERRIDES, "algorithm.rollout.n=2", f"algorithm.actor.engine.lora_adapter_path={adapter}",
            "algorithm.actor.loss.use_kl_loss=true")
    runs = {in_actor: run_recipe("grpo", assets, tmp_path / str(in_actor), *lora,
                                 f"algorithm.ref.in_actor={str(in_actor).lower()}")
            for in_actor in (True, False)}
    for step in (1, 2):
        in_actor, separate = runs[True][step], runs[False][step]
        assert in_actor["reward/mean"] == separate["reward/mean"]
        for key in ("actor/kl_loss", "actor/pg_loss", "actor/grad_norm"):
            assert in_actor[key] == pytest.approx(separate[key], rel=1e-5, abs=1e-8), key
    assert all(runs[True][step]["actor/kl_loss"] > 1e-4 for step in (1, 2))  # the adapters are in use
    assert (tmp_path / "True" / "adapter" / "adapter_config.json").is_file()


TP_OVERRIDES = (*RL_OVERRIDES, "algorithm.rollout.n=2", "algorithm.actor.loss.use_kl_loss=true",
                "algorithm.actor.engine.tensor_model_parallel_size=2",
                "algorithm.ref.engine.tensor_model_parallel_size=2")


def test_grpo_recipe_tensor_parallel(assets, tmp_path):
    """devices=2 with tp=2 (dp=1): actor and reference split over 2 ranks; the rollout gets full weights."""
    metrics = run_recipe("grpo", assets, tmp_path, *TP_OVERRIDES)
    for step in (1, 2):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "reward/mean"):
            assert key in metrics[step], sorted(metrics[step])


@pytest.mark.slow
def test_grpo_recipe_tp2_equals_one_process(assets, tmp_path):
    """tp=2 on 2 ranks is dp=1: the same prompts, samples (seeded by the DP rank) and updates as 1 rank.

    An entropy bonus gives every step a gradient well above round-off (the tiny model's rewards, and so
    the advantages, are mostly 0, and the KL loss starts at its minimum).
    """
    entropy = ("algorithm.actor.calculate_entropy=true", "algorithm.actor.loss.entropy_coeff=0.01")
    tp = run_recipe("grpo", assets, tmp_path / "tp2", *TP_OVERRIDES, *entropy)
    one = run_recipe("grpo", assets, tmp_path / "one", *TP_OVERRIDES[:-2], *entropy, "trainer.devices=1")
    for step in (1, 2):
        assert tp[step]["reward/mean"] == one[step]["reward/mean"]  # the rollout got the same weights
        assert tp[step]["actor/grad_norm"] > 1e-5  # measured 3.7e-4 at step 1
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy"):
            assert tp[step][key] == pytest.approx(one[step][key], rel=1e-4, abs=1e-7), key


PP_OVERRIDES = (*RL_OVERRIDES, "algorithm.rollout.n=2", "algorithm.actor.loss.use_kl_loss=true",
                "algorithm.actor.engine.pipeline_model_parallel_size=2",
                "algorithm.ref.engine.pipeline_model_parallel_size=2")


@pytest.mark.slow
def test_grpo_recipe_pp2_equals_one_process(assets, tmp_path):
    """pp=2 on 2 ranks is dp=1: the two stages' run equals one process, the rollout gets full weights."""
    entropy = ("algorithm.actor.calculate_entropy=true", "algorithm.actor.loss.entropy_coeff=0.01")
    pp = run_recipe("grpo", assets, tmp_path / "pp2", *PP_OVERRIDES, *entropy)
    one = run_recipe("grpo", assets, tmp_path / "one", *PP_OVERRIDES[:-2], *entropy, "trainer.devices=1")
    for step in (1, 2):
        assert pp[step]["reward/mean"] == one[step]["reward/mean"]  # the rollout got the same weights
        assert pp[step]["actor/grad_norm"] > 1e-5
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy"):
            assert pp[step][key] == pytest.approx(one[step][key], rel=1e-4, abs=1e-7), key
    assert (tmp_path / "pp2" / "hf" / "model.safetensors").is_file()  # the final policy, exported whole
