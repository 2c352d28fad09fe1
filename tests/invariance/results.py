"""Lazily computed results of a set of cases: each chunk (one process spawn) runs once, when first asked.

The pytest fixture builds one :class:`MatrixResults` for the cases the session selected (the default
slice, or the whole matrix under ``-m invariance``); ``bench/invariance_table.py`` builds one for the
whole matrix.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch
from tensordict import TensorDict

from tests.invariance.cases import MOE_LOSSES, VLM_LOSSES, Case
from tests.invariance.compare import compare
from tests.invariance.runner import (
    backend_available,
    chunk_key,
    initial_params,
    moe_model_path,
    run_chunk,
    vlm_model_path,
)


class MatrixResults:
    """Results of ``cases`` and their references, computed chunk by chunk on demand.

    Args:
        model_path: The tiny model directory.
        batch: The fixed global batch.
        cases: The cases that will be asked for (their references are added).

    """

    def __init__(self, model_path: str, batch: TensorDict, cases: list[Case]) -> None:
        self.model_path = model_path
        self.batch = batch
        wanted = set(cases) | {c.reference() for c in cases}
        self.chunks: dict[tuple, list[Case]] = defaultdict(list)
        for case in sorted(wanted):
            self.chunks[chunk_key(case)].append(case)
        self._results: dict[Case, dict[str, Any]] = {}
        self._errors: dict[tuple, BaseException] = {}
        self._before: dict[str, dict[str, torch.Tensor]] = {}
        self.chunk_seconds: dict[tuple, float] = {}

    @staticmethod
    def available(case: Case) -> bool:
        """False for a case whose backend (deepspeed, torchtitan, megatron) is not installed or registered."""
        return case.strategy in ("fsdp", "fsdp2") or backend_available(case.strategy)

    def result(self, case: Case) -> dict[str, Any]:
        """The merged result of ``case`` (runs its chunk first if needed; a chunk failure re-raises)."""
        if case not in self._results:
            key = chunk_key(case)
            if key in self._errors:
                raise self._errors[key]
            if case not in self.chunks.get(key, []):
                raise KeyError(f"case {case.id} was not announced to MatrixResults")
            start = time.perf_counter()
            try:
                self._results.update(run_chunk(self.chunks[key], self.model_path, self.batch))
            except BaseException as err:
                self._errors[key] = err
                raise
            finally:
                self.chunk_seconds[key] = time.perf_counter() - start
        return self._results[case]

    def before(self, model_type: str) -> dict[str, torch.Tensor]:
        """The parameters before the step for ``model_type``."""
        if model_type not in self._before:
            self._before[model_type] = initial_params(self.model_path, model_type)
        return self._before[model_type]

    def diffs(self, case: Case) -> dict[str, Any]:
        """Relative differences of ``case`` against its reference (see ``compare.compare``)."""
        if case.loss in MOE_LOSSES:  # the MoE block: its own model's initial parameters
            return compare(self.result(case), self.result(case.reference()),
                           initial_params(moe_model_path(self.model_path), case.model_type))
        if case.loss in VLM_LOSSES:  # the VLM block: its own model's initial parameters
            return compare(self.result(case), self.result(case.reference()),
                           initial_params(vlm_model_path(self.model_path), case.model_type))
        return compare(self.result(case), self.result(case.reference()), self.before(case.model_type))
