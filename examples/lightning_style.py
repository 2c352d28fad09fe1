"""A Lightning user's script, run on verl-trainer.

A DataModule, ``self.log``, Lightning's Trainer arguments, ``EarlyStopping`` / ``Timer``, then ``fit``,
``test`` and ``predict``. It fine-tunes a tiny model (built here; no download) on multi-turn chats, with
the loss on the assistant turns only. The training batches come as HF collators make them
(``input_ids`` / ``attention_mask`` / ``labels`` dicts, left-padded): the Trainer converts them to its
batch schema at the boundary.

    python examples/lightning_style.py --root /tmp/lightning_style        # CPU, ~1 minute
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from verl_trainer import Trainer
from verl_trainer.algorithms import SFT, SFTConfig
from verl_trainer.callbacks import EarlyStopping, Timer
from verl_trainer.data.sft import SFTDataset, TokenMask
from verl_trainer.engine import EngineConfig, OptimConfig
from verl_trainer.models.tiny import build_tokenizer, make_tiny_model


def chats(n: int, seed: int) -> list[dict]:
    """Two-turn arithmetic chats in TRL's conversational format (a ``messages`` column)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        a, b, c = (int(x) for x in torch.randint(0, 10, (3,), generator=g))
        rows.append({"messages": [
            {"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)},
            {"role": "user", "content": f"and +{c}?"}, {"role": "assistant", "content": str(a + b + c)},
        ]})
    return rows


def hf_collate(items: list[TokenMask]) -> dict[str, torch.Tensor]:
    """What an HF collator yields: left padding, labels = input ids with -100 where nothing is trained."""
    width = max(len(it.ids) for it in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, it in enumerate(items):
        row, trained = torch.tensor(it.ids), torch.tensor(it.loss_mask, dtype=torch.bool)
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
        labels[i, width - len(row):] = torch.where(trained, row, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class ChatData:
    """A Lightning-style DataModule (any object with ``*_dataloader()`` methods)."""

    def __init__(self, tokenizer, batch_size: int = 4) -> None:
        self.train = SFTDataset(chats(32, seed=0), tokenizer, max_length=64)
        self.val = SFTDataset(chats(8, seed=1), tokenizer, max_length=64)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        """Shuffled chats as HF-style dict batches."""
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, collate_fn=hf_collate)

    def val_dataloader(self) -> DataLoader:
        """Held-out chats as schema batches."""
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=self.val.collate)

    def test_dataloader(self) -> DataLoader:
        """The held-out chats."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The held-out chats."""
        return self.val_dataloader()


class ChatSFT(SFT):
    """SFT plus what a LightningModule would add: ``self.log`` and a ``predict_step``."""

    def training_step(self, batch, batch_idx):
        """Log the trained tokens of the step, then the SFT step."""
        self.log("train/assistant_tokens", batch["loss_mask"].sum(), reduce="sum")  # over ranks too
        return super().training_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        """Per-sample mean log-prob of the assistant tokens ``[B]``."""
        with self.actor.eval_mode():
            out = self.actor.infer_batch(batch)
        log_probs, mask = out["model_output"]["log_probs"], batch["loss_mask"]
        return (log_probs * mask).sum(-1) / mask.sum(-1).clamp_min(1)


def main() -> None:
    """Build the tiny model, fit, test and predict."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="outputs/lightning_style")
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    root = Path(args.root)
    model = make_tiny_model(root / "model", arch="llama", hidden_size=32, num_hidden_layers=2, seed=1)
    module = ChatSFT(SFTConfig(model_path=model, engine=EngineConfig(micro_batch_size_per_gpu=2),
                               optim=OptimConfig(lr=5e-3, weight_decay=0.0)))
    trainer = Trainer(
        devices=args.devices, max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=1.0,
        limit_train_batches=4, val_check_interval=0.5, num_sanity_val_steps=1, default_root_dir=root,
        logger="csv", enable_progress_bar=False,
        callbacks=[EarlyStopping(monitor="val/loss", patience=3), Timer(duration="00:00:30:00")],
    )
    data = ChatData(build_tokenizer())
    trainer.fit(module, datamodule=data)
    tested = trainer.test(module, datamodule=data)
    predicted = torch.cat(trainer.predict(module, datamodule=data))
    if trainer.is_global_zero:
        print(f"steps={trainer.global_step} val/loss={trainer.callback_metrics['val/loss']:.4f} "
              f"test/loss={tested[0]['test/loss']:.4f} "
              f"assistant_tokens={trainer.callback_metrics['train/assistant_tokens']:.0f} "
              f"predicted={predicted.numel()} mean_log_prob={predicted.mean():.4f}", flush=True)


if __name__ == "__main__":
    main()
