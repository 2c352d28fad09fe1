"""Model paths: a local HF directory, or a hub id in the local HF cache (offline); never invented.

The hub case writes a tiny model into a temporary ``HF_HOME`` in the hub-cache layout
(``hub/models--org--name/snapshots/<rev>/`` + ``refs/main``) with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import pytest

from verl_trainer.models.loading import load_causal_lm, load_tokenizer
from verl_trainer.models.source import ModelNotFoundError, resolve_model_path
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.utils.hub_cache import looks_like_hub_id

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf_home"
    repo = home / "hub" / "models--tiny-org--tiny-chat"
    make_tiny_model(repo / "snapshots" / REV, hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_a_cached_hub_id_resolves_to_its_snapshot_and_loads(hf_home):
    snapshot = hf_home / "hub" / "models--tiny-org--tiny-chat" / "snapshots" / REV
    assert resolve_model_path("tiny-org/tiny-chat") == str(snapshot)
    model = load_causal_lm("tiny-org/tiny-chat")
    assert model.config.hidden_size == 16
    assert load_tokenizer("tiny-org/tiny-chat").decode([4, 5]) == "01"


def test_a_local_directory_is_used_as_it_is(tmp_path):
    path = make_tiny_model(tmp_path / "m", hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    assert resolve_model_path(path) == path


def test_missing_models_fail_with_the_path_the_kind_and_the_fix(hf_home, tmp_path):
    with pytest.raises(ModelNotFoundError) as hub:
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct", "model.path")
    message = str(hub.value)
    assert "model.path='Qwen/Qwen2.5-0.5B-Instruct'" in message and "looks like a hub id" in message
    assert str(hf_home / "hub") in message and "download it first" in message and "never downloads" in message

    with pytest.raises(ModelNotFoundError, match="does not look like a hub id.*local HF model directory"):
        resolve_model_path(str(tmp_path / "no" / "such" / "model"), "model.path")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        load_causal_lm(tmp_path / "empty")


@pytest.mark.parametrize(("path", "hub"), [("gpt2", True), ("Qwen/Qwen2.5-0.5B-Instruct", True),
                                           ("outputs/models/tiny", False), ("./model", False),
                                           ("../m", False), ("/abs/path", False), ("a/b/c", False)])
def test_hub_id_shape(path, hub):
    assert looks_like_hub_id(path) is hub
