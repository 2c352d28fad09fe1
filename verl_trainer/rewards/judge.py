"""LLM-as-judge rewards: a rubric prompt to a judge model, its answer parsed into a score.

:class:`LLMJudge` is a reward function with verl's signature: for each response it renders
:attr:`JudgeConfig.rubric` (placeholders ``{question}`` — ``extra_info["question"]`` or
``extra_info["prompt"]``, ``{response}``, ``{reference}`` — the ground truth, ``{data_source}``), asks the
judge through an OpenAI-compatible ``/v1/chat/completions`` endpoint and parses the answer with a parser of
:data:`JUDGE_PARSERS`:

* ``score``: the last ``Score: N`` (``score``/``rating``, ``:`` or ``=``, case-insensitive) in
  ``[min_score, max_score]``, returned as ``(N - min_score) / (max_score - min_score)`` in ``[0, 1]``;
* ``verdict``: the last standalone ``yes`` / ``no`` (or ``correct`` / ``incorrect``): 1.0 / 0.0 — a
  generative reward model's yes/no judgement.

The judge is either a served model (``base_url``: the policy's token server, vLLM's server, any
OpenAI-compatible endpoint) or a causal LM directory (``model_path``: loaded as a second HF engine behind a
token server of its own on 127.0.0.1, started on first use — the generative reward model option).

Failures follow ``algorithm.reward.on_error`` (:mod:`verl_trainer.rewards.failures`): an answer that does
not parse raises :class:`JudgeParseError` (naming the answer and the expected form), a request past
``timeout_s`` raises :class:`JudgeTimeoutError` (a ``TimeoutError``: counted in ``reward/timeouts``), an
error answer from the endpoint raises :class:`JudgeError`. Use in a config: ``algorithm.reward.name:
my_judges.py:judge`` with ``judge = LLMJudge(JudgeConfig(...))`` in ``my_judges.py``, or the object in
Python.
"""

from __future__ import annotations

import math
import re
import string
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verl_trainer.utils.registry import Registry

__all__ = ["DEFAULT_RUBRIC", "JUDGE_PARSERS", "JudgeConfig", "JudgeError", "JudgeParseError",
           "JudgeTimeoutError", "LLMJudge", "parse_score", "parse_verdict"]

DEFAULT_RUBRIC = (
    "Grade the response to the question against the reference answer.\n"
    "Question: {question}\nReference: {reference}\nResponse: {response}\n"
    "Reply with 'Score: N', N from 0 (wrong) to 10 (fully correct)."
)
PLACEHOLDERS = ("question", "response", "reference", "data_source")


class JudgeError(RuntimeError):
    """The judge endpoint answered with an error (its status and message)."""


class JudgeParseError(ValueError):
    """The judge's answer holds no score in the expected form."""


class JudgeTimeoutError(TimeoutError):
    """The judge did not answer within ``JudgeConfig.timeout_s``."""


_SCORE = re.compile(r"(?:score|rating)\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_VERDICT = re.compile(r"\b(yes|no|correct|incorrect)\b", re.IGNORECASE)


def parse_score(text: str, config: JudgeConfig) -> float:
    """The last ``Score: N`` of ``text``, mapped from ``[min_score, max_score]`` to ``[0, 1]``.

    Raises:
        JudgeParseError: No ``Score: N``, or ``N`` outside the range.
    """
    found = _SCORE.findall(text)
    if not found:
        raise JudgeParseError(f"the judge answered {text[:200]!r}, with no 'Score: N' (N in "
                              f"[{config.min_score:g}, {config.max_score:g}]); make the rubric ask for that "
                              "form")
    value = float(found[-1])
    if not config.min_score <= value <= config.max_score:
        raise JudgeParseError(f"the judge's score {value:g} is outside [{config.min_score:g}, "
                              f"{config.max_score:g}] (answer {text[:200]!r})")
    return (value - config.min_score) / (config.max_score - config.min_score)


def parse_verdict(text: str, config: JudgeConfig) -> float:
    """1.0 for a last ``yes`` / ``correct``, 0.0 for ``no`` / ``incorrect``.

    Raises:
        JudgeParseError: Neither word stands alone in ``text``.
    """
    found = _VERDICT.findall(text)
    if not found:
        raise JudgeParseError(f"the judge answered {text[:200]!r}, with no verdict (yes / no, correct / "
                              "incorrect); make the rubric ask for one")
    return 1.0 if found[-1].lower() in ("yes", "correct") else 0.0


JUDGE_PARSERS: Registry[Callable[[str, JudgeConfig], float]] = Registry("judge parser")
"""Judge-answer parsers by name: ``parser(answer text, config) -> score``, raising
:class:`JudgeParseError`; register more with ``JUDGE_PARSERS.register("name")``."""
JUDGE_PARSERS.add("score", parse_score)
JUDGE_PARSERS.add("verdict", parse_verdict)


@dataclass
class JudgeConfig:
    """Where the judge runs, what it is asked and how its answer becomes a score.

    Attributes:
        base_url: An OpenAI-compatible base URL (``http://127.0.0.1:8000/v1``); exclusive with
            ``model_path``.
        model_path: A causal LM directory run here as a second engine (greedy unless ``temperature > 0``).
        model: The model name sent (``None``: the server's default).
        rubric: The prompt template (placeholders: ``{question}``, ``{response}``, ``{reference}``,
            ``{data_source}``; ``{response}`` required).
        parser: A name in :data:`JUDGE_PARSERS` (``score``, ``verdict``) or a callable.
        min_score: Lowest score the rubric allows (``score`` parser).
        max_score: Highest score the rubric allows.
        max_tokens: Longest judge answer, in tokens.
        temperature: Judge sampling temperature (0: greedy).
        timeout_s: The longest one judge request may take; keep it below ``algorithm.reward.timeout_s``.
        device: Device of a ``model_path`` judge (``auto``, ``cpu``, ``cuda``).
    """

    base_url: str | None = None
    model_path: str | None = None
    model: str | None = None
    rubric: str = DEFAULT_RUBRIC
    parser: Any = "score"
    min_score: float = 0.0
    max_score: float = 10.0
    max_tokens: int = 32
    temperature: float = 0.0
    timeout_s: float = 30.0
    device: str = "auto"

    def __post_init__(self) -> None:
        where = "JudgeConfig"
        if bool(self.base_url) == bool(self.model_path):
            raise ValueError(f"{where}: give exactly one of base_url (a served judge, e.g. "
                             "'http://127.0.0.1:8000/v1') or model_path (a causal LM directory run here); "
                             f"got base_url={self.base_url!r}, model_path={self.model_path!r}")
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(self.rubric) if name is not None}
        except ValueError as exc:
            raise ValueError(f"{where}.rubric is not a valid template ({exc}); write literal braces as "
                             "{{ }}") from exc
        unknown = sorted(fields - set(PLACEHOLDERS))
        if unknown:
            raise ValueError(f"{where}.rubric uses {unknown}; the placeholders are {list(PLACEHOLDERS)}")
        if "response" not in fields:
            raise ValueError(f"{where}.rubric has no {{response}} placeholder: the judge would not see the "
                             "answer")
        if not callable(self.parser) and self.parser not in JUDGE_PARSERS:
            raise ValueError(f"{where}.parser={self.parser!r} is unknown; choose one of "
                             f"{JUDGE_PARSERS.keys_repr()} or give a callable parser(text, config) -> float")
        if not self.min_score < self.max_score:
            raise ValueError(f"{where}: min_score={self.min_score} must be below max_score={self.max_score}")
        if self.max_tokens < 1:
            raise ValueError(f"{where}.max_tokens={self.max_tokens} must be >= 1")
        if not (0 < self.timeout_s < math.inf):
            raise ValueError(f"{where}.timeout_s={self.timeout_s!r} must be a number of seconds in (0, inf)")


