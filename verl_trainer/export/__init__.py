"""Trained models out: standard HF directories from engines and from saved checkpoints.

* ``engine.save_hf(path)`` (every engine; :meth:`~verl_trainer.engine.base.BaseEngine.save_hf`) and
  ``ModelCheckpoint(save_hf=True)`` write through :func:`save_hf_model` (``hf_dir.py``);
* ``python -m verl_trainer.export CKPT_DIR OUT_DIR`` converts a saved checkpoint on one process
  (:func:`convert_checkpoint`, ``convert.py``);
* :class:`SafetensorsShardWriter` (``shards.py``) writes the weights, one shard in memory at a time.
"""

from verl_trainer.export.hf_dir import HFLayout, save_hf_model
from verl_trainer.export.shards import SafetensorsShardWriter

__all__ = ["HFLayout", "SafetensorsShardWriter", "convert_checkpoint", "save_hf_model"]


def __getattr__(name: str):  # noqa: ANN202 - lazy: the converter imports the checkpoint readers
    if name == "convert_checkpoint":
        from verl_trainer.export.convert import convert_checkpoint

        return convert_checkpoint
    raise AttributeError(name)
