"""Which packed-attention path each layout takes on CPU: the matmul crossover, measured per shape.

``verl_trainer.models.bucketed_attention`` runs buckets of segments up to a *crossover* length as batched
matmuls and longer ones as one sdpa call each. The crossover is chosen per :class:`ShapeKey`
``(H, H_kv, D, dtype, device type)`` when a model is built (:func:`agree_on_model_attention`) and kept in
``bucketed_attention.LAYOUT_CROSSOVERS``; a layout not in that table takes the constant rule
(:data:`MATMUL_MAX_LENGTH` in fp32, sdpa in half precision).

:func:`choose_crossover` times, at each of :data:`PROBE_LENGTHS` ``L``, one packed row of about
:data:`PROBE_TOKENS` tokens whose segments take the lengths ``L/2 + 1 .. L`` in turn (:func:`probe_lengths`:
many segments per length at 8 tokens, one per length at 64, as in rows of sampled responses), forward and
backward with those segments on the matmul path and on sdpa, in :data:`PROBE_ROUNDS` paired rounds, keeping
each side's best round; the crossover is the longest probed length up to which the matmul side is never
clearly slower (speed-up >= :data:`KEEP_MATMUL_ABOVE`), 0 when it is at the shortest.

Invariants: one choice per key whether or not gradients are needed (old and new log-probs of the same
tokens come from the same kernel); every rank of a run takes the same choice (rank 0 measures, the others
receive its crossover over the default group); nothing is measured inside a forward.

Switches: ``VERL_TRAINER_ATTENTION_AUTOTUNE=0`` keeps the constant rule everywhere (the tests pin it).
Choices are cached in-process and in a JSON file (:func:`cache_path`:
``VERL_TRAINER_ATTENTION_AUTOTUNE_CACHE``, else ``$XDG_CACHE_HOME/verl_trainer/attention_autotune.json``;
``0``: no file), keyed also by the torch version and the CPU thread count, read with ``json`` only and
written atomically; an unreadable file is ignored with a warning.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from verl_trainer.models.bucketed_attention import (
    LAYOUT_CROSSOVERS,
    MATMUL_MAX_LENGTH,
    bucketed_varlen_attention,
)
from verl_trainer.utils.distributed import all_reduce, get_rank, is_distributed

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "AUTOTUNE_ENV",
    "CACHE_ENV",
    "PROBE_LENGTHS",
    "PROBE_TOKENS",
    "ShapeKey",
    "agree_on_model_attention",
    "autotune_enabled",
    "cache_path",
    "choose_crossover",
    "clear_cache",
    "measure_probe",
    "probe_lengths",
    "tune",
]

AUTOTUNE_ENV = "VERL_TRAINER_ATTENTION_AUTOTUNE"
"""``0``/``false``/``off``: the constant :data:`MATMUL_MAX_LENGTH` for every shape; else the autotune."""

CACHE_ENV = "VERL_TRAINER_ATTENTION_AUTOTUNE_CACHE"
"""Path of the JSON cache file; ``0``/``false``/``off``: none (in-process cache only)."""

PROBE_LENGTHS = (8, 16, 32, 64, 128)
"""Segment lengths the autotune times (shortest first)."""

PROBE_TOKENS = 512
"""Tokens of the probed row (:func:`probe_lengths`; at least one segment of each length)."""

PROBE_ROUNDS = 9
"""Paired rounds per probed length (after one warm-up of each side); each side's fastest round counts."""

KEEP_MATMUL_ABOVE = 0.9
"""A probed length stays on the matmul path unless it measured clearly slower than sdpa (below this speed-up).
Not 1.0: the probe's row is short (:data:`PROBE_TOKENS`), and the matmul path gains with the segments per
length, which a real row of short responses has more of (GQA 4 / 2 x 32: the probe read 0.92 at 16
tokens, while ``bench/attention.py``'s 1,024 segments of 8-16 ran 4.8x over the loop with crossover 16,
3.9x with 8)."""

_OFF = ("0", "false", "off", "no")
_UPCAST = tuple(str(d) for d in (torch.float32, torch.bfloat16, torch.float16))
_FORMAT = 1
_PROBE_VERSION = 3  # in the file's keys: an older probe's choices (one bucket, one length) are measured again

Probe = Callable[["ShapeKey", int], float]
"""``probe(key, length) -> speed-up`` of the matmul side over the sdpa side at ``length`` (> 1: faster)."""


