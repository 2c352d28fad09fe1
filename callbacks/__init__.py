"""Callbacks for :class:`verl_trainer.Trainer`, installed as ``verl_trainer.callbacks``.

The folder sits at the repository root and is mapped onto ``verl_trainer.callbacks`` by setup.py.

Built-ins: :class:`MetricReduction` (on by default, always first), :class:`ProgressBar` (on by default),
:class:`ModelCheckpoint` (on by default, always last), :class:`LearningRateMonitor`,
:class:`ThroughputMonitor`, :class:`EarlyStopping`, :class:`Timer` (Lightning's arguments),
:class:`SequenceBalancing` (``on_before_update``; it exchanges samples over
``trainer.dp_group``), :class:`RayTrainReport` (each checkpoint to Ray Train, from every rank; resume from
``ray.train.get_checkpoint()``; needs the ``ray`` extra). Hooks receive the trainer and the module typed
as :class:`CallbackTrainer` and :class:`CallbackModule`: what a callback may use of them.
"""

from verl_trainer.callbacks.base import HOOK_NAMES, Callback
from verl_trainer.callbacks.contract import CallbackModule, CallbackTrainer
from verl_trainer.callbacks.early_stopping import EarlyStopping
from verl_trainer.callbacks.lr_monitor import LearningRateMonitor
from verl_trainer.callbacks.metric_reduction import MetricReduction
from verl_trainer.callbacks.model_checkpoint import ModelCheckpoint
from verl_trainer.callbacks.progress import ProgressBar
from verl_trainer.callbacks.ray_train import RayTrainReport
from verl_trainer.callbacks.sequence_balancing import SequenceBalancing
from verl_trainer.callbacks.throughput import ThroughputMonitor
from verl_trainer.callbacks.timer import Timer

__all__ = [
    "HOOK_NAMES",
    "Callback",
    "CallbackModule",
    "CallbackTrainer",
    "EarlyStopping",
    "LearningRateMonitor",
    "MetricReduction",
    "ModelCheckpoint",
    "ProgressBar",
    "RayTrainReport",
    "SequenceBalancing",
    "ThroughputMonitor",
    "Timer",
]
