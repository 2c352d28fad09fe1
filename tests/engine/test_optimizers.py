"""Optimizers by name (``optim.optimizer``, verl's key): each one on fsdp2 against plain PyTorch, a
non-AdamW one on FSDP1 and DeepSpeed, SGD's momentum through a checkpoint, and the refusal of a bad name."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import torch.distributed as dist

from verl_trainer.engine import OptimConfig
from verl_trainer.engine.optimizers import build_optimizer, resolve_optimizer
from verl_trainer.recipe_config.loading import load_config
from verl_trainer.recipe_config.recipes import GRPORecipeConfig
from verl_trainer.recipe_config.verl_keys import translate_overrides
from verl_trainer.testing.ranks import run_distributed

from .common import (
    assert_close_params,
    build_engine,
    collect_params,
    nll_loss,
    random_batch,
    rank_shard,
    reference_step,
    save_load_step_rank,
    tiny_model,
    train_steps_on_rank,
)

LR, WD = 1e-2, 0.01
SGD_MOMENTUM = OptimConfig(optimizer="sgd", lr=LR, weight_decay=WD,
                           override_optimizer_config={"momentum": 0.9, "nesterov": True})
MY_OPTIMIZER = '''import torch


class PlainSGD(torch.optim.SGD):
    """A user's optimizer class in a file (optim.optimizer=path/to/file.py:PlainSGD)."""
