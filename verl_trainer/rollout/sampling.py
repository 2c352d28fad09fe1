"""Per-row seeded sampling and the sampler's log-probs (what makes a rollout independent of the dp size).

``torch.multinomial`` draws every row of a batch from one generator, so a response depends on which
other rows share its batch — on the rank it lands on and the dp size. Here each row (one response) owns
a seed and a stream of uniforms drawn from it, one per new token (:func:`row_uniforms`), and a token is
drawn by inverting the row's CDF at its uniform (:func:`sample_rows`): the same row seed gives the same
response whatever the batch around it. The seeds come from ``(seed, step, prompt index, sample index)``
(:func:`verl_trainer.rollout.base.derive_sample_seed`).

The log-prob returned for each token is that of the distribution it was sampled from: ``log_softmax`` of
the logits after temperature, top-k and top-p (transformers' warpers, in ``generate``'s order), i.e.
renormalised over the tokens top-k / top-p kept — vLLM's ``logprobs_mode="processed_logprobs"``. The
trainer's log-probs use the temperature only (``EngineConfig.temperature``), so with top-k / top-p the
two differ by the mass top-k / top-p removed; that is the real sampling mismatch the rollout correction
measures. Greedy decoding returns the log-probs of the unwarped logits.

``model.generate`` samples with its own ``multinomial``; :class:`RowSampler` is a logits processor that
draws each row's token itself and hands ``generate`` (run greedily) a score row that is 0 at that token
and ``-inf`` elsewhere, so ``generate`` emits exactly the row-seeded draws (and records their log-probs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from verl_trainer.rollout.divergence import check_logits


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
    """

    def __init__(self, warpers: LogitsProcessorList, uniforms: torch.Tensor | None,
                 prompt_width: int) -> None:
        self.warpers = warpers
        self.uniforms = uniforms
        self.prompt_width = prompt_width
        self.step_log_probs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Draw this step's tokens; return the one-hot (0 / ``-inf``) scores ``[B, V]``."""
        step = input_ids.shape[1] - self.prompt_width
        check_logits(scores)  # diverged weights: named (DivergenceError), not drawn from as if finite
        warped = self.warpers(input_ids, scores.float())
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


__all__ = ["RowSampler", "row_uniforms", "sample_rows"]
