"""GPU checks (``pytest -m gpu tests/gpu``): run by ``bench/gpu_check.sh`` where a CUDA device is lent.

They skip on a machine without CUDA (the CPU suite covers the same code on gloo); on one GPU they check
what the CPU cannot: a packed bf16 forward on CUDA (its kernels: ``test_varlen_cuda.py``), an fsdp2
and a DeepSpeed engine step over NCCL with bf16 mixed precision against the same step in fp32,
and a ``Trainer(accelerator="gpu", precision="bf16-mixed")`` fit.
"""

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from verl_trainer import Trainer
from verl_trainer.algorithms.sft import SFT, SFTConfig
from verl_trainer.callbacks import Callback
from verl_trainer.core_algos.losses import sft_loss
from verl_trainer.data.packing import make_batch, pack_batch
from verl_trainer.data.sft import SFTDataset
from verl_trainer.engine import EngineConfig, EngineRegistry, OptimConfig
from verl_trainer.models import VARLEN_ATTENTION, load_causal_lm, make_tiny_model, packed_forward
from verl_trainer.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LENGTHS = [37, 1, 120, 64, 5, 250]


def _model(tmp_path: Path) -> str:
    return make_tiny_model(tmp_path / "model", arch="llama", hidden_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, seed=1)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 60, (max(1, n // 3),), generator=g).tolist() for n in LENGTHS]
    responses = [torch.randint(4, 60, (n - len(p),), generator=g).tolist() for n, p in zip(LENGTHS, prompts)]
    return make_batch(prompts, responses)


def test_varlen_attention_bf16_cuda_matches_per_sample(tmp_path):
    path = _model(tmp_path)
    ref = load_causal_lm(path, torch_dtype=torch.bfloat16).cuda()
    model = load_causal_lm(path, attn_implementation=VARLEN_ATTENTION, torch_dtype=torch.bfloat16).cuda()
    batch = _batch()
    packed = pack_batch(batch).to("cuda")
    with torch.no_grad():
        got = packed.unpack(packed_forward(model, packed).logits.float())
        ids = batch["input_ids"].cuda()
        for i, n in enumerate(batch["seq_len"].tolist()):
            want = ref(ids[i:i + 1, :n], use_cache=False).logits[0].float()
            torch.testing.assert_close(got[i, :n], want, atol=3e-2, rtol=3e-2)
            assert not got[i, n:].any()


def _engine_step(backend: str, path: str, param_dtype: str) -> dict:
    cfg = EngineConfig(model_path=path, use_dynamic_bsz=True, max_token_len_per_gpu=256,
                       param_dtype=param_dtype)
    engine = EngineRegistry.new("language_model", backend, cfg, OptimConfig(lr=1e-3, weight_decay=0.0))
    engine.initialize()
    assert engine.device.type == "cuda"
    with engine.train_mode():
        first = engine.train_batch(_batch(), sft_loss())
        second = engine.train_batch(_batch(), sft_loss())
    return {"losses": [first["loss"], second["loss"]], "micro_batches": first["num_micro_batches"],
            "backend": torch.distributed.get_backend()}


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_engine_step_nccl_bf16_matches_fp32(tmp_path, backend):
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    path = _model(tmp_path)
    fp32 = run_distributed(_engine_step, 1, backend, path, "float32", backend="nccl", timeout=300)[0]
    bf16 = run_distributed(_engine_step, 1, backend, path, "bfloat16", backend="nccl", timeout=300)[0]
    assert fp32["backend"] == bf16["backend"] == "nccl"
    assert fp32["micro_batches"] >= 2  # 482 tokens at a 256-token budget
    torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(fp32["losses"]), rtol=2e-2, atol=0)
    assert fp32["losses"][1] < fp32["losses"][0]  # the step trained


class LossRecorder(Callback):
    """The reduced ``sft/loss`` of every step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.losses.append(float(trainer.callback_metrics["sft/loss"]))


def _collate(samples):
    return make_batch([p for p, _ in samples], [r for _, r in samples])


def _fit(path: str, root: str) -> list[float]:
    pairs = [(p[:8], r[:24]) for p, r in zip(_batch()["input_ids"].tolist(), _batch(1)["input_ids"].tolist())]
    data = DataLoader(SFTDataset(pairs * 4), batch_size=6, collate_fn=_collate)
    module = SFT(SFTConfig(model_path=path, optim=OptimConfig(lr=3e-3, weight_decay=0.0)))
    recorder = LossRecorder()
    trainer = Trainer(strategy="fsdp2", accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=4,
                      callbacks=[recorder], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root)
    trainer.fit(module, data)
    return recorder.losses


def test_trainer_fit_gpu_bf16(tmp_path):
    path = _model(tmp_path)
    losses = run_distributed(_fit, 1, path, str(tmp_path / "run"), backend="nccl", timeout=300)[0]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]

