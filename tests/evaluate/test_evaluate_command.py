"""``python -m verl_trainer.evaluate`` on a tiny saved model: the JSON report, the table, the loggers."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from verl_trainer.data.prompts import save_rows, to_verl_row
from verl_trainer.evaluate import best_at_k, maj_at_k, normalize_answer, pass_at_k, worst_at_k
from verl_trainer.evaluate.__main__ import main
from verl_trainer.models import make_tiny_model
from verl_trainer.rewards import extract_answer

REWARD = '''
from verl_trainer.evaluate import normalize_answer
from verl_trainer.rewards import extract_answer


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Correct: an even number as the final answer; the score also grows with the length."""
    answer = normalize_answer(extract_answer(solution_str))
    ok = float(answer is not None and answer.isdigit() and int(answer) % 2 == 0)
    return {"score": ok + 0.1 * len(solution_str), "acc": ok}
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("evaluate")
    model = make_tiny_model(root / "model", max_position_embeddings=64)
    rows = [to_verl_row(f"{a}+{b}=", str(a + b), "src_a" if i % 3 else "src_b")
            for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 1), (2, 2), (7, 0), (4, 4)])]
    save_rows(rows, root / "val.jsonl")
    (root / "reward.py").write_text(REWARD)
    return {"root": str(root), "model": model, "val": str(root / "val.jsonl"),
            "reward": f"{root / 'reward.py'}:compute_score"}


def _args(s: dict[str, str], out: Path, *extra: str) -> list[str]:
    return [s["model"], f"data.val_files={s['val']}", "eval.n=4", "eval.k=[1,2,4]", f"eval.output={out}",
            f"reward.name={s['reward']}", "eval.rollout.max_new_tokens=3", "eval.rollout.name=hf", *extra]


def test_report_holds_the_estimators_of_the_per_prompt_samples(setup, tmp_path, capsys):
    out = tmp_path / "report.json"
    logs = tmp_path / "logs"
    assert main(_args(setup, out, "eval.logger=[csv,wandb]", f"eval.root_dir={logs}")) == 0
    table = capsys.readouterr().out
    assert "pass@4" in table and "src_a" in table and "src_b" in table
    report = json.loads(out.read_text())
    assert report["k"] == [1, 2, 4] and report["n"] == 4
    prompts = report["prompts"]
    assert [p["index"] for p in prompts] == list(range(6))
    assert all(p["n"] == 4 and len(p["scores"]) == 4 for p in prompts)
    # correct: the reward's acc (the even final answers), recomputed from the saved answers
    for p in prompts:
        assert p["correct"] == sum(a is not None and a.isdigit() and int(a) % 2 == 0 for a in p["answers"])
    # each prompt's text as written and its responses: what the model said, next to its scores
    assert [p["prompt"] for p in prompts] == ["1+2=", "3+4=", "5+1=", "2+2=", "7+0=", "4+4="]
    assert all(len(p["responses"]) == 4 and all(isinstance(r, str) for r in p["responses"]) for p in prompts)
    for p in prompts:
        assert [normalize_answer(extract_answer(r)) for r in p["responses"]] == p["answers"]
    total = sum(p["correct"] for p in prompts)
    assert 0 < total < 24, "the case must have both correct and wrong samples"

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    for k in (1, 2, 4):
        m = report["metrics"]
        assert m[f"pass@{k}"] == pytest.approx(mean([pass_at_k(4, p["correct"], k) for p in prompts]))
        assert m[f"best@{k}"] == pytest.approx(mean([best_at_k(p["scores"], k) for p in prompts]))
        assert m[f"worst@{k}"] == pytest.approx(mean([worst_at_k(p["scores"], k) for p in prompts]))
        oks = [[float(a is not None and int(a) % 2 == 0) for a in p["answers"]] for p in prompts]
        assert m[f"maj@{k}"] == pytest.approx(mean([maj_at_k(p["answers"], ok, k)
                                                     for p, ok in zip(prompts, oks)]))
        assert m[f"mean@{k}"] == pytest.approx(mean([mean(p["scores"]) for p in prompts]))
    assert report["metrics"]["num_prompts"] == 6 and report["metrics"]["num_samples"] == 24
    per = report["per_source"]
    assert sorted(per) == ["src_a", "src_b"] and per["src_b"]["num_prompts"] == 2
    src_b = [p for p in prompts if p["data_source"] == "src_b"]
    assert per["src_b"]["pass@2"] == pytest.approx(mean([pass_at_k(4, p["correct"], 2) for p in src_b]))
    # logged: CSV and an offline wandb run
    with open(next(logs.glob("lightning_logs/version_*/metrics.csv"))) as f:
        row = next(csv.DictReader(f))
    assert float(row["eval/pass@2"]) == pytest.approx(report["metrics"]["pass@2"])
    assert float(row["eval/src_b/maj@4"]) == pytest.approx(per["src_b"]["maj@4"])
    assert list((logs / "wandb").glob("offline-run-*"))
    # seeded: the same report again; our own report is replaced, anything else is refused
    assert main(_args(setup, out, "eval.logger=null")) == 0
    assert json.loads(out.read_text()) == report
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": 1}')
    assert main(_args(setup, foreign, "eval.logger=null")) == 1
    assert "is not a report of verl_trainer.evaluate" in capsys.readouterr().err
    assert json.loads(foreign.read_text()) == {"mine": 1}


@pytest.mark.parametrize("extra, message", [
    (["eval.k=[1,8]"], "every k must be an int in [1, eval.n=4]"),
    (["eval.rollout.do_sample=false"], "draws 4 identical greedy responses"),
    (["eval.rollout.name=sglang"], "rollout name='sglang' is unknown"),
    (["reward.model.enable=true", "reward.model.path=x"], "scores with reward functions only"),
    (["reward.on_error=drop"], "evaluation keeps all eval.n samples"),
])
def test_bad_settings_fail_before_any_model_loads(setup, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit):
        main(_args(setup, tmp_path / "r.json", *extra))
    assert message in capsys.readouterr().err


