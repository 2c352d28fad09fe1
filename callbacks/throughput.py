"""ThroughputMonitor: tokens/s, samples/s, step time and MFU of each trainer step.

Counts come from the step outputs when the module reports them (``num_tokens`` / ``num_samples``: this
rank's trained tokens and samples; RL modules should, since the loader's batch holds only prompts), else
from the batch (``attention_mask``). They are summed over the data-parallel group (one small all-reduce
on every rank). FLOPs per step follow PaLM's estimate for training (forward + backward):
``6 * N * tokens + 12 * layers * hidden * sum_i L_i**2`` with N the parameters of the actor (from its
Hugging Face config) and L_i the sample lengths; or ``flops_per_token * tokens`` when given. MFU divides
the achieved FLOP/s by ``peak_flops_per_device * world_size``; the peak defaults to Lightning's table of
GPUs (``get_available_flops``) and MFU is not logged when it is unknown (e.g. on CPU).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from verl_trainer.callbacks.base import Callback
from verl_trainer.callbacks.contract import CallbackModule, CallbackTrainer
from verl_trainer.metrics import Metric
from verl_trainer.utils.distributed import all_reduce


def num_parameters(config: Any) -> int:
    """Parameters of a decoder-only transformer from its HF config (attention, MLP, embeddings)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    attention = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    mlp = 3 * h * getattr(config, "intermediate_size", 4 * h)
    embeddings = config.vocab_size * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return layers * (attention + mlp) + embeddings


def _counts(outputs: Any, batch: Any) -> tuple[float, float, float]:
    """(tokens, samples, sum of squared sample lengths) of this rank's step."""
    if isinstance(outputs, Mapping) and "num_tokens" in outputs:
        tokens = float(outputs["num_tokens"])
        samples = float(outputs.get("num_samples", 0.0))
        lens = outputs.get("seq_lens")
        sq = float((torch.as_tensor(lens, dtype=torch.float64) ** 2).sum()) if lens is not None else 0.0
        return tokens, samples, sq
    try:
        mask = batch["attention_mask"]
    except (KeyError, TypeError, IndexError):
        return 0.0, 0.0, 0.0
    lens = mask.to(torch.float64).sum(-1)
    return float(lens.sum()), float(mask.shape[0]), float((lens**2).sum())


class ThroughputMonitor(Callback):
    """Log ``perf/tokens_per_sec``, ``perf/samples_per_sec``, ``perf/step_time_s`` and ``perf/mfu``.

    Args:
        flops_per_token: FLOPs per trained token; default: estimated from the actor's HF config.
        peak_flops_per_device: Peak FLOP/s of one device; default: Lightning's table (GPUs only).
        prefix: Name prefix.
    """

    def __init__(
        self,
        flops_per_token: float | None = None,
        peak_flops_per_device: float | None = None,
        prefix: str = "perf",
    ) -> None:
        self.flops_per_token = flops_per_token
        self.peak_flops_per_device = peak_flops_per_device
        self.prefix = prefix
        self._t0: float | None = None
        self._model: tuple[int, int, int] | None = None  # (params, layers, hidden)

    def setup(self, trainer: CallbackTrainer, module: CallbackModule, stage: str) -> None:
        """Resolve the device's peak FLOP/s when not given."""
        if self.peak_flops_per_device is None and trainer.accelerator == "cuda":
            from lightning.fabric.utilities.throughput import get_available_flops

            dtype = torch.bfloat16 if trainer.precision.startswith("bf16") else torch.float32
            device = torch.device("cuda", torch.cuda.current_device())
            self.peak_flops_per_device = get_available_flops(device, dtype)

    def on_train_batch_start(
        self, trainer: CallbackTrainer, module: CallbackModule, batch: Any, batch_idx: int
    ) -> None:
        """Start the step clock."""
        self._t0 = time.perf_counter()

    def _step_flops(self, trainer: CallbackTrainer, tokens: float, sq: float) -> float | None:
        if self.flops_per_token is not None:
            return self.flops_per_token * tokens
        if self._model is None:
            config = trainer.module.actor.model_config
            if config is None or not hasattr(config, "num_hidden_layers"):
                return None
            self._model = (num_parameters(config), config.num_hidden_layers, config.hidden_size)
        params, layers, hidden = self._model
        return 6.0 * params * tokens + 12.0 * layers * hidden * sq

    def on_train_batch_end(
        self, trainer: CallbackTrainer, module: CallbackModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Sum the counts over the DP group and log the rates."""
        if self._t0 is None:
            return
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        counts = all_reduce(torch.tensor(_counts(outputs, batch), dtype=torch.float64), trainer.dp_group)
        tokens, samples, sq = (float(c) for c in counts)
        values = {
            f"{self.prefix}/tokens_per_sec": tokens / elapsed,
            f"{self.prefix}/samples_per_sec": samples / elapsed,
            f"{self.prefix}/step_time_s": elapsed,
        }
        flops = self._step_flops(trainer, tokens, sq)
        if flops is not None:
            values[f"{self.prefix}/tflops_per_sec"] = flops / elapsed / 1e12
            if self.peak_flops_per_device:
                peak = self.peak_flops_per_device * trainer.world_size
                values[f"{self.prefix}/mfu"] = flops / elapsed / peak
        trainer.log_metrics({k: Metric.mean(v) for k, v in values.items()})  # global rates, every rank
