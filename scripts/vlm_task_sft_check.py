"""Does the tiny VLM learn the synthetic colour task by a short SFT? Greedy validation accuracy before/after.

Writes the task (:mod:`verl_trainer.data.vlm_task`), a tiny Qwen2.5-VL (:func:`make_tiny_vlm`), reads the
SFT and validation files with :class:`~verl_trainer.data.sft.SFTDataset` /
:class:`~verl_trainer.data.prompts.PromptDataset` and a :class:`VisionProcessor`, trains with plain AdamW on
the masked token loss (the model's own forward: ``pixel_values`` / ``image_grid_thw`` from
:func:`model_vision_inputs`, ``mm_token_type_ids`` for the mrope positions) and scores greedy answers with the
registered ``shape_colour`` reward. It checks the data path end to end; the trainer's engine path is the
recipes'.

    .venv/bin/python scripts/vlm_task_sft_check.py --steps 300
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import AutoModelForImageTextToText

from verl_trainer.data import schema
from verl_trainer.data.prompts import PromptDataset
from verl_trainer.data.sft import SFTDataset
from verl_trainer.data.vision import model_vision_inputs
from verl_trainer.data.vlm_processor import VisionProcessor
from verl_trainer.data.vlm_task import VLMTaskConfig, write_vlm_task
from verl_trainer.models.tiny_vlm import make_tiny_vlm
from verl_trainer.rewards import compute_rewards


@torch.no_grad()
def greedy_accuracy(model: torch.nn.Module, processor: VisionProcessor, prompts: PromptDataset,
                    max_new_tokens: int = 8) -> float:
    """Mean ``shape_colour`` reward of greedy answers to every validation prompt (batched, left-padded)."""
    model.eval()
    batch = prompts.collate([prompts[i] for i in range(len(prompts))])
    ids = batch[schema.PROMPTS]
    mask = (torch.arange(ids.shape[1]) >= ids.shape[1] - batch[schema.PROMPT_LEN][:, None]).long()
    out = model.generate(input_ids=ids, attention_mask=mask, mm_token_type_ids=processor.token_types(ids),
                         **model_vision_inputs(batch), max_new_tokens=max_new_tokens, do_sample=False)
    texts = processor.tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    data = {k: list(batch[k]) for k in ("ground_truth", "data_source", "extra_info")}
    scores = compute_rewards(texts, data["ground_truth"], data["data_source"], "shape_colour",
                             data["extra_info"])
    model.train()
    return float(scores.mean())


def main() -> None:
    """Write the task and model, score, train, score again (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--layout", default="verl", choices=["verl", "trl"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    work = tempfile.mkdtemp(prefix="vlm_task_")
    paths = write_vlm_task(work, VLMTaskConfig(num_train=512, num_val=64, layout=args.layout, seed=args.seed))
    processor = VisionProcessor.from_pretrained(make_tiny_vlm(f"{work}/model"))
    model = AutoModelForImageTextToText.from_pretrained(f"{work}/model", dtype=torch.float32)
    sft = SFTDataset(paths["sft_train"], processor=processor, max_length=64)
    val = PromptDataset(paths["val"], processor.tokenizer, 64, processor=processor)
    before = greedy_accuracy(model, processor, val)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    for step in range(args.steps):
        rows = torch.randint(len(sft), (args.batch_size,), generator=generator).tolist()
        batch = sft.collate([sft[i] for i in rows])
        ids, loss_mask = batch[schema.INPUT_IDS], batch[schema.LOSS_MASK]
        logits = model(input_ids=ids, attention_mask=batch[schema.ATTENTION_MASK],
                       mm_token_type_ids=processor.token_types(ids), **model_vision_inputs(batch)).logits
        token_loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:],
                                                       reduction="none")
        loss = (token_loss * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {loss.item():.4f}", flush=True)
    seconds = time.perf_counter() - start
    after = greedy_accuracy(model, processor, val)
    print(f"greedy val accuracy: {before:.3f} -> {after:.3f} after {args.steps} SFT steps of "
          f"{args.batch_size} ({seconds:.0f} s, layout {args.layout})")


if __name__ == "__main__":
    main()
