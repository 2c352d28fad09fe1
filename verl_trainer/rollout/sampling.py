"""How the HF rollout draws tokens: per-row seeded sampling, its log-probs, and the two loops that use it.

Invariants (tests: ``tests/rollout/test_decoding.py``; the reasons: docs/internals.md, "Rollout (HF
generate)"):

* With a seed per row (``derive_sample_seed(seed, step, prompt index, sample index)``), a row draws one
  uniform per new token from its own generator (:func:`row_uniforms`) and the token by inverting its CDF
  (:func:`sample_rows`): a response does not depend on the other rows of its batch, the rank or dp size.
* The log-prob returned per token is that of the distribution it was drawn from: ``log_softmax`` after
  temperature, top-k and top-p in ``generate``'s order (vLLM's ``processed_logprobs``); greedy decoding
  returns the unwarped log-probs.
* :class:`RowSampler` (a logits processor for ``model.generate`` run greedily) hands ``generate`` a row that
  is 0 at the drawn token and ``-inf`` elsewhere, so ``generate`` emits the row-seeded draws.
* :func:`sample_dropping_finished` removes finished rows from the batch and the KV cache in groups (once
  they are ``drop_at`` of the live rows); it samples as ``generate`` does for the fields ``HFRollout`` sets,
  the same tokens while no row is dropped (``drop_at=float("inf")``: always), the same distribution after;
  other generation settings are refused.
* Both loops check the logits before drawing (:func:`check_logits`: ``DivergenceError`` on diverged
  weights).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence

import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from verl_trainer.rollout.divergence import DivergenceError
from verl_trainer.rollout.vision import mrope_positions


def row_uniforms(seeds: Sequence[int], steps: int, device: torch.device) -> torch.Tensor:
    """``[B, steps]`` uniforms in ``[0, 1)``: row ``i`` drawn from a generator seeded with ``seeds[i]``.

    Args:
        seeds: One seed per row (response).
        steps: Uniforms per row (the most new tokens it can take).
        device: Where the result goes (drawn on CPU, so the stream is the same on every device).

    Returns:
        float32 ``[B, steps]``.
    """
    rows = [torch.rand(steps, generator=torch.Generator().manual_seed(int(s))) for s in seeds]
    out = torch.stack(rows) if rows else torch.zeros(0, steps)
    return out.to(device)


def sample_rows(scores: torch.Tensor, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverting its CDF at its uniform; greedy when ``uniforms`` is None.

    Args:
        scores: ``[b, V]`` float32 warped logits (``-inf`` where top-k / top-p removed a token).
        uniforms: ``[b]`` one uniform per row in ``[0, 1)``, or ``None`` (argmax).

    Returns:
        ``(tokens [b] long, log_probs [b] float32)``: the tokens and their log-probs under
        ``softmax(scores)``.
    """
    log_probs = torch.log_softmax(scores.float(), dim=-1)
    if uniforms is None:
        tokens = scores.argmax(dim=-1)
    else:
        cdf = log_probs.exp().cumsum(dim=-1)  # non-decreasing; a removed token adds 0
        total = cdf[:, -1]
        # u * total < total, also after rounding: the first index whose cdf exceeds it has mass > 0
        below_total = torch.nextafter(total, torch.zeros_like(total))
        target = torch.minimum(uniforms.to(cdf.dtype) * total, below_total)
        tokens = torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)
        tokens = tokens.clamp_max(scores.shape[-1] - 1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)



def check_logits(logits: torch.Tensor) -> None:
    """Raise ``DivergenceError`` when ``logits`` ``[B, V]`` hold NaN or +inf (−inf is a masked token)."""
    if bool(torch.isnan(logits).any() | torch.isposinf(logits).any()):
        raise DivergenceError("the rollout model's logits are non-finite (NaN or +inf)")


