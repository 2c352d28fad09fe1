"""``Trainer.check``: a run's settings checked before any process starts or any model loads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verl_trainer.engine.config import EngineSpec
from verl_trainer.engine.lora_files import check_adapters

if TYPE_CHECKING:
    from verl_trainer.module import TrainingModule
    from verl_trainer.training.strategy import Strategy

__all__ = ["preflight_check"]


def preflight_check(strategy: Strategy, precision: str, seed: int | None, world_size: int,
                    module: TrainingModule, datamodule: Any = None) -> int:
    """Resolve every engine spec with the run's strategy, check adapters and data; returns the DP size.

    Args:
        strategy: The run's engine backend and topology.
        precision: The run's precision (``"32-true"``, ...).
        seed: The run's seed (``None``: unseeded).
        world_size: Processes of the run (of which ``module.training_world_size`` train, where the module
            has that method).
        module: The module whose ``configure_engines`` and ``check_data`` are checked.
        datamodule: Checked with ``check(dp_size)`` when it has one.

    Raises:
        ValueError: The first problem found, naming the setting, its value and the fix.
    """
    sizer = getattr(module, "training_world_size", None)
    world_size = sizer(world_size) if callable(sizer) else world_size
    specs = module.configure_engines()
    strategy.check_mesh_sizes(specs, precision, seed)  # one (dp, sp | tp) mesh for all
    configs = [strategy.engine_config(spec.config, precision, seed)
               for spec in specs.values() if isinstance(spec, EngineSpec)]
    dp_size = configs[0].dp_size(world_size) if configs else world_size
    check_adapters(specs)
    if datamodule is not None and callable(getattr(module, "check_data", None)):
        module.check_data(datamodule)  # the module's settings against the data's (mini-batch vs batch)
    if datamodule is not None and callable(getattr(datamodule, "check", None)):
        datamodule.check(dp_size)
    return dp_size
