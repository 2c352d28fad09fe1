"""The invariance matrix: what one case is, which cases exist, and which run in the default CI slice.

A case is one training step of the tiny model on the fixed batch (``tests/invariance/batch.py``) under
one configuration; it must reproduce its reference — the same loss kind and aggregation mode at dp=1, one
micro-batch, no balancing, fsdp2 — in the logged loss, the grad norm, the logged metrics and the updated
parameters.

The matrix is the union of three blocks (a full cross product would be ~1000 engine builds):

* **layouts**: every (loss, agg mode) on every layout — dp in {1, 2, 4} x micro-batching in {one,
  fixed 1, fixed 2, dynamic} x SequenceBalancing off/on — with fsdp2;
* **strategies x layouts**: fsdp and deepspeed on every layout, for ppo_loss / token-mean;
* **strategies x losses**: fsdp and deepspeed for every (loss, agg mode), on dp=2 + dynamic + balancing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from verl_trainer.core_algos import AGG_MODES  # every mode the library knows is in the matrix

LOSSES = ("ppo", "value", "sft")
DP_SIZES = (1, 2, 4)
MICRO = ("one", "fixed1", "fixed2", "dynamic")
STRATEGIES = ("fsdp2", "fsdp", "deepspeed")

REFERENCE_STRATEGY = "fsdp2"


@dataclass(frozen=True, order=True)
class Case:
    """One configuration of one step.

    Attributes:
        loss: ``"ppo"`` (entropy bonus and KL loss on), ``"value"`` or ``"sft"``.
        agg: The ``loss_agg_mode``.
        dp: Data-parallel size (= number of ranks).
        micro: ``"one"`` micro-batch per rank, ``"fixed1"`` / ``"fixed2"`` samples per micro-batch, or
            ``"dynamic"`` (token budget, see ``runner.DYNAMIC_BUDGET``).
        balance: SequenceBalancing on (ranks start from an uneven split; padding samples are added).
        strategy: Engine backend.

    """

    loss: str
    agg: str
    dp: int
    micro: str
    balance: bool
    strategy: str

    @property
    def id(self) -> str:
        """A readable, unique test id."""
        bal = "bal" if self.balance else "nobal"
        return f"{self.loss}/{self.agg}/dp{self.dp}/{self.micro}/{bal}/{self.strategy}"

    @property
    def model_type(self) -> str:
        """The engine's model type."""
        return "value_model" if self.loss == "value" else "language_model"

    def reference(self) -> Case:
        """The case this one must reproduce: dp=1, one micro-batch, no balancing, fsdp2."""
        return replace(self, dp=1, micro="one", balance=False, strategy=REFERENCE_STRATEGY)

    @property
    def is_reference(self) -> bool:
        """True for a reference case itself."""
        return self == self.reference()


def layouts() -> list[tuple[int, str, bool]]:
    """Every (dp, micro, balance)."""
    return list(product(DP_SIZES, MICRO, (False, True)))


def all_cases() -> list[Case]:
    """The whole matrix (references excluded), in a stable order."""
    cases: set[Case] = set()
    for loss, agg, (dp, micro, bal) in product(LOSSES, AGG_MODES, layouts()):
        cases.add(Case(loss, agg, dp, micro, bal, "fsdp2"))
    for strategy, (dp, micro, bal) in product(STRATEGIES[1:], layouts()):
        cases.add(Case("ppo", "token-mean", dp, micro, bal, strategy))
    for strategy, loss, agg in product(STRATEGIES[1:], LOSSES, AGG_MODES):
        cases.add(Case(loss, agg, 2, "dynamic", True, strategy))
    return sorted(c for c in cases if not c.is_reference)


SLICE: tuple[Case, ...] = (
    Case("ppo", "token-mean", 2, "dynamic", True, "fsdp2"),
    Case("ppo", "seq-mean-token-mean", 2, "dynamic", True, "fsdp2"),
    Case("ppo", "token-mean", 2, "fixed1", False, "fsdp"),
    Case("ppo", "token-mean", 2, "fixed2", True, "deepspeed"),
)
"""The representative slice that runs in the default CI: the headline configuration (PPO with entropy
and KL, dp=2, dynamic micro-batching, balancing with padding samples) in two aggregation modes, plus one
fsdp and one deepspeed case; all PPO on 2 ranks, so the default run costs two process spawns (the
1-rank references and the 2-rank cases)."""


def references(cases: list[Case]) -> list[Case]:
    """The distinct references of ``cases``."""
    return sorted({c.reference() for c in cases})
