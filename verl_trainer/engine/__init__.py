"""The engine layer: ``EngineRegistry``, ``BaseEngine`` and the backends (docs/design.md §4).

Importing this package registers the built-in engines. Optional backends are imported inside
``try/except ImportError`` so a machine without their package (e.g. deepspeed) imports fine; their
names are then ``None`` here, and asking the registry for them says which extra installs them.
"""

from __future__ import annotations

from verl_trainer.core_algos.aggregation import GlobalBatchInfo
from verl_trainer.engine.base import BaseEngine, LossFunction
from verl_trainer.engine.config import EngineConfig, OptimConfig
from verl_trainer.engine.fsdp import FSDPEngine
from verl_trainer.engine.registry import EngineRegistry, MissingBackendError

try:
    from verl_trainer.engine.deepspeed import DeepSpeedEngine
except ImportError:  # deepspeed not installed: `pip install 'verl-trainer[deepspeed]'`
    DeepSpeedEngine = None  # type: ignore[assignment,misc]

try:
    from verl_trainer.engine.torchtitan import TorchTitanEngine
except ImportError:  # torchtitan not installed: `pip install 'verl-trainer[torchtitan]'`
    TorchTitanEngine = None  # type: ignore[assignment,misc]

try:
    from verl_trainer.engine.megatron import MegatronEngine
except ImportError:  # megatron-core not installed: `pip install 'verl-trainer[megatron]'`
    MegatronEngine = None  # type: ignore[assignment,misc]

__all__ = [
    "BaseEngine",
    "DeepSpeedEngine",
    "EngineConfig",
    "EngineRegistry",
    "FSDPEngine",
    "GlobalBatchInfo",
    "LossFunction",
    "MegatronEngine",
    "MissingBackendError",
    "OptimConfig",
    "TorchTitanEngine",
]
