"""The datamodule of preference optimisation: pairs or unpaired examples from files or rows.

Files and batch sizes as :class:`~verl_trainer.algorithms.data.DataConfig` (``train_batch_size``: pairs, or
unpaired examples, per step over all DP ranks; ``max_length``: the longest prompt + completion); rows in the
formats of :mod:`verl_trainer.data.preference`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from verl_trainer.algorithms.data import DataConfig, _DataModule
from verl_trainer.data import schema
from verl_trainer.data.preference import PreferenceDataset
from verl_trainer.utils.distributed import all_reduce

if TYPE_CHECKING:
    from tensordict import TensorDict

    from verl_trainer.engine.topology import Topology

__all__ = ["PreferenceDataModule", "unique_group_ids"]


def unique_group_ids(batch: TensorDict, topology: Topology | None) -> TensorDict:
    """``batch`` with its ``group_id`` made unique over the DP group.

    Each rank's ids (``>= 0``) are offset by the ranks before it (one all-reduce of ``dp_size`` counts:
    collective over the DP group). A batch without ``group_id`` (unpaired examples), or a DP group of one,
    is returned as it is.
    """
    if topology is None or topology.dp_size <= 1 or schema.GROUP_ID not in batch.keys():
        return batch
    ids = batch[schema.GROUP_ID]
    counts = torch.zeros(topology.dp_size, dtype=torch.long)
    counts[topology.dp_rank] = int(ids.max()) + 1 if ids.numel() else 0
    counts = all_reduce(counts, topology.dp_group)
    batch.set(schema.GROUP_ID, ids + int(counts[: topology.dp_rank].sum()))
    return batch


class PreferenceDataModule(_DataModule):
    """Preference pairs (DPO and variants) or unpaired examples (KTO) for ``Trainer.fit``.

    Args:
        config: Files and global batch sizes.
        tokenizer: The policy's tokenizer.
        unpaired: KTO's unpaired examples (pairs are unpaired), each with its KL row; the KL completions
            rotate within chunks of ``train_batch_size`` examples in file order (TRL: of its per-device
            batch), so the step's KL rows do not depend on the DP size.
        sp_size: Ulysses sequence-parallel size.
        train_dataset: Rows in place of ``config.train_files``.
        val_dataset: Rows in place of ``config.val_files``.
    """

    def __init__(self, config: DataConfig, tokenizer: Any, unpaired: bool = False, sp_size: int = 1,
                 train_dataset: Any = None, val_dataset: Any = None) -> None:
        super().__init__(config, tokenizer, sp_size, train_dataset, val_dataset)
        self.unpaired = unpaired

    def _dataset(self, source: Any) -> PreferenceDataset:
        cfg = self.config
        return PreferenceDataset(source, self.tokenizer, cfg.max_length, unpaired=self.unpaired,
                                 kl_chunk_size=max(cfg.train_batch_size, 2), chat_template=cfg.chat_template)