@dataclass(frozen=True)
class ShapeKey:
    """What the crossover depends on: the attention layout as a rank sees it.

    Attributes:
        heads: Query heads ``H`` (per rank: after a Ulysses / tensor-parallel split).
        heads_kv: KV heads ``H_kv``.
        head_dim: ``D`` of queries and keys.
        dtype: ``str(torch.dtype)``, e.g. ``"torch.float32"``.
        device_type: ``"cpu"``, ``"cuda"``...
    """

    heads: int
    heads_kv: int
    head_dim: int
    dtype: str
    device_type: str

    @classmethod
    def of(cls, heads: int, heads_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
           ) -> ShapeKey:
        """The key of a layout (``dtype`` and ``device`` as torch objects or names)."""
        return cls(int(heads), int(heads_kv), int(head_dim), str(dtype), torch.device(device).type)

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``."""
        return getattr(torch, self.dtype.removeprefix("torch."))

    @property
    def layout(self) -> tuple[int, int, int, torch.dtype]:
        """The kernel's key in ``LAYOUT_CROSSOVERS``: ``(H, H_kv, D, dtype)``."""
        return self.heads, self.heads_kv, self.head_dim, self.torch_dtype

    def eligible(self) -> bool:
        """Whether the matmul path may run for this key at all (CPU, fp32 or upcast half precision)."""
        return self.dtype in _UPCAST and self.device_type == "cpu"

    def file_id(self) -> str:
        """The key in the JSON cache file: the layout, the torch version and the CPU thread count."""
        return (f"h{self.heads}-kv{self.heads_kv}-d{self.head_dim}-{self.dtype}-{self.device_type}"
                f"-torch{torch.__version__}-threads{torch.get_num_threads()}-probe{_PROBE_VERSION}")


_warned: set[str] = set()


def autotune_enabled() -> bool:
    """Whether :data:`AUTOTUNE_ENV` leaves the autotune on (the default)."""
    return os.environ.get(AUTOTUNE_ENV, "1").strip().lower() not in _OFF