class RowSampler(LogitsProcessor):
    """A logits processor that samples each row itself (row-seeded) for a greedy ``model.generate``.

    At each step it applies ``warpers`` (temperature / top-k / top-p) to the float32 logits, draws every
    row's token with :func:`sample_rows` at that row's uniform for the step, records the token's log-prob
    (:attr:`log_probs`, one list per row) and returns scores that are 0 at the drawn token and ``-inf``
    elsewhere, so the greedy ``generate`` emits the drawn tokens.

    Args:
        warpers: The sampling warpers (``decoding.logits_warpers``).
        uniforms: ``[B, max_new_tokens]`` (:func:`row_uniforms`), or ``None`` for greedy decoding.
        prompt_width: Width of the left-padded prompt batch (step ``t`` sees ``prompt_width + t`` ids).
        suppress: Token ids never drawn (their logits set to ``-inf`` before the warpers; a vision-language
            model's image placeholders, :func:`verl_trainer.rollout.vision.placeholder_ids`).
    """

    def __init__(self, warpers: LogitsProcessorList, uniforms: torch.Tensor | None,
                 prompt_width: int, suppress: Sequence[int] = ()) -> None:
        self.warpers = warpers
        self.suppress = list(suppress)
        self.uniforms = uniforms
        self.prompt_width = prompt_width
        self.step_log_probs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Draw this step's tokens; return the one-hot (0 / ``-inf``) scores ``[B, V]``."""
        step = input_ids.shape[1] - self.prompt_width
        check_logits(scores)  # diverged weights: named (DivergenceError), not drawn from as if finite
        warped = self.warpers(input_ids, suppressed(scores.float(), self.suppress))
        uniforms = None if self.uniforms is None else self.uniforms[:, step]
        tokens, log_probs = sample_rows(warped, uniforms)
        self.step_log_probs.append(log_probs)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, tokens.unsqueeze(-1), 0.0)

    @property
    def log_probs(self) -> torch.Tensor:
        """``[B, steps]`` the sampled tokens' log-probs, one column per decoding step run."""
        if not self.step_log_probs:
            return torch.zeros(0, 0)
        return torch.stack(self.step_log_probs, dim=1)


DROP_AT = 0.125
"""Drop finished rows once they are at least this fraction of the live rows (chosen on ``bench/vs_trl.py``:
dropping at every finish re-gathers the cache at almost every step)."""

_SUPPORTED = ("max_new_tokens", "eos_token_id", "pad_token_id", "do_sample", "temperature", "top_k",
              "top_p", "use_cache", "bos_token_id", "cache_implementation", "disable_compile")


def _check_supported(config: GenerationConfig) -> None:
    """Refuse generation settings this loop does not implement (instead of ignoring them)."""
    defaults = GenerationConfig()
    changed = [k for k, v in config.to_diff_dict().items()
               if k not in _SUPPORTED and not k.startswith("_") and getattr(defaults, k, None) != v
               and k != "transformers_version"]
    if changed:
        raise ValueError(
            f"sample_dropping_finished supports {', '.join(_SUPPORTED)}; the generation config also sets "
            f"{changed}. Use decoding='generate' (model.generate) for those settings."
        )
    if config.max_new_tokens is None or config.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={config.max_new_tokens} must be >= 1")


def logits_warpers(config: GenerationConfig) -> LogitsProcessorList:
    """The warpers ``generate`` applies for temperature, top-k and top-p, in its order."""
    warpers = LogitsProcessorList()
    if not config.do_sample:
        return warpers
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    return warpers


