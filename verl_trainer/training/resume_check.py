"""What a checkpoint records about its run, and the check of a resume against it.

Every checkpoint's ``meta.json`` records the run's settings (:func:`run_metadata`): strategy, world
size, precision, seed, ``max_steps``, the engines, each engine's model architecture and the module's
config (flattened, with its sha256), and the run's inputs by content (``run_inputs.py``: the LoRA base
weights, the data files). A resume compares them with the current run before anything is
loaded (:func:`check_run_settings` before the engines are built, :func:`check_models` after) and
sorts every difference:

* **breaks the state** — a clear :class:`ResumeMismatchError` naming the setting, both values and the
  fix, on every rank together: another strategy (each backend has its own checkpoint format), another
  precision, another model architecture or LoRA layout, an engine the checkpoint lacks, another seed
  (the data order and every random state continue the checkpoint's run), another optimizer class
  (``optim.optimizer`` / ``optimizer_impl``: its state is another class's), another world size with
  DeepSpeed (its ZeRO partitions are saved per rank), other LoRA base weights, other training data.
* **applies, and is logged** — another world size with ``fsdp``/``fsdp2`` (DCP reshards the state;
  the data position is kept as a global sample count), another ``max_steps``, and every other config
  value: optimizer settings (lr, betas, weight decay, schedule) are put back into the restored
  optimizer and schedule (``engine.apply_optim_config``), the rest is read from the config each step.
  Rank 0 prints the list; :attr:`Trainer.resume_changes` holds it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from verl_trainer.engine.checkpoint_dirs import META_FILE
from verl_trainer.engine.registry import EngineRegistry
from verl_trainer.training import run_inputs

if TYPE_CHECKING:
    from verl_trainer.engine.base import BaseEngine
    from verl_trainer.module import TrainingModule
    from verl_trainer.training.strategy import Strategy

__all__ = [
    "ResumeMismatchError",
    "ResumingRun",
    "check_models",
    "check_run_settings",
    "flatten",
    "model_fingerprint",
    "read_meta",
    "run_metadata",
]

MODEL_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "tie_word_embeddings")
"""The HF config entries that shape the parameters (a checkpoint's tensors fit only this model)."""
STATE_KEYS = ("lora_rank", "target_modules")
"""Engine config entries (any engine) that change which parameters exist."""

OPTIMIZER_KEYS = ("optimizer", "optimizer_impl")
"""Optimizer config entries that change what the optimizer state holds (AdamW's moments, SGD's momentum)."""
OPTIMIZER_DEFAULTS = ("adamw", "torch.optim")
"""Their values in checkpoints written before they existed (absent there: AdamW was the only optimizer)."""


class ResumeMismatchError(ValueError):
    """The checkpoint cannot continue in this run: a setting that shapes its state differs."""


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"actor.optim.lr": 1e-3, ...}``: nested dicts flattened with dots, values as JSON gives them back."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(flatten(sub, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: json.loads(json.dumps(value, default=str))}


def model_fingerprint(engine: BaseEngine) -> dict[str, Any]:
    """The architecture of an engine's model: its type and the HF config entries in :data:`MODEL_KEYS`."""
    config = getattr(engine, "model_config", None)
    shape = {key: getattr(config, key, None) for key in MODEL_KEYS} if config is not None else {}
    text_config = getattr(config, "text_config", None)  # multimodal configs nest the language model
    if text_config is not None:
        shape.update({key: getattr(text_config, key) for key in MODEL_KEYS if hasattr(text_config, key)})
    return {"engine_type": getattr(engine, "MODEL_TYPE", type(engine).__name__), **shape}


class ResumingRun(Protocol):
    """What a resume check reads of a run (:class:`verl_trainer.Trainer` is one)."""

    strategy: Strategy
    precision: str
    seed: int
    max_steps: int
    module: TrainingModule | None
    datamodule: Any

    @property
    def world_size(self) -> int:
        """Number of processes."""


def run_metadata(trainer: ResumingRun) -> dict[str, Any]:
    """The settings a checkpoint of ``trainer``'s run records in ``meta.json`` (plain JSON data)."""
    module = trainer.module
    hparams = flatten(dict(module.hparams)) if module is not None else {}
    return {
        "world_size": trainer.world_size,
        "strategy": trainer.strategy.backend,
        "precision": trainer.precision,
        "seed": trainer.seed,
        "max_steps": trainer.max_steps,
        "engines": list(module.engines) if module is not None else [],
        "models": {name: model_fingerprint(e) for name, e in module.engines.items()} if module else {},
        "hparams": hparams,
        "config_sha256": hashlib.sha256(json.dumps(hparams, sort_keys=True).encode()).hexdigest(),
        "base_weights": {name: fp for name, e in (module.engines.items() if module else [])
                         if (fp := run_inputs.base_weights_fingerprint(e)) is not None},
        "data": run_inputs.data_fingerprint(getattr(trainer, "datamodule", None)),
    }


