"""Shared pieces of the trainer tests: a tiny model, a synthetic SFT datamodule, a recording callback."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from verl_trainer.algorithms.sft import SFT, SFTConfig
from verl_trainer.callbacks import HOOK_NAMES, Callback
from verl_trainer.data.sft import SFTDataset, collate_sft
from verl_trainer.engine import EngineConfig, OptimConfig
from verl_trainer.models.tiny import make_tiny_model


def tiny_model(path: str | Path) -> str:
    """A 2-layer Llama with hidden size 32 (seconds to build, milliseconds per step)."""
    return make_tiny_model(path, arch="llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, seed=1)


def synthetic_pairs(n: int = 32, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Prompt/response token-id pairs of varying lengths."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        p = int(torch.randint(2, 7, (1,), generator=g))
        r = int(torch.randint(2, 9, (1,), generator=g))
        pairs.append((torch.randint(4, 60, (p,), generator=g).tolist(),
                      torch.randint(4, 60, (r,), generator=g).tolist()))
    return pairs


class SFTData:
    """A Lightning-style datamodule: shuffled training pairs, and a small validation set."""

    def __init__(self, n: int = 32, batch_size: int = 4, val: int = 0) -> None:
        self.train = SFTDataset(synthetic_pairs(n, seed=0))
        self.val = SFTDataset(synthetic_pairs(val, seed=1)) if val else None
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, collate_fn=collate_sft)

    def val_dataloader(self) -> DataLoader | None:
        if self.val is None:
            return None
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=collate_sft)


def sft_module(model_path: str, micro_batch_size: int = 2, lr: float = 1e-3, optimizer: str = "adamw") -> SFT:
    engine = EngineConfig(micro_batch_size_per_gpu=micro_batch_size)
    optim = OptimConfig(lr=lr, weight_decay=0.0, optimizer=optimizer)
    return SFT(SFTConfig(model_path=model_path, engine=engine, optim=optim))


class HookRecorder(Callback):
    """Records every hook call as its name (on this rank)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        if name in HOOK_NAMES:
            calls = object.__getattribute__(self, "calls")

            def record(*args: Any, **kwargs: Any) -> None:
                calls.append(name)

            return record
        return object.__getattribute__(self, name)


def read_csv_metrics(root: str | Path) -> dict[int, dict[str, float]]:
    """step -> {name: value} of every ``metrics.csv`` under ``root`` (later versions win)."""
    rows: dict[int, dict[str, float]] = {}
    for path in sorted(Path(root).glob("**/metrics.csv")):
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                step = int(row.pop("step"))
                rows.setdefault(step, {}).update({k: float(v) for k, v in row.items() if v != ""})
    return rows


SCRIPT = Path(__file__).parent / "scripts" / "fit_sft.py"


def run_script(*args: str, timeout: float = 300, torchrun: bool = False) -> tuple[int, str, float]:
    """Run ``scripts/fit_sft.py`` as a plain ``python`` command in its own session.

    Returns:
        (exit code, stdout + stderr, seconds).
    """
    import os
    import subprocess
    import sys
    import time

    from verl_trainer.testing.ranks import find_free_port

    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
                 "VERL_TRAINER_LAUNCHER_PID", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    cmd = [sys.executable]
    if torchrun:
        cmd += ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={find_free_port()}"]
    cmd += [str(SCRIPT), *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, start_new_session=True)
    return proc.returncode, proc.stdout, time.monotonic() - start


def assert_all_gone(root: str | Path, timeout: float = 20.0) -> None:
    """Every process that wrote a pid file under ``root/pids`` has exited."""
    import time

    pids = [int(p.read_text()) for p in Path(root, "pids").glob("*.pid")]
    assert pids, "no pid files written"
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        time.sleep(0.2)
    assert not alive, f"processes {alive} are still running"


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return True