def suppressed(scores: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """``scores`` ``[b, V]`` with the columns ``ids`` at ``-inf`` (``scores`` itself for no ``ids``)."""
    if not ids:
        return scores
    out = scores.clone()
    out[:, list(ids)] = float("-inf")
    return out


def _cache_kwarg(model: PreTrainedModel) -> str:
    """``cache`` (transformers >= 5.24 names the KV cache argument so) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _eos_tensor(config: GenerationConfig, device: torch.device) -> torch.Tensor:
    eos = config.eos_token_id
    if eos is None:
        raise ValueError("the generation config has no eos_token_id; sequences could never finish early")
    return torch.as_tensor([eos] if isinstance(eos, int) else list(eos), dtype=torch.long, device=device)


@torch.no_grad()
def sample_dropping_finished(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    config: GenerationConfig,
    drop_at: float = DROP_AT,
    seeds: Sequence[int] | None = None,
    vision: Mapping[str, torch.Tensor] | None = None,
    suppress: Sequence[int] = (),
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample up to ``config.max_new_tokens`` tokens per row, removing finished rows as they pile up.

    Args:
        model: A causal LM in eval mode.
        input_ids: ``[B, P]`` left-padded prompts.
        attention_mask: ``[B, P]`` 1 on prompt tokens, 0 on the left padding.
        config: ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``eos_token_id`` (an id or a list),
            ``max_new_tokens``; anything else set is refused.
        drop_at: Drop finished rows once they are at least this fraction of the live rows (> 0;
            ``float("inf")``: never, which samples token for token as ``generate``).
        seeds: One seed per row: row-seeded sampling (:func:`sample_rows`); ``None``:
            ``torch.multinomial`` on the global RNG, as ``generate``.
        vision: A vision-language model's image inputs of the rows
            (:func:`verl_trainer.rollout.vision.chunk_vision_inputs`): the prompt forward gets the images and
            the model's 3-D mrope positions, later tokens one past each row's largest position.
        suppress: Token ids never drawn (as :class:`RowSampler`'s ``suppress``).

    Returns:
        ``(ids, log_probs)``: ``B`` lists of generated ids, each ending at its first eos (kept) or at
        ``max_new_tokens``, and per id its log-prob under the (warped) distribution it was drawn from.

    """
    _check_supported(config)
    if not drop_at > 0:
        raise ValueError(f"drop_at={drop_at} must be > 0 (a fraction of the live rows; inf: never)")
    max_new = int(config.max_new_tokens)
    eos = _eos_tensor(config, input_ids.device)
    pad = int(config.pad_token_id if config.pad_token_id is not None else 0)
    warpers = logits_warpers(config)
    batch = input_ids.shape[0]
    if seeds is not None and len(seeds) != batch:
        raise ValueError(f"got {len(seeds)} seeds for {batch} rows; give one seed per row")
    seeded = seeds is not None and config.do_sample
    uniforms = row_uniforms(seeds, max_new, input_ids.device) if seeded else None
    out = torch.full((batch, max_new), pad, dtype=torch.long, device=input_ids.device)
    out_log_probs = torch.zeros((batch, max_new), dtype=torch.float32, device=input_ids.device)
    lengths = torch.full((batch,), max_new, dtype=torch.long, device=input_ids.device)

    cache = DynamicCache(config=model.config)
    cache_arg = {_cache_kwarg(model): cache}
    positions = attention_mask.long().cumsum(-1) - 1
    positions.masked_fill_(attention_mask == 0, 1)  # as generate: padding positions hold 1
    next_pos = positions[:, -1:] + 1
    images: dict[str, torch.Tensor] = {}
    if vision is not None:
        positions, next_pos = mrope_positions(model, input_ids, attention_mask, dict(vision))
        images = {k: v for k, v in vision.items() if k in ("pixel_values", "image_grid_thw")}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                   use_cache=True, logits_to_keep=1, **cache_arg, **images).logits
    rows = torch.arange(batch, device=input_ids.device)  # original row of each live row
    finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    for step in range(max_new):
        check_logits(logits[:, -1, :])  # diverged weights: named, not a sampler error (or, greedy, token 0)
        scores = warpers(input_ids, suppressed(logits[:, -1, :].to(dtype=torch.float32), suppress))
        if uniforms is not None:
            tokens, log_probs = sample_rows(scores, uniforms[rows, step])
        elif config.do_sample:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            log_probs = torch.log_softmax(scores, dim=-1).gather(-1, tokens[:, None]).squeeze(1)
        else:
            tokens, log_probs = sample_rows(scores, None)
        tokens = torch.where(finished, torch.full_like(tokens, pad), tokens)
        out[rows, step] = tokens
        out_log_probs[rows, step] = log_probs
        ends = torch.isin(tokens, eos) & ~finished
        lengths[rows[ends]] = step + 1
        finished |= ends
        n_finished = int(finished.sum())
        if step == max_new - 1 or n_finished == len(rows):
            break
        if n_finished and n_finished >= drop_at * len(rows):
            keep = (~finished).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, tokens, attention_mask = rows[keep], tokens[keep], attention_mask[keep]
            next_pos, finished = next_pos[keep], finished[keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=-1)
        logits = model(input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=next_pos,
                       use_cache=True, **cache_arg).logits
        next_pos = next_pos + 1
    lengths_list = lengths.tolist()
    return ([row[:n] for row, n in zip(out.tolist(), lengths_list)],
            [row[:n] for row, n in zip(out_log_probs.tolist(), lengths_list)])


__all__ = ["DROP_AT", "RowSampler", "check_logits", "logits_warpers", "row_uniforms",
           "sample_dropping_finished", "sample_rows", "suppressed"]