class LLMJudge:
    """A reward function (verl's signature) that asks a judge model (see the module docstring).

    Args:
        config: The judge's settings (checked when built).
    """

    def __init__(self, config: JudgeConfig) -> None:
        self.config = config
        self.parse = config.parser if callable(config.parser) else JUDGE_PARSERS[config.parser]
        self._lock = threading.Lock()
        self._server: Any = None
        self.__name__ = f"llm_judge({config.model_path or config.base_url})"

    @property
    def base_url(self) -> str:
        """The judge's endpoint (a ``model_path`` judge's server starts here, once)."""
        if self.config.base_url:
            return self.config.base_url.rstrip("/")
        with self._lock:
            if self._server is None:
                self._server = _local_judge_server(self.config)
            return self._server.url

    def close(self) -> None:
        """Stop a ``model_path`` judge's server (a later call starts it again)."""
        with self._lock:
            if self._server is not None:
                self._server.stop()
                self._server = None

    def prompt(self, solution_str: str, ground_truth: Any, data_source: str,
               extra_info: dict | None) -> str:
        """The rubric filled in for one response."""
        extra = extra_info if isinstance(extra_info, dict) else {}
        question = extra.get("question", extra.get("prompt", ""))
        return self.config.rubric.format(question=question, response=solution_str,
                                         reference="" if ground_truth is None else ground_truth,
                                         data_source=data_source)

    def ask(self, prompt: str) -> str:
        """The judge's answer text to ``prompt``.

        Raises:
            JudgeTimeoutError: No answer within ``timeout_s``.
            JudgeError: The endpoint answered with an error status.
        """
        import httpx

        body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}],
                                "max_tokens": self.config.max_tokens, "temperature": self.config.temperature}
        if self.config.model:
            body["model"] = self.config.model
        url = self.base_url + "/chat/completions"
        try:
            answer = httpx.post(url, json=body, timeout=self.config.timeout_s)
        except httpx.TimeoutException as exc:
            raise JudgeTimeoutError(f"the judge at {url} did not answer within timeout_s="
                                    f"{self.config.timeout_s:g}") from exc
        if answer.status_code != 200:
            raise JudgeError(f"the judge at {url} answered {answer.status_code}: {answer.text[:300]}")
        return str(answer.json()["choices"][0]["message"]["content"] or "")

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                 extra_info: dict | None = None) -> float:
        """The judge's score of ``solution_str`` (raises as :meth:`ask` and the parser do)."""
        text = self.ask(self.prompt(solution_str, ground_truth, data_source, extra_info))
        return float(self.parse(text, self.config))


def _local_judge_server(config: JudgeConfig) -> Any:
    """An HF engine of ``config.model_path`` behind a token server on 127.0.0.1 (started)."""
    from verl_trainer.rollout.config import RolloutConfig  # lazy: a model_path judge only (torch, models)
    from verl_trainer.rollout.hf import HFRollout  # lazy: as above
    from verl_trainer.serving.config import ServerConfig  # lazy: as above
    from verl_trainer.serving.server import TokenServer  # lazy: as above (and the serve extra)

    sample = config.temperature > 0
    rollout_config = RolloutConfig(max_new_tokens=config.max_tokens, do_sample=sample,
                                   temperature=config.temperature if sample else 1.0, device=config.device)
    engine = HFRollout(rollout_config, config.model_path)
    server = TokenServer(engine.generate_token_ids, rollout_config, engine.tokenizer, engine.eos_token_ids,
                         ServerConfig(model_name=config.model or "judge"))
    server.start()
    return server
