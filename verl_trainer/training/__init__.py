"""The Trainer's parts behind :class:`verl_trainer.Trainer`.

``loops`` (fit / validation loops, checkpoint save and restore), ``data`` (sharding and resumable
positions), ``checkpoint`` (directory layout, "last"), ``failure`` (ending every rank on a crash),
``launch`` (starting or joining the process world), ``loggers`` (CSV, wandb, TensorBoard, MLflow),
``plotting`` (training curves), ``strategy`` (the engine backend and the run's topology; a floor below
the other parts in ``docs/architecture.md``'s layer table: it imports no module of this package).
"""
