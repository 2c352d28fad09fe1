"""Rollout with vLLM on GPU, colocated with training in the same process.

This module imports ``vllm`` at module level, so it is **only imported when vllm is installed and
chosen** (``RolloutConfig(name="vllm")``, or ``"auto"`` with vllm and CUDA present) through
:func:`verl_trainer.rollout.build_rollout`; nothing else in the package imports it.

**Untested here**: vLLM cannot run on the CPU-only machines this project is developed and tested on.
The class is kept minimal: it follows vLLM's documented offline API (``LLM``, ``SamplingParams``,
token-id prompts) and loads weights through the model object of an in-process engine, which vLLM
exposes at different attribute paths across versions (:func:`_vllm_model` tries the known ones and
raises a clear error otherwise). Run with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so the engine lives in
this process and the weights can be loaded without a copy through another process.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import vllm

from verl_trainer.models.loading import load_tokenizer
from verl_trainer.rollout.base import BaseRollout
from verl_trainer.rollout.config import RolloutConfig

_MODEL_PATHS = (
    ("llm_engine", "model_executor", "driver_worker", "worker", "model_runner", "model"),  # V1, in-process
    ("llm_engine", "model_executor", "driver_worker", "model_runner", "model"),  # V0
)


def _vllm_model(llm: Any) -> Any:
    """The ``nn.Module`` of an in-process vLLM engine (it has vLLM's ``load_weights``)."""
    for path in _MODEL_PATHS:
        obj = llm
        try:
            for attr in path:
                obj = getattr(obj, attr)
        except AttributeError:
            continue
        if hasattr(obj, "load_weights"):
            return obj
    raise RuntimeError(
        f"cannot reach the model inside this vLLM {vllm.__version__} engine (tried "
        f"{['.'.join(p) for p in _MODEL_PATHS]}); set VLLM_ENABLE_V1_MULTIPROCESSING=0, or use "
        "RolloutConfig(name='hf')."
    )


class VLLMRollout(BaseRollout):
    """Sampling with a colocated ``vllm.LLM``; weights streamed in with vLLM's ``load_weights``.

    Args:
        config: Sampling settings plus ``gpu_memory_utilization``, ``tensor_parallel_size``,
            ``enforce_eager``, ``dtype``.
        model: A checkpoint directory (vLLM loads it itself).
        tokenizer: Defaults to the tokenizer saved in ``model``.

    """

    def __init__(self, config: RolloutConfig, model: str | Path, tokenizer: Any = None) -> None:
        if not isinstance(model, (str, Path)):
            raise ValueError("VLLMRollout needs a checkpoint directory, not a model object")
        super().__init__(config, tokenizer if tokenizer is not None else load_tokenizer(model))
        self.llm = vllm.LLM(
            model=str(model),
            dtype=config.dtype,
            seed=config.seed,
            gpu_memory_utilization=config.gpu_memory_utilization,
            tensor_parallel_size=config.tensor_parallel_size,
            enforce_eager=config.enforce_eager,
            skip_tokenizer_init=True,
        )

    def sampling_params(self, config: RolloutConfig, seed: int) -> Any:
        """The vLLM ``SamplingParams`` of one request (one sample: prompts arrive pre-repeated ``n`` times).

        Each request gets its own seed (``seed`` = the call's seed + request index): one seed shared by
        the ``n`` copies of a prompt would make them identical.
        """
        kwargs: dict[str, Any] = dict(n=1, max_tokens=config.max_new_tokens, seed=seed,
                                      stop_token_ids=self.eos_token_ids, detokenize=False)
        if config.do_sample:
            kwargs.update(temperature=config.temperature, top_p=config.top_p,
                          top_k=config.top_k if config.top_k > 0 else -1)
        else:
            kwargs.update(temperature=0.0)
        return vllm.SamplingParams(**kwargs)

    def generate_token_ids(self, prompts: list[list[int]], config: RolloutConfig,
                           seed: int) -> list[list[int]]:
        """Sample one response per prompt; vLLM batches internally.

        A request that stopped on an eos has it appended when vLLM left it out of ``token_ids``, so the
        shared eos cut keeps it as the last response token.
        """
        requests = [{"prompt_token_ids": p} for p in prompts]
        params = [self.sampling_params(config, (seed + i) % (2**63 - 1)) for i in range(len(prompts))]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        results = []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            stopped = getattr(completion, "finish_reason", None) == "stop"
            if stopped and (not ids or ids[-1] not in self.eos_token_ids):
                stop = getattr(completion, "stop_reason", None)
                ids.append(stop if isinstance(stop, int) else self.eos_token_ids[0])
            results.append(ids)
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Stream ``(hf_name, full_tensor)`` pairs into vLLM's ``model.load_weights``.

        vLLM maps HF names onto its fused layers itself; an unknown name raises inside vLLM.
        The prefix cache is reset afterwards (cached KV blocks belong to the old weights).
        """
        model = _vllm_model(self.llm)
        count = 0

        def counted() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in named_tensors:
                count += 1
                yield name, tensor

        model.load_weights(weights=counted())
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if callable(reset):
            reset()
        return count
