"""The stages of an RL step, each handed only what it uses, none the module.

A stage gets engines, configs, the rollout, the reward functions, the DP group: never the module.

One training step (:meth:`~verl_trainer.algorithms.rl.RLModule.training_step`) runs them in a straight
line::

    rollout (rollout.py)  →  score, advantages (signal.py)  →  on_rollout_end  →  select (signal.py)
      →  guard (guard.py)  →  update (update.py, on_before_update between its two halves)
      →  sync (rollout.py)  →  guard.finish

The scorer and the advantages stage share ``signal.py`` (the batch's learning signal), and the weight sync
shares ``rollout.py`` with the rollout stage (the rollout copy's life), so that a GRPO step enters no more
files than the step budget allows (``scripts/step_path.py``, ``tests/test_architecture.py``).

A feature is a part plugged into a stage, not a branch of the step: ReMax's greedy baseline is a rollout
part and a scoring part (``greedy_baseline.py``), the asynchronous rollout a wrapper of the rollout stage
(``async_rollout.py``), the reward model and the train-generation log scoring parts, DAPO's dynamic
sampling a selection part (``dapo.py``), PPO's critic an advantage part and an update part.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StepMetrics"]

StepMetrics = dict[str, Any]
"""A step's outputs as the stages gather them: name → a float, a tensor or a declared
:class:`~verl_trainer.metrics.Metric` (``{engine}_micro_batches``: the engines' per-micro-batch metrics)."""
