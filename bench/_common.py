"""Pieces shared by the step benchmarks: a single-process group, a Llama of a given size, long-tailed
token batches, device sync."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict
from transformers import AutoModelForCausalLM, LlamaConfig

from verl_trainer.data.packing import make_batch

MAX_LEN = 2048
MIN_LEN = 20
MIB = 2**20


def init_single_process(device: torch.device) -> None:
    """A 1-rank process group (gloo on CPU, nccl on CUDA): what the engines and the Trainer join."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def local_param_mib(module: torch.nn.Module) -> float:
    """MiB of ``module``'s parameters held by this rank (a DTensor counts its local shard)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total / MIB


def sync(device: torch.device) -> None:
    """Wait for queued device work (CUDA) so wall-clock times are complete."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def sample_lengths(n: int, median: float, sigma: float, seed: int, cap_one: bool = True) -> list[int]:
    """Long-tailed lengths: lognormal around ``median`` clipped to [MIN_LEN, MAX_LEN].

    With ``cap_one`` one sample is MAX_LEN (a long tail reaches the cap in a real batch; it also fixes
    the memory-safe size of fixed micro-batches).
    """
    g = torch.Generator().manual_seed(seed)
    lens = torch.exp(math.log(median) + sigma * torch.randn(n, generator=g)).round().clamp(MIN_LEN, MAX_LEN)
    if cap_one:
        lens[int(torch.randint(n, (1,), generator=g))] = MAX_LEN
    return [int(x) for x in lens]


def random_pairs(lens: list[int], vocab: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) token ids of the given total lengths; the prompt is min(16, L/4) tokens."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for length in lens:
        p = min(16, length // 4)
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        pairs.append((ids[:p], ids[p:]))
    return pairs


def build_batch(lens: list[int], vocab: int, seed: int) -> TensorDict:
    """Schema batch ``[B, T]`` of :func:`random_pairs` (the response is the trained part)."""
    pairs = random_pairs(lens, vocab, seed)
    return make_batch([p for p, _ in pairs], [r for _, r in pairs])


def write_model(path: str, hidden: int, layers: int, vocab: int) -> LlamaConfig:
    """Save a randomly initialised Llama (head dim 64, MLP 8/3 x hidden) to ``path``; return its config."""
    heads = max(1, hidden // 64)
    mlp = int(hidden * 8 / 3) // 64 * 64
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False, pad_token_id=0,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return config


def save_json(path: str | None, results: dict) -> None:
    """Write ``results`` to ``path`` (when given) for ``bench/plot_results.py``."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=2))
        print(f"results written to {path}")
