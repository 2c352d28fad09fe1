"""A frozen neural reward model scored through the engine layer (``algorithm.reward.model``).

The model (``AutoModelForSequenceClassification``, one label) runs as an inference-only ``value_model``
engine (:func:`verl_trainer.models.loading.load_reward_model`: its own head, no bias added), so it is
sharded over the DP ranks, micro-batched and offloadable like the reference policy. A value engine's output
at position ``t`` is the head at position ``t - 1`` (``engine/heads.py``), so each input is the reward
model's tokens of prompt + response followed by one extra token, and a sequence's score is the output at
that extra token: the head at the last real token, what ``*ForSequenceClassification`` returns.

The reward model reads text, not the policy's ids: the prompt as written and the decoded response are
tokenised with its own tokenizer — a chat prompt through its chat template (the response as the assistant
turn) when it has one, else the messages' contents joined by new lines followed by the response.

A reward model can also be named among the reward functions, TRL's style
(``RewardConfig(name=[my_fn, "path/to/rm"], weights=[1.0, 0.5])``): :func:`split_reward_models` moves a
directory holding a ``*ForSequenceClassification`` checkpoint into ``RewardConfig.model``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.algorithms.config import RewardConfig, RewardModelConfig
from verl_trainer.algorithms.stages import StepMetrics
from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.data.schema import non_tensor_lists
from verl_trainer.models.loading import load_reward_model, load_tokenizer
from verl_trainer.models.source import resolve_model_path
from verl_trainer.module import EngineSpec
from verl_trainer.rollout import RESPONSE_TEXT
from verl_trainer.utils.distributed import all_reduce

__all__ = ["REWARD_MODEL_ENGINE", "RewardModel", "RewardModelScores", "is_reward_model_dir",
           "split_reward_models"]

REWARD_MODEL_ENGINE = "reward_model"
"""The engine's name in ``module.engines``."""


def is_reward_model_dir(spec: Any) -> bool:
    """Whether ``spec`` is a directory holding a ``*ForSequenceClassification`` checkpoint."""
    if not isinstance(spec, str) or ":" in spec:
        return False
    config = Path(spec) / "config.json"
    if not config.is_file():
        return False
    architectures = json.loads(config.read_text()).get("architectures") or []
    return any(str(a).endswith("ForSequenceClassification") for a in architectures)


def split_reward_models(config: RewardConfig) -> RewardConfig:
    """``config`` with a reward-model directory among ``name`` moved into ``config.model`` (TRL's style).

    Raises:
        ValueError: More than one reward model (named, or named and ``model.enable``).
    """
    names = config.name if isinstance(config.name, (list, tuple)) else [config.name]
    weights = list(config.weights) if config.weights is not None else [1.0] * len(names)
    models = [i for i, n in enumerate(names) if is_reward_model_dir(n)]
    if not models:
        return config
    if len(models) > 1 or config.model.enable:
        found = [names[i] for i in models] + ([config.model.path] if config.model.enable else [])
        raise ValueError(f"one reward model per run; got {found} (algorithm.reward.name and "
                         "algorithm.reward.model.path)")
    i = models[0]
    rest = [n for j, n in enumerate(names) if j != i] or ["none"]
    rest_weights = [w for j, w in enumerate(weights) if j != i] or [1.0]
    model = dataclasses.replace(config.model, enable=True, path=names[i], weight=float(weights[i]))
    return dataclasses.replace(config, name=rest, weights=rest_weights, model=model)