def test_default_reward_refuses_an_unknown_data_source_before_the_model_loads(setup, tmp_path, capsys):
    save_rows([to_verl_row("1+1=", "2", "my_task")], tmp_path / "val.jsonl")
    args = [setup["model"], f"data.val_files={tmp_path / 'val.jsonl'}", "eval.logger=null"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "no scorer for the data source(s) ['my_task']" in err and "Loading weights" not in err


def test_a_path_that_is_neither_model_nor_checkpoint(setup, tmp_path, capsys):
    assert main([str(tmp_path / "nothing"), f"data.val_files={setup['val']}", "eval.logger=null"]) == 1
    err = capsys.readouterr().err
    assert "is neither a model" in err and "nor a checkpoint" in err


def _fit_and_checkpoint(model_path: str, root: str) -> None:
    from tests.trainer.common import SFTData, sft_module
    from verl_trainer import Trainer
    from verl_trainer.callbacks import ModelCheckpoint

    trainer = Trainer(strategy="fsdp2", devices=1, max_steps=2, default_root_dir=root, logger=False,
                      enable_progress_bar=False, seed=3, callbacks=[ModelCheckpoint(every_n_train_steps=2)])
    trainer.fit(sft_module(model_path), SFTData(n=16, batch_size=4))


@pytest.mark.slow
def test_a_checkpoint_evaluates_as_its_hf_export(setup, tmp_path, monkeypatch):
    import tempfile

    from tests.trainer.common import tiny_model
    from verl_trainer.export.convert import convert_checkpoint
    from verl_trainer.testing.ranks import run_distributed

    model = tiny_model(tmp_path / "model")
    run_distributed(_fit_and_checkpoint, 1, model, str(tmp_path / "run"), timeout=300)
    checkpoints = tmp_path / "run" / "checkpoints"
    hf = convert_checkpoint(checkpoints, tmp_path / "hf")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the checkpoint's HF copy goes
    reports = []
    for model in (str(checkpoints), hf):
        out = tmp_path / f"{len(reports)}.json"
        assert main([model, *_args(setup, out, "eval.logger=null")[1:]]) == 0
        reports.append(json.loads(out.read_text()))
    assert reports[0]["prompts"] == reports[1]["prompts"]
    assert reports[0]["metrics"] == reports[1]["metrics"]
    assert not list(scratch.iterdir()), "the temporary HF copy of the checkpoint is removed"


def test_a_cached_hub_dataset_id_is_evaluated_on_its_test_split(setup, tmp_path, monkeypatch, capsys):
    """``data.val_files=org/name``: read from the local HF hub cache (split ``test``); a missing id fails."""
    datasets = pytest.importorskip("datasets")
    from verl_trainer.testing.hub_cache import write_cached_dataset

    rows = [to_verl_row(f"{a}+{a}=", str(2 * a), "src_a") for a in range(5)]
    write_cached_dataset(tmp_path / "hf_home" / "hub", "tiny-org/tiny-eval", {
        "data/train.jsonl": "".join(json.dumps(r) + "\n" for r in rows[:4]),
        "data/test.jsonl": "".join(json.dumps(r) + "\n" for r in rows[2:]),
    })
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_home" / "datasets"))
    out = tmp_path / "report.json"
    args = [setup["model"], "eval.n=2", "eval.k=[1]", f"eval.output={out}", f"reward.name={setup['reward']}",
            "eval.rollout.max_new_tokens=2", "eval.rollout.name=hf", "eval.logger=null"]
    assert main([*args, "data.val_files=tiny-org/tiny-eval"]) == 0
    assert [p["index"] for p in json.loads(out.read_text())["prompts"]] == [0, 1, 2]  # the 3 test rows
    capsys.readouterr()
    assert main([*args, "data.val_files=tiny-org/missing"]) == 1
    err = capsys.readouterr().err
    assert "data.val_files='tiny-org/missing' is not a local file" in err and "Loading weights" not in err
    assert "hf download --repo-type dataset tiny-org/missing" in err


def test_multi_turn_evaluation_renders_the_tool_schemas_into_the_prompts(tmp_path):
    """As training does: with ``eval.rollout.multi_turn`` on, the prompts carry the tools' schemas."""
    from tests.agents.test_prompt_tools import CALCULATOR, TOOLS_TEMPLATE, _tokenizer
    from verl_trainer.evaluate.config import EvaluateConfig
    from verl_trainer.evaluate.run import prompt_dataset
    from verl_trainer.recipe_config.loading import parse_recipe_args

    rows = [to_verl_row([{"role": "user", "content": "12*34="}], "408", "arithmetic")]
    save_rows(rows, tmp_path / "v.jsonl")
    tokenizer = _tokenizer(TOOLS_TEMPLATE)
    base = ["model=m", f"data.val_files={tmp_path / 'v.jsonl'}", "data.max_prompt_length=512"]

    def prompt_text(*extra: str) -> str:
        cfg = parse_recipe_args(EvaluateConfig, None, [*base, *extra])
        return tokenizer.decode(list(prompt_dataset(cfg, tokenizer)[0]["input_ids"]))

    text = prompt_text("eval.rollout.multi_turn.enable=true", f"eval.rollout.multi_turn.tools=[{CALCULATOR}]")
    assert '"calculator"' in text and '"expression"' in text and text.endswith("user: 12*34=\nassistant: ")
    assert prompt_text() == "user: 12*34=\nassistant: "
