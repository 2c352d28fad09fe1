"""``python -m verl_trainer.evaluate`` with the vLLM rollout: greedy, it reports what the HF rollout does."""

from __future__ import annotations

import json

import pytest

from tests.evaluate.test_evaluate_command import REWARD
from verl_trainer.data.prompts import save_rows, to_verl_row
from verl_trainer.evaluate.__main__ import main
from verl_trainer.models import make_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.own_process_group]  # the evaluation builds an in-process engine
pytest.importorskip("vllm")


def test_greedy_vllm_evaluation_equals_hf(tmp_path):
    # head size 32: vLLM's CPU attention has no kernel for smaller heads
    model = make_tiny_model(tmp_path / "model", hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                            max_position_embeddings=64, seed=3)
    rows = [to_verl_row(f"{a}+{b}=", str(a + b), "src") for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (7, 0)]]
    save_rows(rows, tmp_path / "val.jsonl")
    (tmp_path / "reward.py").write_text(REWARD)
    reports = {}
    for name in ("vllm", "hf"):
        out = tmp_path / f"{name}.json"
        args = [model, f"data.val_files={tmp_path / 'val.jsonl'}", "eval.n=1", "eval.k=[1]",
                f"eval.output={out}", f"reward.name={tmp_path / 'reward.py'}:compute_score",
                "eval.rollout.max_new_tokens=6", "eval.rollout.do_sample=false",
                "eval.rollout.max_model_len=64", f"eval.rollout.name={name}", "eval.logger=null"]
        assert main(args) == 0
        reports[name] = json.loads(out.read_text())
    vllm, hf = reports["vllm"], reports["hf"]
    assert [p["answers"] for p in vllm["prompts"]] == [p["answers"] for p in hf["prompts"]]
    scores = {name: [s for p in r["prompts"] for s in p["scores"]] for name, r in reports.items()}
    assert scores["vllm"] == pytest.approx(scores["hf"])
    assert vllm["metrics"] == pytest.approx(hf["metrics"])
    assert all(s > 0 for s in scores["hf"])  # 0.1 a character: text was generated
