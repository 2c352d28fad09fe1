import torch

from verl_trainer.data import schema
from verl_trainer.data.packing import pack_batch
from verl_trainer.data.prompts import PromptDataset, make_prompt_dataloader
from verl_trainer.data.schema import tensor_only
from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
from verl_trainer.metrics import reduce_metrics
from verl_trainer.rewards import score_batch
from verl_trainer.rollout import RolloutConfig, build_rollout


def test_task_file_to_scored_batch(tmp_path, rollout_model_path, tokenizer):
    task = ArithmeticTaskConfig(num_train=8, num_val=4, seed=0)
    paths = write_arithmetic_task(tmp_path, task, fmt="parquet")
    dataset = PromptDataset(paths["train"], tokenizer, max_prompt_length=8)
    prompts = next(iter(make_prompt_dataloader(dataset, batch_size=4, seed=0)))
    rollout = build_rollout(RolloutConfig(n=2, max_new_tokens=4, seed=0), rollout_model_path)
    batch = rollout.generate(prompts)
    assert batch.batch_size == torch.Size([8])
    assert batch[schema.UID].tolist() == prompts[schema.UID].repeat_interleave(2).tolist()

    scores, metrics = score_batch(batch, "math")
    tls = batch[schema.TOKEN_LEVEL_SCORES]
    assert tls.shape == batch[schema.INPUT_IDS].shape
    assert torch.allclose(tls.sum(-1), scores)
    reduced = reduce_metrics([metrics])
    assert {"reward/mean", "reward/min", "reward/max", "reward/accuracy", "reward/format"} <= reduced.keys()

    # Once scored, the tensor part goes on to the engine (packing, exchange, balancing).
    packed = pack_batch(tensor_only(batch))
    assert packed.num_tokens == int(batch[schema.SEQ_LEN].sum())
    assert schema.TOKEN_LEVEL_SCORES in packed.fields
