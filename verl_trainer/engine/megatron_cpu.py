"""What Megatron-Core needs to run on a CPU: two narrowly scoped stand-ins, applied only for a CPU engine.

Megatron-Core (0.16) is written for CUDA devices; on CPU two things fail, both upstream gaps:

* A few modules allocate with ``device=torch.cuda.current_device()`` although the tensors they make belong
  on the model's device: RoPE's inverse frequencies
  (``models/common/embeddings/rotary_pos_embedding.py``: ``RotaryEmbedding.__init__`` and ``get_emb``, which
  moves ``inv_freq`` to the GPU on first use) and DDP's gradient buffers
  (``distributed/param_and_grad_buffer.py``: ``grad_data``) and the attention scores' scratch buffer
  (``utils.py``: ``GlobalMemoryBuffer``), and the MoE router, which moves its weight to the GPU in
  ``gating`` (``transformer/moe/router.py``), and the all-gather / reduce-scatter mappings the MoE
  all-gather token dispatcher runs under EP (``tensor_parallel/mappings.py``: their output buffers).
  Upstream fix: take the device from the
  config / the parameters (``use_cpu_initialization`` already exists for weights). Here each of those modules
  gets its own ``torch`` stand-in (:class:`_CPUTorch`) whose ``cuda.current_device()`` is the CPU; every other
  attribute is torch's own, and no other module sees it.
* The model-parallel RNG tracker forks CUDA RNG states around dropout. Megatron's own no-op tracker (the
  inference tracker, ``initialize_rng_tracker(inference_rng_tracker=True)``) is installed instead; that is
  exact only without dropout, so a CPU engine refuses a model with non-zero dropout
  (``megatron_model.py``). Upstream fix: a CPU generator in ``CudaRNGStatesTracker``.

* Without Transformer Engine, ``transformer/moe/moe_utils.py`` leaves ``te_general_gemm`` undefined (its
  import is in a ``try`` that binds nothing on failure), and the MoE router's gating linear reads it: a
  ``NameError``. :func:`prepare_device` defines it as ``None`` there, which selects the module's own
  plain-torch path. Upstream fix: ``te_general_gemm = None`` in the ``except ImportError``.

On CUDA the library runs unpatched (:func:`prepare_device` does nothing there but seed Megatron's tracker).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = ["CUDA_DEVICE_MODULES", "prepare_device"]

CUDA_DEVICE_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.tensor_parallel.mappings",
)
"""The Megatron-Core modules that allocate on ``torch.cuda.current_device()`` where a CPU engine runs them."""


class _CPUCuda:
    """``torch.cuda`` as the patched modules see it: ``current_device()`` is the CPU, the rest is torch's."""

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CPUTorch:
    """``torch`` as the patched modules see it: torch itself except for :class:`_CPUCuda`."""

    cuda = _CPUCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _patch_cuda_device_modules() -> None:
    """Give every module of :data:`CUDA_DEVICE_MODULES` the CPU stand-in of ``torch`` (idempotent)."""
    for name in CUDA_DEVICE_MODULES:
        module = importlib.import_module(name)
        if not isinstance(getattr(module, "torch", None), _CPUTorch):
            module.torch = _CPUTorch()


def prepare_device(device_type: str, seed: int, tp_rank: int) -> None:
    """Make Megatron-Core ready to build and run a model on ``device_type``; on every rank, before the model.

    Both: ``te_general_gemm = None`` in ``moe_utils`` where Transformer Engine is missing (above); Megatron's
    process-wide scratch buffer for attention scores (``parallel_state``'s global memory
    buffer; the one piece of ``parallel_state`` the model reads, independent of any layout). CPU: the
    stand-ins above and Megatron's no-op RNG tracker. CUDA: Megatron's own seeding of its RNG
    tracker (``model_parallel_cuda_manual_seed``: one state per TP rank), nothing patched.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        seed: The engine's seed.
        tp_rank: This rank's tensor-parallel rank.
    """
    from megatron.core import parallel_state, tensor_parallel

    if device_type == "cpu":
        _patch_cuda_device_modules()
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):  # no Transformer Engine: its plain-torch router path
        moe_utils.te_general_gemm = None
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # the attention's scratch buffer, layout-independent
        parallel_state._set_global_memory_buffer()
    if device_type == "cpu":
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        return
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0,
                                                    force_reset_rng=True)
