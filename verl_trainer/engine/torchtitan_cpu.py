"""What torchtitan 0.3.0 lacks on CPU, supplied through its own configuration, only where the device is CPU.

Each is an upstream gap; on CUDA nothing here changes torchtitan's behaviour.

* **Attention kernel.** torchtitan's language models take ``"flex"``, ``"flex_flash"`` or ``"varlen"``
  (``config_utils.get_attention_config`` refuses ``"sdpa"``). FlexAttention has no CPU backward and
  ``varlen_attn`` needs CUDA and bf16/fp16, so on CPU every layer's ``inner_attention`` is torchtitan's own
  ``ScaledDotProductAttention`` (causal ``F.scaled_dot_product_attention``); the engine feeds it
  right-padded rows, one sample per row, where causal attention is exact for every real token. Upstream
  fix: accept ``"sdpa"`` for language models whose batches are not packed (one document per row).
* **Device mesh.** ``ParallelDims.build_mesh`` calls ``init_device_mesh(device_type, ...)`` with
  ``torchtitan.tools.utils.device_type``, which is ``"cuda"`` on a machine without an accelerator (its
  fallback). :func:`mesh_device_type` sets the module's ``device_type`` to ``"cpu"`` for the duration of
  the mesh build only. Upstream fix: a ``device_type`` argument to ``ParallelDims`` (or fall back to
  ``"cpu"`` when no accelerator is available).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torchtitan.distributed.parallel_dims as parallel_dims_module
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import get_attention_config


def inner_attention_config(device_type: str) -> Any:
    """The attention kernel's config: torchtitan's FlexAttention on CUDA, its SDPA module on CPU."""
    if device_type == "cpu":
        return ScaledDotProductAttention.Config()
    return get_attention_config("flex")


def uses_attention_masks(device_type: str) -> bool:
    """Whether the model's forward needs ``attention_masks`` (FlexAttention's block mask): not on CPU."""
    return device_type != "cpu"


@contextlib.contextmanager
def mesh_device_type(device_type: str) -> Iterator[None]:
    """Within the block, torchtitan's ``ParallelDims.build_mesh`` builds its meshes on ``device_type``.

    Only ``"cpu"`` changes anything (see the module docstring); the previous value is restored after.
    """
    if device_type != "cpu":
        yield
        return
    previous = parallel_dims_module.device_type
    parallel_dims_module.device_type = "cpu"
    try:
        yield
    finally:
        parallel_dims_module.device_type = previous
