"""Trained models out: standard HF directories from engines and from saved checkpoints.

* ``engine.save_hf(path)`` (every engine; its export part, ``engine/hf_export.py``) and
  ``ModelCheckpoint(save_hf=True)`` write through :func:`save_hf_model` (``models/hf_dir.py``, below the
  engine, re-exported here);
* ``python -m verl_trainer.export CKPT_DIR OUT_DIR`` converts a saved checkpoint on one process
  (``verl_trainer.export.convert.convert_checkpoint``: an entry point above the engine, whose checkpoint
  format it reads, so it is imported from its own module, not re-exported here);
* :class:`SafetensorsShardWriter` (``models/safetensors_shards.py``) writes the weights, one shard in memory
  at a time.
"""

from verl_trainer.models.hf_dir import HFLayout, save_hf_model
from verl_trainer.models.safetensors_shards import SafetensorsShardWriter

__all__ = ["HFLayout", "SafetensorsShardWriter", "save_hf_model"]
