"""``Trainer.check``: a run's settings checked before any process starts or any model loads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verl_trainer.engine.config import EngineSpec
from verl_trainer.engine.lora_files import check_adapters

if TYPE_CHECKING:
    from verl_trainer.module import TrainingModule
    from verl_trainer.trainer import Trainer

__all__ = ["preflight_check"]


def preflight_check(trainer: Trainer, module: TrainingModule, datamodule: Any = None) -> int:
    """Resolve every engine spec with the trainer's strategy, check adapters and data; returns the DP size.

    Raises:
        ValueError: The first problem found, naming the setting, its value and the fix.
    """
    strategy, precision, seed = trainer.strategy, trainer.precision, trainer.seed
    specs = module.configure_engines()
    strategy.check_mesh_sizes(specs, precision, seed)  # one (dp, sp | tp) mesh for all
    configs = [strategy.engine_config(spec.config, precision, seed)
               for spec in specs.values() if isinstance(spec, EngineSpec)]
    dp_size = configs[0].dp_size(trainer.world_size) if configs else trainer.world_size
    check_adapters(specs)
    if datamodule is not None and callable(getattr(module, "check_data", None)):
        module.check_data(datamodule)  # the module's settings against the data's (mini-batch vs batch)
    if datamodule is not None and callable(getattr(datamodule, "check", None)):
        datamodule.check(dp_size)
    return dp_size
