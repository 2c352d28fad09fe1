"""The "how to add a rollout backend" block of ``docs/rollout.md`` runs as written: the user's class, named
by its file (``algorithm.rollout.name=path/to/file.py:Class``, no library edit), samples what the HF
rollout samples cut at the first newline, and trains a short GRPO run."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.algorithms.short_grpo import make_assets, short_grpo_config
from verl_trainer.data import schema
from verl_trainer.rollout import ROLLOUT_REGISTRY, HFRollout, RolloutConfig, build_rollout, rollout_class
from verl_trainer.testing import run_distributed

DOC = Path(__file__).resolve().parents[2] / "docs" / "rollout.md"
CLASS = "NewlineStopRollout"


def doc_block(heading: str) -> str:
    """The first python block after ``heading`` in ``docs/rollout.md``."""
    text = DOC.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)


@pytest.fixture(scope="module")
def backend_file(tmp_path_factory) -> str:
    """The doc's block as a user's file; its registration is removed afterwards."""
    path = tmp_path_factory.mktemp("user_backend") / "my_rollout.py"
    path.write_text(doc_block("## How to add a rollout backend"))
    yield str(path)
    ROLLOUT_REGISTRY.pop("hf_newline", None)


def _newline_ids(rollout: HFRollout) -> set[int]:
    return set(rollout.tokenizer.encode("\n", add_special_tokens=False))


def _responses(batch, key: str = schema.INPUT_IDS) -> list[list]:
    """Per sample, ``batch[key]`` at its response tokens."""
    values, starts = batch[key], batch[schema.PROMPT_LEN].tolist()
    return [values[row, start: start + int(n)].tolist()
            for row, (start, n) in enumerate(zip(starts, batch[schema.RESPONSE_LEN].tolist()))]


def test_the_docs_backend_is_named_by_its_file_and_cuts_the_hf_samples_at_a_newline(
        backend_file, rollout_model_path, prompt_items):
    spec = f"{backend_file}:{CLASS}"
    config = RolloutConfig(name=spec, n=4, max_new_tokens=16, seed=5)  # the config loads the file
    cls = rollout_class(spec)
    assert issubclass(cls, HFRollout) and ROLLOUT_REGISTRY["hf_newline"] is cls  # its decorator ran once
    assert RolloutConfig(name="hf_newline").name == "hf_newline"

    mine = build_rollout(config, rollout_model_path)
    plain = build_rollout(RolloutConfig(n=4, max_new_tokens=16, seed=5), rollout_model_path)
    assert type(mine) is cls and type(plain) is HFRollout
    ours, theirs = mine.generate(prompt_items, step=0), plain.generate(prompt_items, step=0)
    stops, cut = _newline_ids(mine), 0
    log_probs = zip(_responses(ours, schema.ROLLOUT_LOG_PROBS), _responses(theirs, schema.ROLLOUT_LOG_PROBS))
    for a, b, (la, lb) in zip(_responses(ours), _responses(theirs), log_probs, strict=True):
        end = next((i + 1 for i, t in enumerate(b) if t in stops), len(b))
        assert a == b[:end] and la == lb[:end]  # the same samples (same seeds), ended at the first newline
        cut += end < len(b)
    assert cut > 0, "no sample had a newline to cut at: pick another seed"


def test_an_unknown_name_lists_the_registered_ones_and_the_other_forms():
    with pytest.raises(ValueError, match=r"rollout name='sglang' is unknown; registered: 'auto', 'hf'.*"
                                         r"'path/to/file.py:Class' naming a BaseRollout subclass"):
        RolloutConfig(name="sglang")
    with pytest.raises(ValueError, match=r"'verl_trainer.rollout:RolloutConfig' is .*not a subclass of "
                                         r"verl_trainer.rollout.BaseRollout"):
        RolloutConfig(name="verl_trainer.rollout:RolloutConfig")
    with pytest.raises(ValueError, match="file 'nope/mine.py' does not exist"):
        RolloutConfig(name="nope/mine.py:Mine")


def _fit(model: str, data: str, root: str, backend: str) -> dict:
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.callbacks import Callback
    from verl_trainer.models.loading import load_tokenizer

    cfg = short_grpo_config(model, data, f"algorithm.rollout.name={backend}",
                            "algorithm.rollout.max_new_tokens=16")
    seen: dict = {"responses": []}

    class Record(Callback):
        def on_rollout_end(self, trainer, module, batch) -> None:
            seen["responses"] += _responses(batch)
            seen["backend"] = type(module.rollout).__name__
            seen["stops"] = sorted(_newline_ids(module.rollout))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            seen["pg_loss"] = float(trainer.callback_metrics["actor/pg_loss"])

    trainer = Trainer(devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root, val_check_interval=None,
                      callbacks=[Record()], seed=3)
    trainer.fit(GRPO(cfg.algorithm), datamodule=PromptDataModule(cfg.data, load_tokenizer(model)))
    return {**seen, "step": trainer.global_step}


def test_grpo_trains_with_the_docs_backend_named_by_its_file(backend_file, tmp_path):
    assets = make_assets(tmp_path / "assets")
    out = run_distributed(_fit, 1, str(assets / "model"), str(assets / "data"), str(tmp_path / "run"),
                          f"{backend_file}:{CLASS}", timeout=600)[0]
    assert out["step"] == 2 and out["backend"] == CLASS and math.isfinite(out["pg_loss"])
    stops = set(out["stops"])
    assert all(t not in stops for r in out["responses"] for t in r[:-1])  # a newline only ends a response
    assert any(r and r[-1] in stops for r in out["responses"])  # and some did end at one


def test_registration_refuses_taken_and_reserved_names_and_non_backends():
    from verl_trainer.rollout import register_rollout

    class Other(HFRollout):
        pass

    with pytest.raises(ValueError, match="rollout backend 'hf' is already registered"):
        register_rollout("hf")(Other)
    for reserved in ("auto", "pkg.mod:Other"):
        with pytest.raises(ValueError, match="is reserved"):
            register_rollout(reserved)
    with pytest.raises(ValueError, match="not a subclass of verl_trainer.rollout.BaseRollout"):
        register_rollout("not_a_backend")(RolloutConfig)
    assert "not_a_backend" not in ROLLOUT_REGISTRY and ROLLOUT_REGISTRY["hf"] is HFRollout