def read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's ``meta.json`` (``{}`` when it has none: written before run settings were recorded).

    Raises:
        ResumeMismatchError: If the file exists but is not a JSON object.
    """
    file = Path(path) / META_FILE
    if not file.is_file():
        return {}
    try:
        meta = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ResumeMismatchError(f"cannot read the run settings of checkpoint {str(path)!r}: {exc}") from exc
    if not isinstance(meta, dict):
        raise ResumeMismatchError(f"{file} is not a JSON object")
    return meta


def _fix(path: Path) -> str:
    return (f"resume with the checkpoint's setting, or start a new run (another default_root_dir or "
            f"ModelCheckpoint dirpath) from exported weights instead of resuming {str(path)!r}")


def _mismatch(path: Path, what: str, saved: Any, now: Any, why: str) -> ResumeMismatchError:
    return ResumeMismatchError(
        f"cannot resume from {str(path)!r}: {what} is {now!r} in this run but {saved!r} in the checkpoint "
        f"({why}); {_fix(path)}"
    )


def check_run_settings(trainer: ResumingRun, path: Path, meta: dict[str, Any]) -> list[str]:
    """Compare the run's settings with the checkpoint's, before any engine is built.

    Args:
        trainer: The resuming trainer (its module set; engines not needed).
        path: The checkpoint directory (for messages).
        meta: Its :func:`read_meta`.

    Returns:
        The differences that apply, one line each (``"trainer.max_steps: 6 -> 8"``).

    Raises:
        ResumeMismatchError: For a difference that breaks the state (see the module docstring).
    """
    changes: list[str] = []
    strategy = trainer.strategy.backend
    if "strategy" in meta and meta["strategy"] != strategy:
        raise _mismatch(path, "strategy", meta["strategy"], strategy,
                        "each backend writes its own checkpoint format")
    if "precision" in meta and meta["precision"] != trainer.precision:
        raise _mismatch(path, "precision", meta["precision"], trainer.precision,
                        "the weights and optimizer state were kept in the checkpoint's precision")
    if "seed" in meta and meta["seed"] != trainer.seed:
        raise _mismatch(path, "seed", meta["seed"], trainer.seed,
                        "the data order and the random states continue the checkpoint's run")
    if "world_size" in meta and meta["world_size"] != trainer.world_size:
        reshardable = EngineRegistry.backends("RESHARDABLE_CHECKPOINTS")  # the backends declare it
        if strategy not in reshardable:
            raise _mismatch(path, "the world size", meta["world_size"], trainer.world_size,
                            f"{strategy} saves its partitioned state per rank; only "
                            f"{'/'.join(reshardable)} (DCP) checkpoints reshard")
        changes.append(f"world size: {meta['world_size']} -> {trainer.world_size} (DCP reshards the state)")
    if "max_steps" in meta and meta["max_steps"] != trainer.max_steps:
        changes.append(f"trainer.max_steps: {meta['max_steps']} -> {trainer.max_steps}")
    if isinstance(meta.get("data"), dict):
        now = run_inputs.data_fingerprint(getattr(trainer, "datamodule", None))
        applied, refusal = run_inputs.check_data(path, meta["data"], now)
        if refusal is not None:
            raise ResumeMismatchError(refusal)
        changes += applied
    saved = meta.get("hparams")
    if isinstance(saved, dict) and trainer.module is not None:
        now = flatten(dict(trainer.module.hparams))
        for key in sorted(set(saved) | set(now)):
            old, new = saved.get(key, "<absent>"), now.get(key, "<absent>")
            if old == new:
                continue
            if key.rsplit(".", 1)[-1] in STATE_KEYS:
                raise _mismatch(path, f"config {key}", old, new, "it changes which parameters the model has")
            other_class = old != "<absent>" or new not in OPTIMIZER_DEFAULTS
            if key.rsplit(".", 1)[-1] in OPTIMIZER_KEYS and other_class:
                raise _mismatch(path, f"config {key}", old, new,
                                "the checkpoint holds the other optimizer's state")
            changes.append(f"config {key}: {old!r} -> {new!r}")
    return changes


def check_models(path: Path, meta: dict[str, Any], engines: dict[str, BaseEngine]) -> None:
    """Compare the built engines with the checkpoint's: the same engines, the same architectures.

    Raises:
        ResumeMismatchError: Naming the engine and both values.
    """
    saved_engines = meta.get("engines")
    if isinstance(saved_engines, list):
        missing = sorted(set(engines) - set(saved_engines))
        if missing:
            raise ResumeMismatchError(
                f"cannot resume from {str(path)!r}: this run has engine(s) {missing} that the checkpoint has "
                f"no state for (it holds {sorted(saved_engines)}; e.g. a KL loss turned on adds 'ref'); "
                f"{_fix(path)}"
            )
    if isinstance(meta.get("base_weights"), dict):
        refusal = run_inputs.check_base_weights(path, meta["base_weights"], engines)
        if refusal is not None:
            raise ResumeMismatchError(refusal)
    for name, shape in (meta.get("models") or {}).items():
        if name not in engines:
            continue
        now = model_fingerprint(engines[name])
        keys = [k for k in sorted(set(shape) | set(now)) if shape.get(k) != now.get(k)]
        if keys:
            listed = ", ".join(f"{k}: {shape.get(k)!r} in the checkpoint, {now.get(k)!r} now" for k in keys)
            raise ResumeMismatchError(
                f"cannot resume from {str(path)!r}: engine {name!r} has another model than the checkpoint's "
                f"({listed}); resume with the checkpoint's model, or start a new run"
            )
