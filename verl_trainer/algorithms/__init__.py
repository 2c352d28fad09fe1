"""Training algorithms as modules for ``Trainer.fit`` (see ``verl_trainer.module``).

* :class:`SFT` — supervised fine-tuning.
* :class:`PPO` — actor + critic (+ reference), GAE whitened over the global batch, critic warm-up.
* :class:`GRPO` — group-relative advantages over ``rollout.n`` samples per prompt, optional KL loss;
  DAPO options (clip-higher, token-mean, dynamic sampling, overlong shaping) through its config.
* :class:`DrGRPO` — GRPO with Dr.GRPO's config enforced.
"""

from verl_trainer.algorithms.config import (
    ActorConfig,
    CriticConfig,
    GRPOConfig,
    OverlongBufferConfig,
    PPOConfig,
    RefConfig,
    RewardConfig,
    RLConfig,
    ValidationRolloutConfig,
)
from verl_trainer.algorithms.data import DataConfig, PromptDataModule, SFTDataModule
from verl_trainer.algorithms.grpo import GRPO, DrGRPO
from verl_trainer.algorithms.ppo import PPO
from verl_trainer.algorithms.rl import RLModule
from verl_trainer.algorithms.sft import SFT, SFTConfig
from verl_trainer.data.sft import SFTDataset, collate_sft

__all__ = [
    "GRPO",
    "PPO",
    "SFT",
    "ActorConfig",
    "CriticConfig",
    "DataConfig",
    "DrGRPO",
    "GRPOConfig",
    "OverlongBufferConfig",
    "PPOConfig",
    "PromptDataModule",
    "RLConfig",
    "RLModule",
    "RefConfig",
    "RewardConfig",
    "SFTConfig",
    "SFTDataModule",
    "SFTDataset",
    "ValidationRolloutConfig",
    "collate_sft",
]
