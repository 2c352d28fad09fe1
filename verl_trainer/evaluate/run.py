"""Evaluate a model without training: sample ``n`` responses per prompt, score them, report the "@k" numbers.

:func:`evaluate` is what ``python -m verl_trainer.evaluate`` runs, on one process::

    model (HF dir / cached hub id / checkpoint → converted to a temporary HF dir)
      → PromptDataset(data.val_files) → rollout (eval.rollout.name: hf | vllm | auto) × eval.n per prompt
      → reward functions (reward.name) → PromptSamples per prompt → summarize (overall, per data_source)
      → report: printed table, JSON (eval.output), loggers (eval.logger: wandb offline without a key)

The JSON report holds ``metrics`` (``pass@k``, ``maj@k``, ``mean@k``, ``best@k``, ``worst@k`` for each
``k``, ``num_prompts``, ``num_samples``), ``per_source`` (the same per ``data_source``) and ``prompts``: one
entry per prompt with ``index``, ``data_source``, ``prompt`` (as written in the file: text or chat
messages), ``n``, ``correct`` (the number of correct samples), ``scores``, ``answers`` and ``responses``
(each sample's text); plus ``model``, ``n``, ``k`` and ``report`` (a marker: an existing
``eval.output`` is replaced only when it holds one).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_trainer.agents import prompt_tool_schemas
from verl_trainer.algorithms.data import vision_processor
from verl_trainer.data.hub import parse_hub_dataset, resolve_hub_split, with_default_split
from verl_trainer.data.prompts import PromptDataset
from verl_trainer.data.schema import NON_TENSOR_KEYS, UID, non_tensor_lists
from verl_trainer.data.vlm_processor import VisionProcessor
from verl_trainer.evaluate.config import EvaluateConfig
from verl_trainer.evaluate.samples import PromptSamples, metric_names, prompt_samples, summarize
from verl_trainer.models.loading import load_tokenizer
from verl_trainer.models.source import ModelNotFoundError, resolve_model_path
from verl_trainer.rewards import RewardFunctions, compute_rewards
from verl_trainer.rollout import RESPONSE_TEXT, build_rollout
from verl_trainer.training.loggers import WANDB_PROJECT, build_loggers, make_wandb_logger, plain_hparams

if TYPE_CHECKING:
    from rich.table import Table
    from transformers import PreTrainedTokenizerBase

__all__ = ["REPORT_KIND", "evaluate", "format_table", "hf_model_dir", "log_report", "prompt_dataset",
           "write_report"]

REPORT_KIND = "verl_trainer.evaluate"
"""The ``report`` entry of every JSON report (an existing ``eval.output`` is replaced only with it)."""


@contextmanager
def hf_model_dir(model: str) -> Iterator[str]:
    """The HF directory of ``model``: itself, a cached hub id's snapshot, or a checkpoint converted to HF.

    A checkpoint (trainer ``step_*``, a checkpoints directory or an engine checkpoint) is converted into a
    temporary directory (:func:`verl_trainer.export.convert.convert_checkpoint`) that is removed on exit.

    Raises:
        FileNotFoundError: ``model`` is neither (the message says what was looked for).
    """
    from verl_trainer.export.convert import (  # lazy: 5 more modules only when used
        convert_checkpoint,
        find_engine_checkpoint,
    )

    try:
        local = resolve_model_path(model, "model")
    except ModelNotFoundError as not_model:
        try:
            find_engine_checkpoint(model)
        except FileNotFoundError as not_ckpt:
            raise FileNotFoundError(
                f"{model!r} is neither a model ({not_model}) nor a checkpoint ({not_ckpt})") from None
        local = None
    if local is not None:
        yield local
        return
    tmp = tempfile.mkdtemp(prefix="verl_trainer_eval_")
    try:
        yield convert_checkpoint(model, os.path.join(tmp, "hf"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # made by mkdtemp above: ours


def prompt_dataset(cfg: EvaluateConfig, tokenizer: PreTrainedTokenizerBase,
                   processor: VisionProcessor | None = None) -> PromptDataset:
    """The prompts of ``data.val_files``, encoded as training encodes them.

    ``processor``: a vision-language model's (:func:`~verl_trainer.algorithms.data.vision_processor`):
    rows with images are encoded with them (``data.image_key``), and the rollout generates from them.

    With ``eval.rollout.multi_turn`` on (and ``tools_in_prompt``), the chat template renders the tools'
    schemas into every prompt, as in the run that trained the model.

    Raises:
        FileNotFoundError: ``data.val_files`` is neither a file nor a cached hub dataset.
        ValueError: No prompt to evaluate, or tools the chat template does not render (``PromptDataset``).
    """
    data = cfg.data
    prompts = str(data.val_files)
    if parse_hub_dataset(prompts) is not None:
        resolve_hub_split(prompts, "data.val_files", "test")  # not cached, no such config / split: said here
        prompts = with_default_split(prompts, "test")
    elif not Path(prompts).is_file():
        raise FileNotFoundError(f"data.val_files={data.val_files!r} does not exist (relative paths start at "
                                f"{os.getcwd()})")
    dataset = PromptDataset(prompts, tokenizer, data.max_prompt_length, truncation=data.truncation,
                            chat_template=data.chat_template, prompt_key=data.prompt_key,
                            filter_overlong_prompts=data.filter_overlong_prompts,
                            tools=prompt_tool_schemas(cfg.eval.rollout.multi_turn), processor=processor,
                            image_key=data.image_key)
    if len(dataset) == 0:
        raise ValueError(f"data.val_files={data.val_files!r} has no prompts to evaluate")
    return dataset


def _sample_and_score(cfg: EvaluateConfig, model_dir: str) -> list[PromptSamples]:
    rewards = RewardFunctions(cfg.reward.name, cfg.reward.weights, cfg.reward.on_error, cfg.reward.timeout_s)
    tokenizer = load_tokenizer(model_dir)
    dataset = prompt_dataset(cfg, tokenizer, vision_processor(model_dir))
    rewards.check_data_sources(dataset.data_sources())  # before the model loads
    rollout = build_rollout(dataclasses.replace(cfg.eval.rollout, n=cfg.eval.n), model_dir, tokenizer)
    size = cfg.data.val_batch_size or len(dataset)
    prompts: list[PromptSamples] = []
    for start in range(0, len(dataset), size):
        items = [dataset[i] for i in range(start, min(start + size, len(dataset)))]
        batch = rollout.generate(dataset.collate(items))
        cols = non_tensor_lists(batch, (*NON_TENSOR_KEYS, RESPONSE_TEXT))
        texts = cols[RESPONSE_TEXT]
        sources = cols.get("data_source", ["unknown"] * len(texts))
        scores, info = compute_rewards(texts, cols.get("ground_truth", [None] * len(texts)), sources, rewards,
                                       cols.get("extra_info"), return_info=True, columns=cols.get("columns"))
        written = [c.get("prompt") for c in cols.get("columns") or [{} for _ in texts]]
        prompts += prompt_samples(batch[UID].tolist(), sources, texts, scores, info,
                                  cfg.eval.correct_threshold, prompts=written)
    return prompts


def evaluate(cfg: EvaluateConfig) -> dict[str, Any]:
    """Sample, score and summarise (see the module docstring); writes ``eval.output`` and logs.

    Returns:
        The report (what the JSON file holds).
    """
    ks = cfg.eval.ks
    with hf_model_dir(cfg.model) as model_dir:
        prompts = _sample_and_score(cfg, model_dir)
    metrics, per_source = summarize(prompts, ks)
    report = {
        "report": REPORT_KIND,
        "model": cfg.model,
        "n": cfg.eval.n,
        "k": ks,
        "metrics": metrics,
        "per_source": per_source,
        "prompts": [{"index": p.index, "data_source": p.data_source, "prompt": p.prompt, "n": p.n,
                     "correct": p.num_correct, "scores": p.scores, "answers": p.answers,
                     "responses": p.responses} for p in prompts],
    }
    if cfg.eval.output:
        write_report(report, cfg.eval.output)
    if cfg.eval.logger:
        log_report(report, cfg)
    return report


def write_report(report: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write the report as JSON (to a temporary name, then renamed into place).

    Raises:
        FileExistsError: ``path`` exists and is not a report this command wrote (nothing is overwritten).
    """
    out = Path(path)
    if out.exists():
        try:
            ours = json.loads(out.read_text()).get("report") == REPORT_KIND
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise FileExistsError(f"eval.output={str(out)!r} exists and is not a report of "
                                  "verl_trainer.evaluate; choose another file or remove it yourself")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out)
    return out


