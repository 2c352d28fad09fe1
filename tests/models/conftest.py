import pytest

from verl_trainer.models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_paths(tmp_path_factory) -> dict[str, str]:
    """One tiny checkpoint per architecture, written once per session."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(root / arch, arch=arch, seed=0) for arch in ("qwen2", "llama")}
