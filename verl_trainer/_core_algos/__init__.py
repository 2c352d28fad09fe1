"""Private implementation modules of :mod:`verl_trainer.core_algos` (import from there)."""
