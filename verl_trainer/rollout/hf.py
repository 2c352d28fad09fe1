"""Rollout with transformers ``generate`` on a private copy of the policy (CPU or GPU)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from transformers import CompileConfig, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from verl_trainer.data import schema
from verl_trainer.models.hf_files import to_dtype
from verl_trainer.models.loading import load_causal_lm, load_tokenizer
from verl_trainer.models.moe_routers import ROUTED_EXPERTS, capture_routers, find_routers
from verl_trainer.models.router_replay import generation_routing, place_routing, row_routing
from verl_trainer.rollout.base import BaseRollout, weight_mismatch_report
from verl_trainer.rollout.config import RolloutConfig
from verl_trainer.rollout.divergence import DivergenceError, diverged, is_sampler_error
from verl_trainer.rollout.registry import register_rollout
from verl_trainer.rollout.sampling import RowSampler, logits_warpers, row_uniforms, sample_dropping_finished
from verl_trainer.rollout.vision import PromptImages, chunk_vision_inputs, placeholder_ids
from verl_trainer.utils.device import get_torch_device


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> this process's accelerator (local rank) or CPU; anything else as given."""
    return get_torch_device() if device == "auto" else torch.device(device)


def resolve_decoding(config: RolloutConfig, device: torch.device) -> tuple[str, str, bool]:
    """The decoding loop, KV cache and compilation a call uses: ``(decoding, cache, compile)``.

    ``decoding="auto"``: ``"generate"`` on CUDA or when a static cache / compilation is asked for, else
    ``"drop_finished"`` (on CPU the compute of finished rows is the cost; on CUDA the per-step launches
    are, which a static cache and compiled decoding remove). ``cache_implementation="auto"``: static on
    CUDA. ``compile_decoding=None``: compile when the cache is static on CUDA.
    """
    cuda = device.type == "cuda"
    decoding = config.decoding
    if decoding == "auto":
        wants_generate = cuda or config.cache_implementation == "static" or bool(config.compile_decoding)
        decoding = "generate" if wants_generate else "drop_finished"
    if decoding == "drop_finished":
        return decoding, "dynamic", False
    cache = config.cache_implementation
    if cache == "auto":
        cache = "static" if cuda or config.compile_decoding else "dynamic"
    if config.compile_decoding is not None:
        return decoding, cache, config.compile_decoding
    return decoding, cache, cache == "static" and cuda


