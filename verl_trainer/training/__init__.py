"""The Trainer's parts behind :class:`verl_trainer.Trainer`.

``arguments`` (defaults, checks, the callbacks' order), ``lightning_compat`` (Lightning's names, habits,
attributes and data arguments), ``preflight`` (``Trainer.check``), ``progress`` (step, epoch, loader
position, stop flags), ``fit_loop`` (the training loop, which owns the progress), ``evaluation``
(validation, sanity check, test, predict), ``checkpoint`` (writing and restoring a run's checkpoint),
``resume_check`` and ``run_inputs`` (what a resume is checked against), ``logging`` (the metric state),
``loggers`` (CSV, wandb, TensorBoard, MLflow), ``launch`` (starting or joining the process world),
``failure`` (ending every rank on a crash), ``strategy`` (the engine backend and the run's topology; a
floor below the other parts in ``docs/architecture.md``'s layer table: it imports no module of this
package).
"""