def cache_path() -> Path | None:
    """The JSON cache file (``None``: switched off by :data:`CACHE_ENV`)."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in _OFF else Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "verl_trainer" / "attention_autotune.json"


def clear_cache() -> None:
    """Forget the in-process choices (the kernel's :data:`LAYOUT_CROSSOVERS`; the file stays)."""
    LAYOUT_CROSSOVERS.clear()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _read_file(path: Path) -> dict[str, int]:
    """The file's ``{file_id: crossover}`` (``{}`` when absent; a warning when unreadable)."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as err:
        _warn_once(f"attention autotune cache {path} is unreadable ({err}); measuring again")
        return {}
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(f"expected {{'format': {_FORMAT}, 'crossovers': {{...}}}}")
        entries = data["crossovers"]
        if not isinstance(entries, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entries.values()
        ):
            raise ValueError("crossovers must map keys to non-negative integers")
    except (ValueError, KeyError) as err:
        _warn_once(f"ignoring the corrupt attention autotune cache {path} ({err}); it is rewritten on the "
                   "next measurement (delete it to silence this)")
        return {}
    return dict(entries)


def _write_file(path: Path, key: ShapeKey, crossover: int) -> None:
    """Add ``key``'s crossover to the file, atomically (a temporary file renamed over it)."""
    entries = {**_read_file(path), key.file_id(): crossover}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"format": _FORMAT, "crossovers": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as err:
        _warn_once(f"could not write the attention autotune cache {path} ({err}); keeping it in memory")


def probe_lengths(length: int) -> list[int]:
    """The probe row at ``length``: ``length // 2 + 1 .. length`` in turn, about :data:`PROBE_TOKENS` tokens.

    Consecutive segments differ in length, so each length's segments lie apart in the row (gathered into
    their bucket), and each length has ``PROBE_TOKENS / (L/2 * 3L/4)`` segments: many at 8 tokens, one or
    two at 64, as in rows of sampled responses, where few segments share a long length.
    """
    cycle = list(range(length // 2 + 1, length + 1))
    count = max(len(cycle), PROBE_TOKENS // sum(cycle) * len(cycle))
    return [cycle[i % len(cycle)] for i in range(count)]


def measure_probe(key: ShapeKey, length: int, rounds: int = PROBE_ROUNDS) -> float:
    """Speed-up of the matmul path over sdpa for the segments of ``length // 2 + 1 .. length`` tokens.

    Both sides are the real packed attention (``bucketed_varlen_attention``) on one row of
    :func:`probe_lengths` in HF's layout, fwd+bwd, with ``matmul_max_length`` = ``length`` (every bucket on
    the matmul path) and ``length // 2`` (every bucket on sdpa).

    Args:
        key: The layout (``key.eligible()``).
        length: The longest segment of the row.
        rounds: Paired rounds (sides alternate; each round one fwd+bwd per side).

    Returns:
        ``fastest sdpa round / fastest matmul round`` (load from other processes only adds time).
    """
    with torch.inference_mode(False), torch.enable_grad():  # timed fwd+bwd even under no_grad
        lengths = probe_lengths(length)
        n, g = sum(lengths), torch.Generator().manual_seed(length)
        q, k, v = (
            torch.randn(1, n, h, key.head_dim, generator=g).to(key.torch_dtype).transpose(1, 2)
            .requires_grad_()
            for h in (key.heads, key.heads_kv, key.heads_kv)
        )
        grad = torch.randn(1, n, key.heads, key.head_dim, generator=g).to(q)

        def run(matmul_max_length: int) -> float:
            start = time.perf_counter()
            out = bucketed_varlen_attention(q, k, v, lengths, matmul_max_length=matmul_max_length)
            torch.autograd.grad(out, (q, k, v), grad)
            return time.perf_counter() - start

        run(length), run(length // 2)  # warm-up (plans and masks cached)
        matmul_s = sdpa_s = math.inf
        for i in range(rounds):
            if i % 2:
                matmul_s, sdpa_s = min(matmul_s, run(length)), min(sdpa_s, run(length // 2))
            else:
                sdpa_s, matmul_s = min(sdpa_s, run(length // 2)), min(matmul_s, run(length))
        return sdpa_s / max(matmul_s, 1e-9)


def choose_crossover(key: ShapeKey, probe: Probe = measure_probe) -> int:
    """The longest probed length up to which the matmul side was never clearly slower (0: none).

    Args:
        key: The layout.
        probe: ``probe(key, length) -> speed-up`` (the seam tests inject timings through).

    Returns:
        The crossover: buckets of segments up to it run the matmul path.
    """
    if not key.eligible():
        return 0
    crossover = 0
    for length in PROBE_LENGTHS:
        if length > max(MATMUL_MAX_LENGTH, key.head_dim):
            break
        speed_up = probe(key, length)
        if not math.isfinite(speed_up) or speed_up < KEEP_MATMUL_ABOVE:
            break
        crossover = length
    return crossover


def tune(key: ShapeKey, probe: Probe = measure_probe) -> int:
    """``key``'s crossover from the kernel's table, else the file, else measured (and stored in both).

    Args:
        key: The layout.
        probe: Passed to :func:`choose_crossover`.

    Returns:
        The crossover for ``key``.
    """
    if not key.eligible():
        return 0
    if key.layout in LAYOUT_CROSSOVERS:
        return LAYOUT_CROSSOVERS[key.layout]
    path = cache_path()
    stored = _read_file(path).get(key.file_id()) if path is not None else None
    if stored is None:
        stored = choose_crossover(key, probe)
        if path is not None:
            _write_file(path, key, stored)
    LAYOUT_CROSSOVERS[key.layout] = stored
    return stored


def _heads_of(model_config: PretrainedConfig, split: int) -> tuple[int, int, int] | None:
    """``(H, H_kv, D)`` per rank of an HF config split over ``split`` ranks (``None``: not evenly)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        return None
    heads_kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if heads % split or heads_kv % split:
        return None
    return heads // split, heads_kv // split, head_dim


def agree_on_model_attention(
    model_config: PretrainedConfig, device: torch.device | str, split: int = 1,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
) -> dict[str, int] | None:
    """Tune a model's layout once per dtype, the same on every rank; call it on every rank of the run.

    Rank 0 measures (or reads the cache); every rank of the default group gets rank 0's crossovers (one
    all-reduce of ``len(dtypes)`` integers), so all take the same path. Nothing happens with the autotune
    off, off CPU, or for a config without attention heads.

    Args:
        model_config: The HF model config (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``).
        device: Where the model computes.
        split: Ranks the heads are split over (Ulysses SP x tensor parallel size).
        dtypes: The dtypes the attention may run in.

    Returns:
        ``{str(dtype): crossover}`` agreed, or ``None`` when nothing was tuned.
    """
    shape = _heads_of(model_config, split)
    if shape is None or not autotune_enabled() or torch.device(device).type != "cpu":
        return None
    keys = [ShapeKey.of(*shape, dtype, device) for dtype in dtypes]
    mine = torch.tensor([tune(key) if get_rank() == 0 else 0 for key in keys], dtype=torch.long)
    if is_distributed():
        mine = all_reduce(mine)
    agreed = {key.dtype: int(value) for key, value in zip(keys, mine.tolist())}
    LAYOUT_CROSSOVERS.update((key.layout, agreed[key.dtype]) for key in keys)
    return agreed
