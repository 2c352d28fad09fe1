"""Helpers for testing verl-trainer code, shipped with the package so downstream users can use them."""

from verl_trainer.testing.ranks import (
    DistributedTestError,
    find_free_port,
    run_distributed,
    use_worker_pool,
)
from verl_trainer.testing.verl_names import VERL_MODULES, verl_module_aliases

__all__ = ["VERL_MODULES", "DistributedTestError", "find_free_port", "run_distributed", "use_worker_pool",
           "verl_module_aliases"]
