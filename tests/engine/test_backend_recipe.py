"""The backend recipe of ``docs/architecture.md`` runs as written and gives a working engine of both types."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from verl_trainer.engine import EngineConfig, EngineRegistry
from verl_trainer.engine.fsdp import FSDPEngine

from .common import (
    OPTIM,
    VALUE_OPTIM,
    assert_close_params,
    nll_loss,
    random_batch,
    reference_step,
    relative_error,
    tiny_model,
    value_loss,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def doc_block(heading: str) -> str:
    """The first python block after ``heading`` in ``docs/architecture.md``."""
    text = DOC.read_text()
    start = text.index(heading)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("recipe")))


@pytest.fixture
def mine():
    """The doc's ``MyEngine``, registered as backend ``mine``; unregistered afterwards."""
    namespace = {"shard": lambda model, topology: model}
    exec(compile(doc_block("**A backend.**"), str(DOC), "exec"), namespace)
    yield namespace["MyEngine"]
    for model_type in ("language_model", "value_model"):
        for device in ("cpu", "cuda"):
            EngineRegistry.unregister(model_type, "mine", device)


def test_the_real_engines_follow_the_recipe(mine):
    """The doc's class has the bases and the registration of the real engines."""
    assert mine.__mro__[1:] == FSDPEngine.__mro__[1:]
    assert EngineRegistry.get_engine_cls("value_model", "mine") is mine
    assert EngineRegistry.get_engine_cls("value_model", "fsdp2") is FSDPEngine


@pytest.mark.parametrize(("model_type", "loss", "optim"), [("language_model", nll_loss, OPTIM),
                                                          ("value_model", value_loss, VALUE_OPTIM)])
def test_a_recipe_backend_steps_as_plain_pytorch(mine, model_path, model_type, loss, optim):
    """Two micro-batches through the one loop, one optimizer step: plain PyTorch's loss, norm and weights."""
    batch = random_batch(6)
    ref = reference_step(model_path, batch, optim, model_type=model_type)
    engine = EngineRegistry.new(model_type, "mine", EngineConfig(model_path=model_path,
                                                                 micro_batch_size_per_gpu=3), optim)
    engine.initialize()
    assert isinstance(engine, mine) and engine.MODEL_TYPE == model_type and engine.lora is None
    with engine.train_mode():
        out = engine.train_batch(batch, loss)
    assert out["num_micro_batches"] == 2 and not out["step_skipped"]
    assert relative_error(torch.tensor(out["loss"]), torch.tensor(ref["losses"][0])) < 1e-5
    assert relative_error(torch.tensor(out["grad_norm"]), torch.tensor(ref["grad_norms"][0])) < 1e-5
    params = dict(engine.get_per_tensor_param())
    assert params.keys() == ref["params"].keys()
    assert_close_params(params, ref["params"])
