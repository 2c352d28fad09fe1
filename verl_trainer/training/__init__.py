"""The Trainer's parts behind :class:`verl_trainer.Trainer`.

``loops`` (fit / validation loops, checkpoint save and restore), ``data`` (sharding and resumable
positions), ``checkpoint`` (directory layout, "last"), ``failure`` (ending every rank on a crash).
"""
