"""The "@k" numbers of a validation batch, as metrics with their reduction (exact over batches and ranks).

Each number is a mean over prompts, so each is logged as ``Metric.mean(value, weight=prompts)``: the
weighted mean over validation batches and DP ranks is the mean over every validation prompt, the value
``python -m verl_trainer.evaluate`` reports for the same samples. Names: ``{prefix}/pass@k``, ...
(all prompts) and ``{prefix}/{data_source}/pass@k``, ... (per source; a rank without prompts of a source
adds weight 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDict

from verl_trainer.data import schema
from verl_trainer.data.schema import non_tensor_list
from verl_trainer.evaluate.samples import PromptSamples, metric_names, prompt_samples, summarize
from verl_trainer.metrics import Metric

__all__ = ["batch_prompt_samples", "validation_metrics"]


def batch_prompt_samples(batch: TensorDict, scores: torch.Tensor, info: Mapping[str, torch.Tensor],
                         correct_threshold: float = 1.0) -> list[PromptSamples]:
    """The real (non-padding) samples of a scored rollout batch, grouped by prompt ``uid``.

    Args:
        batch: A rollout batch ``[B]`` with ``uid``, ``response_text``, ``data_source``, ``is_padding``.
        scores: ``[B]`` rewards.
        info: The reward's per-sample extras (``acc`` ``[B]``).
        correct_threshold: Without ``acc``: correct when the score is at least this.
    """
    real = schema.real_mask(batch)
    rows = real.nonzero().flatten().tolist()
    texts = non_tensor_list(batch, "response_text")
    sources = (non_tensor_list(batch, "data_source") if "data_source" in batch.keys()
               else ["unknown"] * len(texts))
    uids = batch[schema.UID].tolist()
    return prompt_samples([uids[i] for i in rows], [sources[i] for i in rows], [texts[i] for i in rows],
                          scores[real], {key: value[real] for key, value in info.items()}, correct_threshold)


def validation_metrics(prompts: Sequence[PromptSamples], ks: Sequence[int],
                       prefix: str = "val") -> dict[str, Metric]:
    """``{prefix}/{estimator}@{k}`` and ``{prefix}/{data_source}/{estimator}@{k}``, weighted by prompts."""
    metrics, per_source = summarize(prompts, ks)
    names = metric_names(ks)
    count = metrics["num_prompts"]
    out = {f"{prefix}/{name}": Metric.mean(metrics[name] if count else 0.0, weight=count) for name in names}
    for source, values in per_source.items():
        weight = values["num_prompts"]
        out.update({f"{prefix}/{source}/{name}": Metric.mean(values[name], weight=weight) for name in names})
    return out
