import pytest
import torch

from verl_trainer.data import schema
from verl_trainer.data.prompts import PromptDataset, load_prompts, read_rows
from verl_trainer.data.sft import SFTDataset, encode_sft_example
from verl_trainer.data.tasks import (
    ArithmeticTaskConfig,
    all_problems,
    make_arithmetic_rows,
    solve,
    write_arithmetic_task,
)
from verl_trainer.models import build_tokenizer
from verl_trainer.rewards import compute_rewards


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_deterministic_and_correct():
    cfg = ArithmeticTaskConfig(num_train=50, num_val=20, seed=5)
    a, b = make_arithmetic_rows(cfg), make_arithmetic_rows(cfg)
    assert a == b
    other = make_arithmetic_rows(ArithmeticTaskConfig(num_train=50, num_val=20, seed=6))
    assert other != a
    train, val = a
    assert len(train) == 50 and len(val) == 20
    assert len({r["prompt"] for r in val}) == 20  # without replacement
    for row in train + val:
        q = row["prompt"]
        x, y = q[:-1].split("+")
        assert row["reward_model"]["ground_truth"] == str(int(x) + int(y))
        assert 0 <= int(x) <= 9 and 0 <= int(y) <= 9
        assert row["data_source"] == "arithmetic" and row["extra_info"]["question"] == q
    # every ground truth is scored correct by the default reward
    texts = [r["reward_model"]["ground_truth"] for r in train]
    scores = compute_rewards(texts, texts, ["arithmetic"] * len(texts), "math")
    assert (scores == 1.0).all()


def test_holdout_ops_and_chat():
    cfg = ArithmeticTaskConfig(num_train=200, num_val=10, holdout_fraction=0.2, operations=("+", "-", "*"),
                               max_operand=4, chat=True)
    assert len(all_problems(cfg)) == 75
    train, val = make_arithmetic_rows(cfg)
    train_q = {r["extra_info"]["question"] for r in train}
    val_q = {r["extra_info"]["question"] for r in val}
    assert not train_q & val_q
    assert train[0]["prompt"][0]["role"] == "user"
    assert solve(2, "-", 4) == -2 and solve(3, "*", 4) == 12
    with pytest.raises(ValueError, match="operations"):
        ArithmeticTaskConfig(operations=("/",))
    with pytest.raises(ValueError, match="min_operand"):
        ArithmeticTaskConfig(min_operand=5, max_operand=1)
    with pytest.raises(ValueError, match="holdout_fraction"):
        ArithmeticTaskConfig(holdout_fraction=1.0)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_write_files_and_read_back(tmp_path, tok, fmt):
    cfg = ArithmeticTaskConfig(num_train=30, num_val=8, seed=1)
    paths = write_arithmetic_task(tmp_path, cfg, fmt=fmt)
    assert set(paths) == {"train", "val", "sft_train", "sft_val"}
    records = load_prompts(paths["train"])
    train, _ = make_arithmetic_rows(cfg)
    assert [r["ground_truth"] for r in records] == [t["reward_model"]["ground_truth"] for t in train]
    assert read_rows(paths["sft_val"])[0].keys() == {"prompt", "response"}
    again = write_arithmetic_task(tmp_path / "again", cfg, fmt=fmt)
    assert read_rows(again["train"]) == read_rows(paths["train"])
    ds = PromptDataset(paths["val"], tok, max_prompt_length=8)
    assert len(ds) == 8 and tok.decode(ds[0]["input_ids"]).endswith("=")


def test_sft_dataset_matches_rl_prompts(tmp_path, tok):
    paths = write_arithmetic_task(tmp_path, ArithmeticTaskConfig(num_train=6, num_val=2, seed=2))
    sft = SFTDataset(paths["sft_train"], tok, max_length=16)
    rl = PromptDataset(paths["train"], tok)
    for i in range(len(sft)):
        prompt_ids, response_ids = sft[i]
        assert prompt_ids == rl[i]["input_ids"]  # the warm start sees exactly the RL prompt tokens
        assert response_ids[-1] == tok.eos_token_id
        assert tok.decode(response_ids, skip_special_tokens=True) == rl[i]["ground_truth"]
    batch = sft.collate([sft[i] for i in range(len(sft))])
    mask = batch[schema.LOSS_MASK]
    assert torch.equal(mask.sum(-1).long(), batch[schema.RESPONSE_LEN])
    assert torch.equal(batch[schema.RESPONSE_LEN], torch.tensor([len(sft[i][1]) for i in range(len(sft))]))
    assert encode_sft_example(tok, [{"role": "user", "content": "1+1="}], "2")[0] == \
        tok.encode("user: 1+1=\nassistant: ", add_special_tokens=False)
    with pytest.raises(ValueError, match="max_length=3"):
        SFTDataset(paths["sft_train"], tok, max_length=3)
    with pytest.raises(ValueError, match="'prompt' and 'response'"):
        SFTDataset([{"prompt": "x"}], tok)
