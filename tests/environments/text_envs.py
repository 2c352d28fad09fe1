"""Text environments defined for the adapter tests: a digit-guessing game as a gymnasium environment (text
spaces) and as an OpenEnv environment (pydantic action / observation), and the rank function that trains
2 GRPO steps on each adapter (gymnasium, OpenEnv, reasoning-gym) in one spawned rank.

The game: the hidden digit comes from the episode's seed; a message containing it wins (reward 1, done),
any other gets ``"no, try again"``; the third wrong guess ends the episode (reward 0).
"""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Any

import pytest

# the envs extra (.ci/run installs it)
pytest.importorskip("gymnasium", reason="needs the envs extra: pip install -e '.[envs]'")
pytest.importorskip("openenv", reason="needs the envs extra: pip install -e '.[envs]'")
pytest.importorskip("reasoning_gym", reason="needs the envs extra: pip install -e '.[envs]'")

import gymnasium
from openenv.core.env_server.interfaces import Environment as OpenEnvBase
from openenv.core.env_server.types import Action, Observation, State

from verl_trainer.environments.openenv import OpenEnvEnvironment

GYM_ID = "tests.environments.text_envs:VerlTest/GuessDigit-v0"
TRIES = 3


def _prompt(seed: int) -> str:
    return f"Game {seed}: guess the digit (0-9)."


class GuessDigitGym(gymnasium.Env):
    """The game with gymnasium text spaces (the action: at most 24 printable characters)."""

    observation_space = gymnasium.spaces.Text(max_length=64, charset=string.printable)
    action_space = gymnasium.spaces.Text(max_length=24, min_length=0, charset=string.printable)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self.digit, self.tries = str(int(self.np_random.integers(10))), 0
        return _prompt(seed or 0), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.tries += 1
        won = self.digit in action
        return ("" if won else "no, try again"), float(won), won, self.tries >= TRIES and not won, {}


gymnasium.register(id="VerlTest/GuessDigit-v0", entry_point=GuessDigitGym)


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    message: str = ""


class GuessDigitOpenEnv(OpenEnvBase):
    """The game as an OpenEnv server-side environment."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self.digit, self.tries = str(random.Random(seed).randrange(10)), 0
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(message=_prompt(seed or 0), reward=0.0, done=False)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self.tries += 1
        self._state.step_count += 1
        won = self.digit in action.message
        return GuessObservation(message="" if won else "no, try again", reward=float(won),
                                done=won or self.tries >= TRIES)

    @property
    def state(self) -> State:
        return self._state


class GuessDigitAdapter(OpenEnvEnvironment):
    """The OpenEnv game in process."""

    action_cls = GuessAction

    def make_env(self) -> GuessDigitOpenEnv:
        return GuessDigitOpenEnv()


RG_PATH = ("reasoning_gym:basic_arithmetic@{split}?seed=3&size=200&val_fraction=0.3&max_terms=2&max_digits=1"
           '&operators=["+"]&allow_parentheses=false&allow_negation=false')


def fit_adapters(model: str, data: str, root: str) -> dict[str, list[dict[str, float]]]:
    """2 GRPO steps on each adapter in this rank (spawned); per adapter the metrics of each step."""
    import torch.distributed as dist

    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.callbacks import Callback
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.recipe_config import GRPORecipeConfig, load_config

    class Record(Callback):
        def __init__(self) -> None:
            self.metrics: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    common = [f"algorithm.model_path={model}", "data.train_batch_size=4", "algorithm.rollout.n=4",
              "algorithm.actor.ppo_mini_batch_size=4", "algorithm.actor.optim.lr=1e-3",
              "algorithm.rollout.temperature=1.0", "data.max_prompt_length=64", "data.val_files=null"]
    multi_turn = ["algorithm.rollout.multi_turn.enable=true", "algorithm.rollout.multi_turn.max_turns=3",
                  "algorithm.rollout.max_new_tokens=40", "algorithm.reward.name=none"]
    runs = {
        "gymnasium": [f"data.train_files={data}/gym.jsonl", *multi_turn,
                      "algorithm.rollout.multi_turn.environment="
                      "verl_trainer.environments.gymnasium:GymnasiumEnvironment"],
        "openenv": [f"data.train_files={data}/openenv.jsonl", *multi_turn,
                    "algorithm.rollout.multi_turn.environment=tests.environments.text_envs:GuessDigitAdapter"],
        "reasoning_gym": [f"data.train_files={RG_PATH.format(split='train')}",
                          "algorithm.rollout.max_new_tokens=4",
                          "algorithm.reward.name=verl_trainer.environments.reasoning_gym:score"],
    }
    out = {}
    for name, overrides in runs.items():
        cfg = load_config(GRPORecipeConfig, Path(__file__).resolve().parents[2] / "configs" / "grpo.yaml",
                          common + overrides)
        record = Record()
        trainer = Trainer(devices=dist.get_world_size(), max_steps=2, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          default_root_dir=f"{root}/{name}", val_check_interval=None, callbacks=[record],
                          seed=7)
        module = GRPO(cfg.algorithm)
        trainer.fit(module, datamodule=PromptDataModule(cfg.data, load_tokenizer(model)))
        out[name] = record.metrics
    return out


class ServedGuessDigit:
    """The OpenEnv game served by openenv's FastAPI app (uvicorn, 127.0.0.1, a free port) on a thread."""

    def __enter__(self) -> str:
        import socket
        import threading
        import time

        import uvicorn
        from openenv.core.env_server.http_server import create_fastapi_app

        app = create_fastapi_app(GuessDigitOpenEnv, GuessAction, GuessObservation, max_concurrent_envs=16)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the OpenEnv test server did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def client_adapter(base_url: str) -> type[OpenEnvEnvironment]:
    """An adapter whose episodes are WebSocket sessions of the server at ``base_url``."""
    from openenv.core.generic_client import GenericEnvClient

    class GuessDigitClient(OpenEnvEnvironment):
        action_cls = GuessAction

        def make_client(self) -> Any:
            return GenericEnvClient(base_url=base_url).sync().connect()

    return GuessDigitClient
