import pytest

from verl_trainer.models import load_tokenizer, make_tiny_model


@pytest.fixture(scope="session")
def rollout_model_path(tmp_path_factory) -> str:
    """A tiny qwen2 checkpoint (seed 0) for the rollout tests."""
    return make_tiny_model(tmp_path_factory.mktemp("rollout_tiny") / "m0", seed=0, max_position_embeddings=64)


@pytest.fixture(scope="session")
def other_model_path(tmp_path_factory) -> str:
    """The same architecture with different weights (seed 1)."""
    return make_tiny_model(tmp_path_factory.mktemp("rollout_tiny") / "m1", seed=1, max_position_embeddings=64)


@pytest.fixture(scope="session")
def tokenizer(rollout_model_path):
    return load_tokenizer(rollout_model_path)


@pytest.fixture
def prompt_items(tokenizer) -> list[dict]:
    texts = [("3+4=", "7"), ("12+30=", "42"), ("5*5=", "25")]
    return [
        {"input_ids": tokenizer.encode(q, add_special_tokens=False), "index": 10 + i, "ground_truth": a,
         "data_source": "arithmetic", "extra_info": {"i": i}}
        for i, (q, a) in enumerate(texts)
    ]