'''


def _plain_sgd_momentum(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9, nesterov=True, weight_decay=WD)


def _cases(file_spec: str) -> dict[str, tuple[OptimConfig, Any]]:
    """Name -> (the config, the plain-PyTorch optimizer it must equal)."""
    betas, eps = (0.9, 0.999), 1e-8
    return {
        "adamw": (OptimConfig(lr=LR, weight_decay=WD),
                  lambda p: torch.optim.AdamW(p, lr=LR, betas=betas, eps=eps, weight_decay=WD)),
        "adam": (OptimConfig(optimizer="adam", lr=LR, weight_decay=WD, betas=(0.8, 0.99)),
                 lambda p: torch.optim.Adam(p, lr=LR, betas=(0.8, 0.99), eps=eps, weight_decay=WD)),
        "sgd": (SGD_MOMENTUM, _plain_sgd_momentum),
        "file.py:Class": (OptimConfig(optimizer=file_spec, lr=LR, weight_decay=WD),
                          lambda p: torch.optim.SGD(p, lr=LR, weight_decay=WD)),
    }


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def file_spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_optim.py"
    path.write_text(MY_OPTIMIZER)
    return f"{path}:PlainSGD"


def _every_optimizer_rank(backend: str, model_path: str, batch: Any, optims: dict[str, OptimConfig]):
    shard = rank_shard(batch, dist.get_rank(), dist.get_world_size())
    out = {}
    for name, optim in optims.items():
        engine = build_engine(backend, "language_model", model_path, optim)
        with engine.train_mode():
            losses = [engine.train_batch(shard, nll_loss)["loss"] for _ in range(2)]
        optimizer = engine.optimizer
        out[name] = {"losses": losses, "params": collect_params(engine), "class": type(optimizer).__name__,
                     "fused": optimizer.defaults.get("fused")}
    return out if dist.get_rank() == 0 else None


def test_each_optimizer_name_on_fsdp2_matches_plain_pytorch(model_path, file_spec):
    cases = _cases(file_spec)
    batch = random_batch(8, seed=3)
    out = run_distributed(_every_optimizer_rank, 2, "fsdp2", model_path, batch,
                          {name: optim for name, (optim, _) in cases.items()})[0]
    classes = {name: out[name]["class"] for name in cases}
    assert classes == {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "file.py:Class": "PlainSGD"}
    assert out["adamw"]["fused"] is True  # the default is the fused AdamW it was before names existed
    for name, (optim, make) in cases.items():
        ref = reference_step(model_path, batch, optim, steps=2, make_optimizer=make)
        for step, loss in enumerate(out[name]["losses"]):
            assert abs(loss - ref["losses"][step]) <= 1e-5 * abs(ref["losses"][step]), name
        assert_close_params(out[name]["params"], ref["params"], rtol=5e-5)


def test_sgd_momentum_resumes_exactly_on_fsdp2(model_path, tmp_path):
    optim = SGD_MOMENTUM.replace(lr_scheduler="cosine", warmup_steps=1, total_training_steps=4)
    batches = [random_batch(8, seed=s) for s in (10, 11)]
    out = run_distributed(save_load_step_rank, 2, "fsdp2", model_path, batches, optim, str(tmp_path / "ckpt"))
    for r in out:
        assert r["exact"], "save -> load -> step differs from step -> step with SGD + momentum"
        assert r["state_keys"] == ["momentum_buffer"] and r["lrs"][0] == r["lrs"][1]


def _non_adamw_rank(backend: str, model_path: str, batch: Any, batches: list[Any], ckpt: str):
    trained = train_steps_on_rank(backend, "language_model", model_path, batch, SGD_MOMENTUM, steps=2)
    resumed = save_load_step_rank(backend, model_path, batches, SGD_MOMENTUM, ckpt)
    return {"trained": trained, "resumed": resumed}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed_stage_2"])
def test_sgd_momentum_on_fsdp1_and_deepspeed(backend, model_path, tmp_path):
    if backend.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed")
    batch, batches = random_batch(8, seed=3), [random_batch(8, seed=s) for s in (10, 11)]
    out = run_distributed(_non_adamw_rank, 2, backend, model_path, batch, batches, str(tmp_path / "ckpt"),
                          env={"DS_ACCELERATOR": "cpu"}, timeout=400)
    ref = reference_step(model_path, batch, SGD_MOMENTUM, steps=2, make_optimizer=_plain_sgd_momentum)
    assert_close_params(out[0]["trained"]["params"], ref["params"], rtol=5e-5)
    for r in out:
        assert r["resumed"]["exact"] and r["resumed"]["state_keys"] == ["momentum_buffer"]


def test_unknown_optimizer_is_refused_early_with_the_valid_names(tmp_path):
    with pytest.raises(ValueError, match=r"optim.optimizer='adamm'; registered: 'adam', 'adamw', "
                                         r"'adamw_torch', 'adamw_torch_fused', 'sgd'"):
        OptimConfig(optimizer="adamm")
    assert resolve_optimizer("RMSprop") is torch.optim.RMSprop  # verl: optimizer=<a torch.optim class>
    rmsprop = OptimConfig(optimizer="torch.optim:RMSprop", lr=1e-3, override_optimizer_config={"alpha": 0.9})
    built = build_optimizer([torch.zeros(2, requires_grad=True)], rmsprop)  # module:Class, kwargs through
    assert type(built) is torch.optim.RMSprop
    assert (built.defaults["alpha"], built.defaults["eps"]) == (0.9, 1e-8)
    assert resolve_optimizer("AdamW") is resolve_optimizer("adamw_torch") is torch.optim.AdamW  # verl, HF
    with pytest.raises(ValueError, match="not a torch.optim.Optimizer subclass"):
        OptimConfig(optimizer="torch.nn:Linear")
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg'"):
        OptimConfig(optimizer="AdamW8bit", optimizer_impl="no_such_pkg")
    with pytest.raises(ValueError, match="unexpected keyword argument 'momentun'.*override_optimizer_config"):
        OptimConfig(optimizer="sgd", override_optimizer_config={"momentun": 0.9})
    # a verl command line: its keys land on ours, an unknown name fails before anything is built
    verl = ["actor_rollout_ref.actor.optim.optimizer=SGD",
            "actor_rollout_ref.actor.optim.override_optimizer_config={momentum: 0.9}"]
    overrides, _ = translate_overrides(GRPORecipeConfig, verl)
    optim = load_config(GRPORecipeConfig, None, overrides).algorithm.actor.optim
    assert (optim.optimizer, optim.override_optimizer_config) == ("SGD", {"momentum": 0.9})
    ours = ["algorithm.actor.optim.optimizer=sgd",
            "algorithm.actor.optim.override_optimizer_config.nesterov=true",
            "algorithm.actor.optim.override_optimizer_config.momentum=0.5"]
    assert load_config(GRPORecipeConfig, None, ours).algorithm.actor.optim.override_optimizer_config == {
        "nesterov": True, "momentum": 0.5}
    with pytest.raises(ValueError, match="optim.optimizer='adamm'"):
        load_config(GRPORecipeConfig, None, ["algorithm.actor.optim.optimizer=adamm"])