def flat_metrics(report: dict[str, Any], prefix: str = "eval") -> dict[str, float]:
    """``{prefix}/pass@1``, ..., ``{prefix}/{data_source}/pass@1``, ... of a report, for loggers."""
    out = {f"{prefix}/{name}": float(v) for name, v in report["metrics"].items()}
    for source, values in report["per_source"].items():
        out.update({f"{prefix}/{source}/{name}": float(v) for name, v in values.items()})
    return out


def log_report(report: dict[str, Any], cfg: EvaluateConfig) -> None:
    """Log the report's numbers (step 0) and the config to ``eval.logger`` under ``eval.root_dir``."""
    spec = cfg.eval.logger
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    named = cfg.eval.project_name is not None or cfg.eval.experiment_name is not None
    loggers = []
    for item in items:
        if item == "wandb" and named:
            name, project = cfg.eval.experiment_name, cfg.eval.project_name or WANDB_PROJECT
            loggers.append(make_wandb_logger(cfg.eval.root_dir, project=project, name=name))
        else:
            loggers += build_loggers(item, cfg.eval.root_dir)
    values = flat_metrics(report)
    for lg in loggers:
        lg.log_hyperparams(plain_hparams(cfg))
        lg.log_metrics(values, step=0)
        lg.finalize("success")


def format_table(report: dict[str, Any]) -> Table:
    """A ``rich`` table: one row per metric, one column for all prompts and one per ``data_source``."""
    from rich.table import Table

    sources = list(report["per_source"])
    table = Table(title=f"n={report['n']} samples per prompt", caption=str(report["model"]))
    table.add_column("metric")
    table.add_column("all", justify="right")
    for source in sources:
        table.add_column(source, justify="right")
    blocks = [report["metrics"], *(report["per_source"][s] for s in sources)]
    table.add_row("prompts", *(str(b["num_prompts"]) for b in blocks))
    for name in metric_names(report["k"]):
        table.add_row(name, *(f"{b[name]:.4f}" for b in blocks))
    return table
