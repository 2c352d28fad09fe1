"""Building and using the in-process vLLM engine leaves training as it was: a training step's loss (which
draws its data from the global RNG) is bitwise the same, and so are the environment, the thread count
and ``torch.set_num_threads``. Its own process (CI runs each vllm test file alone): vLLM joins the process
group this test makes, as it joins a trainer's."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.engine.common import OPTIM, nll_loss, random_batch
from verl_trainer.engine import EngineConfig, EngineRegistry
from verl_trainer.models import load_tokenizer, make_tiny_model
from verl_trainer.rollout import RolloutConfig, build_rollout
from verl_trainer.testing.ranks import find_free_port

pytestmark = [pytest.mark.vllm, pytest.mark.own_process_group]
pytest.importorskip("vllm")


def step_loss(path: str, seed: int | None) -> float:
    """One optimizer step's loss on a batch drawn from the global RNG (as a shuffling sampler draws)."""
    if seed is not None:
        torch.manual_seed(seed)
    batch = random_batch(8, seed=int(torch.randint(0, 2**31 - 1, ())))
    engine = EngineRegistry.new("language_model", "fsdp2", EngineConfig(model_path=path), OPTIM)
    engine.initialize()
    with engine.train_mode():
        out = engine.train_batch(batch, nll_loss)
    return sum(m["loss"] for m in out["metrics"])


def test_a_training_step_is_unchanged_by_the_engine(tmp_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    path = make_tiny_model(tmp_path / "m", hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                           max_position_embeddings=64, seed=0)
    reference = step_loss(path, seed=0)
    assert step_loss(path, seed=1) != reference  # the loss depends on the global RNG

    env, threads, set_threads = dict(os.environ), torch.get_num_threads(), torch.set_num_threads
    rng = torch.manual_seed(7).get_state()
    config = RolloutConfig(name="vllm", n=2, max_new_tokens=4, seed=123, max_model_len=64)
    rollout = build_rollout(config, path)
    assert dict(os.environ) == env
    assert torch.get_num_threads() == threads and torch.set_num_threads is set_threads
    assert torch.equal(torch.get_rng_state(), rng)
    torch.manual_seed(0)
    assert step_loss(path, seed=None) == reference

    tok = load_tokenizer(path)
    actor = EngineRegistry.new("language_model", "fsdp2", EngineConfig(model_path=path), None)
    actor.initialize()
    rng = torch.manual_seed(7).get_state()
    rollout.generate([{"input_ids": tok.encode("3+4=", add_special_tokens=False), "index": 0}])
    assert rollout.update_weights(actor.get_per_tensor_param()) >= 1
    assert dict(os.environ) == env and torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), rng)
    torch.manual_seed(0)
    rollout.generate([{"input_ids": tok.encode("1+1=", add_special_tokens=False), "index": 1}])
    assert step_loss(path, seed=None) == reference