class RewardModel:
    """Builds the reward model's engine spec and scores rollout batches with that engine.

    Args:
        config: ``algorithm.reward.model``.

    Raises:
        ModelNotFoundError: ``config.path`` is neither a local directory nor a cached hub id.
        ValueError: It holds no ``*ForSequenceClassification`` checkpoint (checked before any model loads).
    """

    def __init__(self, config: RewardModelConfig) -> None:
        local = resolve_model_path(config.path, "algorithm.reward.model.path")
        if not is_reward_model_dir(local):
            raise ValueError(f"algorithm.reward.model.path={config.path!r} is not a reward model: its "
                             "config.json names no *ForSequenceClassification architecture; save an "
                             "AutoModelForSequenceClassification(num_labels=1) there")
        self.config = dataclasses.replace(config, path=local)
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        """The reward model's own tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config.path)
        return self._tokenizer

    def engine_spec(self) -> EngineSpec:
        """An inference-only ``value_model`` engine that loads the checkpoint with its own head."""
        engine = self.config.engine.replace(model_path=self.config.path)
        build = functools.partial(load_reward_model, self.config.path)
        return EngineSpec("value_model", engine, None, model=build)

    def _text(self, prompt: Any, response: str) -> list[int]:
        tok = self.tokenizer
        if isinstance(prompt, list):
            if getattr(tok, "chat_template", None):
                messages = [*prompt, {"role": "assistant", "content": response}]
                return tok.encode(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
            prompt = "\n".join(str(m["content"]) for m in prompt)
        return tok.encode(str(prompt) + response, add_special_tokens=False)

    def inputs(self, prompts: Sequence[Any], responses: Sequence[str]) -> tuple[TensorDict, int]:
        """The engine's batch: each row the reward model's tokens of prompt + response, then one extra token.

        Returns:
            ``(batch [B], truncated)``: how many inputs kept only their last ``max_length - 1`` tokens.
        """
        tok = self.tokenizer
        extra = next(t for t in (tok.eos_token_id, tok.pad_token_id, 0) if t is not None)
        keep = self.config.max_length - 1
        ids, truncated = [], 0
        for prompt, response in zip(prompts, responses):
            row = self._text(prompt, response)
            truncated += len(row) > keep
            ids.append(row[-keep:] or [extra])
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        return make_batch(ids, [[int(extra)]] * len(ids), pad_token_id=int(pad)), truncated

    def score(self, engine: Any, prompts: Sequence[Any], responses: Sequence[str]
              ) -> tuple[torch.Tensor, int]:
        """``([B] scores, truncated)`` of the responses (a collective: every DP rank calls it).

        Args:
            engine: The reward model's engine (``module.engines["reward_model"]``).
            prompts: ``B`` prompts as written (strings or chat lists).
            responses: ``B`` decoded responses.
        """
        batch, truncated = self.inputs(prompts, responses)
        with engine.eval_mode():
            values = engine.infer_batch(batch)["model_output"]["values"]
        last = batch[schema.SEQ_LEN].to(values.device) - 1  # the extra token: the head at the last real one
        scores = values[torch.arange(values.shape[0], device=values.device), last]
        return scores.float().cpu(), truncated


class RewardModelScores:
    """The scorer's reward-model part: adds ``weight × score`` to each sample's reward (a collective).

    Args:
        model: The reward model.
        engine: Its engine (``module.engines["reward_model"]``).
        dp_group: The DP process group (the truncation count is summed over it).
    """

    def __init__(self, model: RewardModel, engine: Any, dp_group: dist.ProcessGroup | None = None) -> None:
        self.model = model
        self.engine = engine
        self.dp_group = dp_group

    def __call__(self, batch: TensorDict, scores: torch.Tensor, info: dict[str, torch.Tensor],
                 metrics: StepMetrics, prefix: str) -> None:
        """Add the weighted score to ``scores`` in place.

        Its own is ``info["model"]`` (logged as ``{prefix}/model``); ``{prefix}/model/truncated`` counts the
        inputs cut to ``max_length``.
        """
        data = non_tensor_lists(batch, ("columns", RESPONSE_TEXT))
        prompts = [c.get("prompt") for c in data["columns"]]
        model_scores, truncated = self.model.score(self.engine, prompts, data[RESPONSE_TEXT])
        scores += self.model.config.weight * model_scores
        info["model"] = model_scores
        count = all_reduce(torch.tensor(float(truncated)), self.dp_group)
        metrics[f"{prefix}/model/truncated"] = float(count)
