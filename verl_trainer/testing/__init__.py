"""Helpers for testing verl-trainer code, shipped with the package so downstream users can use them."""

from verl_trainer.testing.distributed import DistributedTestError, find_free_port, run_distributed

__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]