@register_rollout("hf")
class HFRollout(BaseRollout):
    """Batched sampling with ``model.generate`` on left-padded prompts, under ``torch.no_grad``.

    The rollout owns its own copy of the causal LM, in eval mode, without gradients. After each update
    the trainer streams the new weights in with :meth:`update_weights`.

    Args:
        config: Sampling settings (``config.device``, ``config.dtype``, ``config.attn_implementation``
            choose where and how the copy lives).
        model: A checkpoint directory (loaded with ``from_pretrained``) or a model (deep-copied).
        tokenizer: Defaults to the tokenizer saved with ``model`` (a path is required then).

    """

    backend_settings = ("decoding", "cache_implementation", "compile_decoding", "share_weights")
    one_step_off = True  # its model is a private copy, written only between generations
    accepts_images = True

    def __init__(self, config: RolloutConfig, model: str | Path | PreTrainedModel,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        if tokenizer is None:
            if not isinstance(model, (str, Path)):
                raise ValueError("HFRollout needs a tokenizer when it is given a model object, not a path")
            tokenizer = load_tokenizer(model)
        super().__init__(config, tokenizer)
        self.device = resolve_device(config.device)
        dtype = to_dtype(config.dtype)
        if isinstance(model, (str, Path)):
            self.model = load_causal_lm(
                model, attn_implementation=config.attn_implementation, torch_dtype=dtype
            )
        else:
            self.model = copy.deepcopy(model).to(dtype)
        self.model.to(self.device).eval().requires_grad_(False)
        self.eos_token_ids = self._eos_ids(tokenizer, self.model.generation_config.eos_token_id)
        self.suppressed_ids = placeholder_ids(self.model)
        """Token ids never sampled: a vision-language model's image / video placeholders (a response holding
        one would be read as an image by the training forward)."""
        self.record_routing = False
        """Router replay (``actor.engine.moe.router_replay=rollout``): record each token's experts and return
        them as the batch's ``routed_experts`` (``models/router_replay.py``); decodes with ``generate``."""
        self._routing: list[torch.Tensor] = []

    def generation_config(self, config: RolloutConfig) -> GenerationConfig:
        """The ``GenerationConfig`` of one call (every sampling field set explicitly).

        With ``decoding="generate"`` it carries the KV cache kind and, when compiled, a
        ``CompileConfig`` (also on devices transformers would not compile on by itself).
        """
        decoding, cache, compile_ = resolve_decoding(config, self.device)
        common: dict[str, Any] = dict(
            max_new_tokens=config.max_new_tokens,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )
        if decoding == "generate":
            common.update(cache_implementation=cache, disable_compile=not compile_)
            if compile_:
                compile_config = CompileConfig()
                compile_config._compile_all_devices = self.device.type != "cuda"  # transformers' own switch
                common["compile_config"] = compile_config
        if not config.do_sample:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(
            do_sample=True,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k if config.top_k > 0 else 0,
            **common,
        )

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        return ids.to(self.device), mask.to(self.device)

    def generate_token_ids(
        self, prompts: list[list[int]], config: RolloutConfig, seeds: list[int],
        images: list[PromptImages] | None = None,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Sample one response per prompt, in chunks of ``config.generation_batch_size`` sequences.

        Each chunk is one :func:`sample_dropping_finished` loop or one ``model.generate`` call
        (``config.decoding``, see :func:`resolve_decoding`); both draw response ``k``'s tokens from
        ``seeds[k]`` alone (:mod:`verl_trainer.rollout.sampling`), so a response does not depend on its
        chunk, its batch or the rank. ``generate`` runs greedily over a :class:`RowSampler` that draws
        the tokens.

        Args:
            prompts: ``N`` prompt id lists (each prompt already repeated ``n`` times).
            config: This call's sampling settings.
            seeds: ``N`` seeds, one per response.
            images: ``N`` entries, prompt ``k``'s images (a vision-language policy), or ``None``.

        Returns:
            ``(ids, log_probs)``: ``N`` lists of generated ids (``[P + R]`` outputs with their prompt part
            ``[P]`` removed) and the log-prob of each id under the distribution it was drawn from.

        """
        gen_config = self.generation_config(config)
        drop_finished = resolve_decoding(config, self.device)[0] == "drop_finished"
        drop_finished = drop_finished and not self.record_routing  # recording needs every row in each call
        self._routing = []
        chunk = config.generation_batch_size or len(prompts)
        ids: list[list[int]] = []
        log_probs: list[list[float]] = []
        with torch.no_grad():
            for start in range(0, len(prompts), chunk):
                input_ids, attention_mask = self._left_pad(prompts[start: start + chunk])
                chunk_seeds = seeds[start: start + chunk]
                vision = None if images is None else chunk_vision_inputs(
                    self.model, input_ids, images[start: start + chunk])
                try:
                    if drop_finished:
                        out, lps = sample_dropping_finished(self.model, input_ids, attention_mask,
                                                            gen_config, seeds=chunk_seeds, vision=vision,
                                                            suppress=self.suppressed_ids)
                    else:
                        out, lps = self._generate(input_ids, attention_mask, gen_config, chunk_seeds,
                                                  vision or {})
                except RuntimeError as exc:  # NaN logits: a sampler error, unless it is said what it is
                    if isinstance(exc, DivergenceError) or is_sampler_error(exc):
                        raise diverged(self.model, exc) from exc
                    raise
                ids.extend(out)
                log_probs.extend(lps)
        return ids, log_probs

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, gen_config: GenerationConfig,
                  seeds: list[int], vision: Mapping[str, torch.Tensor] | None = None,
                  ) -> tuple[list[list[int]], list[list[float]]]:
        """One ``model.generate`` call, greedy over a :class:`RowSampler` (row-seeded draws, log-probs).

        ``vision``: the rows' image inputs (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``).
        """
        width = input_ids.shape[1]
        sampled = gen_config.do_sample
        uniforms = row_uniforms(seeds, gen_config.max_new_tokens, self.device) if sampled else None
        sampler = RowSampler(logits_warpers(gen_config), uniforms, width, self.suppressed_ids)
        greedy = copy.deepcopy(gen_config)
        greedy.do_sample = False
        greedy.temperature, greedy.top_p, greedy.top_k = None, None, None
        # synced_gpus=False: each rank holds a whole copy and samples its own prompts (transformers would
        # otherwise all-reduce every decoding step under ZeRO-3 / FSDP, a collective the one-step-off
        # rollout's background thread must never run)
        routers = find_routers(self.model) if self.record_routing else []
        with capture_routers(routers) if routers else contextlib.nullcontext() as capture:
            sequences = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                            generation_config=greedy, logits_processor=[sampler],
                                            synced_gpus=False, **(vision or {}))
        if routers:
            self._routing += row_routing(generation_routing(capture, len(seeds)), width,
                                         attention_mask.sum(-1).tolist())
        out = sequences[:, width:].tolist()
        lps = sampler.log_probs.tolist()
        return out, [lp[: len(o)] for lp, o in zip(lps, out)]

    def generate(self, *args: Any, **kwargs: Any) -> TensorDict:
        """:meth:`BaseRollout.generate`, plus ``routed_experts [B, T, L, k]`` when :attr:`record_routing`."""
        if self.record_routing and self.agent_loop is not None:
            raise NotImplementedError(
                "router replay of the rollout (actor.engine.moe.router_replay=rollout) with a multi-turn "
                "rollout is not supported (each turn is a generation of its own); use router_replay="
                "old_policy, or multi_turn.enable=false")
        if self.record_routing and resolve_decoding(self.config, self.device)[2]:
            raise ValueError(
                "router replay of the rollout (actor.engine.moe.router_replay=rollout) records the experts "
                "by forward hooks, which compiled decoding does not run; set rollout.compile_decoding=false")
        batch = super().generate(*args, **kwargs)
        if self.record_routing and self._routing:
            batch[ROUTED_EXPERTS] = place_routing(self._routing, batch[schema.PROMPT_LEN],
                                                  batch[schema.SEQ_LEN], batch[schema.INPUT_IDS].shape[1])
        return batch

    def share_weights(self, params: Mapping[str, torch.Tensor]) -> int:
        """Make the rollout model's parameters aliases of ``params`` (the actor's own storage).

        A tensor on another device or in another dtype than the rollout's parameter is copied instead.
        Tied parameters (one parameter under several names) take the tensor of any of their names.
        Once aliased, later calls find the same storage and copy nothing.

        Args:
            params: ``{hf_name: tensor}``, e.g. ``engine.get_shareable_params()``; every parameter of the
                rollout model must be there (buffers keep the rollout's own values).

        Returns:
            The number of parameters aliased or copied.

        Raises:
            ValueError: Unknown or missing names or shape mismatches (as :meth:`update_weights`).
        """
        owners = list(self.model.named_parameters(remove_duplicate=False))
        names_of: dict[int, list[str]] = {}
        for name, p in owners:
            names_of.setdefault(id(p), []).append(name)
        unknown = sorted(set(params) - {name for name, _ in owners})
        missing: list[str] = []
        shapes: list[str] = []
        count = 0
        for names in names_of.values():
            source = next((params[n] for n in names if n in params), None)
            target = self.model.get_parameter(names[0])
            if source is None:
                missing.append(names[0])
            elif tuple(source.shape) != tuple(target.shape):
                shapes.append(f"{names[0]} {tuple(source.shape)} vs {tuple(target.shape)}")
            elif source.device != target.device or source.dtype != target.dtype:
                with torch.no_grad():
                    target.copy_(source)
                count += 1
            else:
                if source.data_ptr() != target.data_ptr():
                    shared = torch.nn.Parameter(source.detach(), requires_grad=False)
                    for name in names:
                        module_name, _, attr = name.rpartition(".")
                        setattr(self.model.get_submodule(module_name), attr, shared)
                count += 1
        if unknown or missing or shapes:
            raise ValueError(weight_mismatch_report(unknown, missing, shapes))
        return count

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy full tensors into the rollout model's parameters and buffers, one at a time.

        Tied weights (one storage under several names) count as sent when any of their names is.

        Args:
            named_tensors: ``(hf_name, full_tensor)`` pairs, e.g. ``engine.get_per_tensor_param()``.

        Returns:
            The number of tensors copied.

        Raises:
            ValueError: After consuming every pair: unknown names, parameters never sent, or shape
                mismatches (nothing is rolled back).

        """
        targets = self.model.state_dict(keep_vars=True)
        unknown: list[str] = []
        shapes: list[str] = []
        written: set[int] = set()
        count = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = targets.get(name)
                if target is None:
                    unknown.append(name)
                    continue
                if tuple(target.shape) != tuple(tensor.shape):
                    shapes.append(f"{name} {tuple(tensor.shape)} vs {tuple(target.shape)}")
                    continue
                if tensor.data_ptr() != target.data_ptr() or tensor.dtype != target.dtype:  # not an alias
                    target.copy_(tensor.detach())
                written.add(target.data_ptr())
                count += 1
        missing = [name for name, t in targets.items() if t.data_ptr() not in written]
        if unknown or missing or shapes:
            raise ValueError(weight_mismatch_report(unknown, missing, shapes))
        return count
