"""The invariance matrix: what one case is, which cases exist, and which run in the default CI slice.

A case is one training step of the tiny model on the fixed batch (``tests/invariance/batch.py``) under
one configuration; it must reproduce its reference — the same loss kind and aggregation mode at dp=1, one
micro-batch, no balancing, fsdp2 — in the logged loss, the grad norm, the logged metrics and the updated
parameters.

The matrix is the union of these blocks (a full cross product would be ~1000 engine builds):

* **layouts**: every (loss, agg mode) on every layout — dp in {1, 2, 4} x micro-batching in {one,
  fixed 1, fixed 2, dynamic} x SequenceBalancing off/on — with fsdp2;
* **strategies x layouts**: fsdp and deepspeed on every layout, for ppo_loss / token-mean;
* **strategies x losses**: fsdp and deepspeed for every (loss, agg mode), on dp=2 + dynamic + balancing;
* **Ulysses SP** (sp=2): every loss in token-mean and seq-mean-token-mean on every SP layout — dp in
  {1, 2} (2 and 4 ranks) x micro-batching in {one, fixed 1, dynamic} x balancing off/on — with fsdp2
  and fsdp, and with deepspeed at dp=1 (its dp=2 x sp=2 cases are in :data:`XFAIL` when they fail).
* **tensor parallelism** (tp=2, fsdp2): every loss in token-mean and seq-mean-token-mean on dp in {1, 2}
  (2 and 4 ranks) x micro-batching in {one, fixed 1, dynamic} x balancing off/on.
* **pipeline parallelism** (pp=2, fsdp2): the same block with ``pp=2`` in place of ``tp=2`` (one
  micro-batch runs GPipe, fixed 1 and dynamic run 1F1B).
* **rollout correction** (``ppo_is``: the PPO loss importance-weighted by the truncated token ratio of
  the batch's ``old_log_probs`` to its ``rollout_log_probs``, with the mismatch metrics), fsdp2: token-mean
  and seq-mean-token-mean on dp in {1, 2} x every micro-batching x balancing off/on, plus dp=1 with
  sp=2, tp=2 and pp=2 (dynamic micro-batches).
* **library backends** (``torchtitan``, ``megatron``: engines whose model, parallelism and gradient sync
  are their own library's; each runs in its own venv and CI stage, ``scripts/ci_backend.sh``): the GRPO
  (``ppo``) and SFT losses in token-mean and seq-mean-token-mean at dp=1, dp=2 and tp=2, one micro-batch
  and dynamic micro-batching, balancing off/on at dp=2 — against the same fsdp2 reference.
* **multi-turn** (``ppo_mt``: the PPO loss on the batch as a multi-turn rollout makes it, tool-observation
  spans inside the responses with loss and response mask 0, ``batch.multi_turn_batch``), fsdp2: token-mean
  and seq-mean-token-mean on dp in {1, 2} x every micro-batching x balancing off/on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from verl_trainer.core_algos import AGG_MODES  # every mode the library knows is in the matrix

LOSSES = ("ppo", "value", "sft")
DP_SIZES = (1, 2, 4)
MICRO = ("one", "fixed1", "fixed2", "dynamic")
STRATEGIES = ("fsdp2", "fsdp", "deepspeed")
SP_SIZES = (2,)
SP_DP_SIZES = (1, 2)
SP_MICRO = ("one", "fixed1", "dynamic")
SP_AGG_MODES = ("token-mean", "seq-mean-token-mean")
SP_STRATEGIES = ("fsdp2", "fsdp", "deepspeed")
TP_SIZES = (2,)
TP_DP_SIZES = (1, 2)
TP_MICRO = ("one", "fixed1", "dynamic")
TP_AGG_MODES = ("token-mean", "seq-mean-token-mean")
PP_SIZES = (2,)
PP_DP_SIZES = (1, 2)
PP_MICRO = ("one", "fixed1", "dynamic")
PP_AGG_MODES = ("token-mean", "seq-mean-token-mean")

CORRECTION_LOSS = "ppo_is"
CORRECTION_AGG_MODES = ("token-mean", "seq-mean-token-mean")

MULTI_TURN_LOSS = "ppo_mt"
MULTI_TURN_AGG_MODES = ("token-mean", "seq-mean-token-mean")

LIBRARY_BACKENDS = ("torchtitan", "megatron")
"""Backends on their own libraries; their cases carry the backend's pytest marker (its own CI stage)."""
LIBRARY_LOSSES = ("ppo", "sft")
LIBRARY_AGG_MODES = ("token-mean", "seq-mean-token-mean")
LIBRARY_LAYOUTS = ((1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False))
"""(dp, tp, balance) of the library-backend block."""

PPO_LOSSES = ("ppo", CORRECTION_LOSS, MULTI_TURN_LOSS)
"""The PPO-loss kinds (entropy bonus and KL loss on); they run in the same spawns."""

REFERENCE_STRATEGY = "fsdp2"

# ---- distillation block (algorithms/distill.py): the distillation loss terms alone, on the batch with the
# teacher's fields (batch.distill_batch) ----
DISTILL_LOSSES = ("distill_k1", "distill_k3", "distill_topk")
"""Reverse KL to the teacher as a loss term with the k1 / k3 estimator; the top-k forward KL (tail) + k3."""
DISTILL_AGG_MODES = ("token-mean",)
DISTILL_DP_SIZES = (1, 2)
DISTILL_MICRO = ("one", "fixed1", "dynamic")
DISTILL_STRATEGY_LAYOUT = (2, "dynamic", True)
"""(dp, micro, balance) on which fsdp and deepspeed run the distillation losses."""


@dataclass(frozen=True, order=True)
class Case:
    """One configuration of one step.

    Attributes:
        loss: ``"ppo"`` (entropy bonus and KL loss on), ``"ppo_is"`` (the same with token-level TIS of the
            rollout -> trainer ratio), ``"ppo_mt"`` (``"ppo"`` on the multi-turn batch), ``"value"`` or
            ``"sft"``.
        agg: The ``loss_agg_mode``.
        dp: Data-parallel size.
        micro: ``"one"`` micro-batch per rank, ``"fixed1"`` / ``"fixed2"`` samples per micro-batch, or
            ``"dynamic"`` (token budget ``runner.DYNAMIC_BUDGET`` per rank, x sp per micro-batch).
        balance: SequenceBalancing on (DP ranks start from an uneven split; padding samples are added;
            the exchange runs over the DP group).
        strategy: Engine backend.
        sp: Ulysses sequence-parallel size; the world is ``dp * sp`` ranks on a ``(dp, sp)`` mesh, and
            every SP rank of a DP group holds that DP rank's samples.
        tp: Tensor-parallel size (fsdp2; sp must be 1): a ``(dp, tp)`` mesh of ``dp * tp`` ranks, every
            TP rank of a DP group holding that DP rank's samples.
        pp: Pipeline-parallel size (fsdp2; sp and tp must be 1): a ``(pp, dp)`` mesh of ``pp * dp``
            ranks (stages ``dp`` ranks apart), every stage of a DP rank holding its samples.

    """

    loss: str
    agg: str
    dp: int
    micro: str
    balance: bool
    strategy: str
    sp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def id(self) -> str:
        """A readable, unique test id (``/spN`` / ``/tpN`` / ``/ppN`` only when > 1)."""
        bal = "bal" if self.balance else "nobal"
        sp = f"/sp{self.sp}" if self.sp > 1 else ""
        tp = f"/tp{self.tp}" if self.tp > 1 else ""
        pp = f"/pp{self.pp}" if self.pp > 1 else ""
        return f"{self.loss}/{self.agg}/dp{self.dp}{sp}{tp}{pp}/{self.micro}/{bal}/{self.strategy}"

    @property
    def mp(self) -> int:
        """Ranks per DP rank (holding the same samples): ``sp * tp * pp``."""
        return self.sp * self.tp * self.pp

    @property
    def world(self) -> int:
        """Number of ranks: ``dp * sp * tp * pp``."""
        return self.dp * self.mp

    def coords(self, rank: int) -> tuple[int, int]:
        """``(dp rank, rank within the DP rank's model-parallel group)`` of global ``rank``.

        SP / TP ranks are adjacent (``rank = dp_rank * mp + mp_rank``); pipeline stages are ``dp`` apart
        (``rank = stage * dp + dp_rank``).
        """
        if self.pp > 1:
            return rank % self.dp, rank // self.dp
        return rank // self.mp, rank % self.mp

    def rank_of(self, dp_rank: int, mp_rank: int) -> int:
        """The global rank at :meth:`coords` ``(dp_rank, mp_rank)``."""
        return mp_rank * self.dp + dp_rank if self.pp > 1 else dp_rank * self.mp + mp_rank

    def reports_outputs(self, rank: int) -> bool:
        """``is_mp_src_rank_with_outputs`` of ``rank``: SP / TP rank 0, the last pipeline stage."""
        mp_rank = self.coords(rank)[1]
        return mp_rank == (self.pp - 1 if self.pp > 1 else 0)

    @property
    def model_type(self) -> str:
        """The engine's model type."""
        return "value_model" if self.loss in ("value", RM_LOSS) else "language_model"

    def reference(self) -> Case:
        """The case this one must reproduce: dp=1, sp=tp=pp=1, one micro-batch, no balancing, fsdp2."""
        return replace(self, dp=1, sp=1, tp=1, pp=1, micro="one", balance=False, strategy=REFERENCE_STRATEGY)

    @property
    def is_reference(self) -> bool:
        """True for a reference case itself."""
        return self == self.reference()


def layouts() -> list[tuple[int, str, bool]]:
    """Every (dp, micro, balance)."""
    return list(product(DP_SIZES, MICRO, (False, True)))


def sp_layouts() -> list[tuple[int, int, str, bool]]:
    """Every (dp, sp, micro, balance) of the Ulysses block."""
    return list(product(SP_DP_SIZES, SP_SIZES, SP_MICRO, (False, True)))


def sp_cases() -> list[Case]:
    """The Ulysses block: every SP loss / agg mode on every SP layout, per SP strategy.

    DeepSpeed runs every SP layout at dp=1; its dp=2 x sp=2 cases are listed too (the ones that fail
    are in :data:`XFAIL`, run in a spawn of their own and kept out of the passing matrix).
    """
    return [Case(loss, agg, dp, micro, bal, strategy, sp)
            for strategy, loss, agg, (dp, sp, micro, bal)
            in product(SP_STRATEGIES, LOSSES, SP_AGG_MODES, sp_layouts())]


def tp_cases() -> list[Case]:
    """The tensor-parallel block: every loss in the TP agg modes on every TP layout, fsdp2."""
    return [Case(loss, agg, dp, micro, bal, "fsdp2", tp=tp)
            for loss, agg, dp, tp, micro, bal
            in product(LOSSES, TP_AGG_MODES, TP_DP_SIZES, TP_SIZES, TP_MICRO, (False, True))]


def pp_cases() -> list[Case]:
    """The pipeline-parallel block: every loss in the PP agg modes on every PP layout, fsdp2."""
    return [Case(loss, agg, dp, micro, bal, "fsdp2", pp=pp)
            for loss, agg, dp, pp, micro, bal
            in product(LOSSES, PP_AGG_MODES, PP_DP_SIZES, PP_SIZES, PP_MICRO, (False, True))]


def correction_cases() -> list[Case]:
    """The rollout-correction block (fsdp2): every layout at dp in {1, 2}, and dp=1 with sp / tp / pp = 2."""
    cases = [Case(CORRECTION_LOSS, agg, dp, micro, bal, "fsdp2")
             for agg, dp, micro, bal in product(CORRECTION_AGG_MODES, (1, 2), MICRO, (False, True))]
    cases += [Case(CORRECTION_LOSS, "token-mean", 1, "dynamic", False, "fsdp2", **mp)
              for mp in ({"sp": 2}, {"tp": 2}, {"pp": 2})]
    return cases


def multi_turn_cases() -> list[Case]:
    """The multi-turn block (fsdp2): every layout at dp in {1, 2} in the multi-turn agg modes."""
    return [Case(MULTI_TURN_LOSS, agg, dp, micro, bal, "fsdp2")
            for agg, dp, micro, bal in product(MULTI_TURN_AGG_MODES, (1, 2), MICRO, (False, True))]


def library_backend_cases(strategy: str) -> list[Case]:
    """The block of one library backend: GRPO and SFT losses at dp=1, dp=2 (balancing off/on) and tp=2."""
    return [Case(loss, agg, dp, micro, bal, strategy, tp=tp)
            for loss, agg, (dp, tp, bal), micro
            in product(LIBRARY_LOSSES, LIBRARY_AGG_MODES, LIBRARY_LAYOUTS, ("one", "dynamic"))]


# ---------------------------------------------------------------- preference block (DPO sigmoid, KTO)
PREFERENCE_LOSSES = ("dpo", "kto")
"""Preference losses (``core_algos/preference.py``) on the paired batch (``batch.preference_batch``)."""
PREFERENCE_AGG = {"dpo": "pair-mean", "kto": "sample-mean"}
"""Their aggregation (per-pair / per-sample terms over the step's global counts), named in the case id."""
PREFERENCE_MICRO = ("one", "dynamic")


def preference_cases() -> list[Case]:
    """The preference block: DPO sigmoid and KTO on dp in {1, 2} x micro one / dynamic x balancing off / on
    (pairs kept whole) with fsdp2, plus fsdp and deepspeed on dp=2 + dynamic + balancing."""
    cases = [Case(loss, PREFERENCE_AGG[loss], dp, micro, bal, "fsdp2")
             for loss, dp, micro, bal in product(PREFERENCE_LOSSES, (1, 2), PREFERENCE_MICRO, (False, True))]
    cases += [Case(loss, PREFERENCE_AGG[loss], 2, "dynamic", True, strategy)
              for loss, strategy in product(PREFERENCE_LOSSES, STRATEGIES[1:])]
    return cases


def distill_cases() -> list[Case]:
    """The distillation block: each distillation loss on dp in {1, 2} x one / fixed 1 / dynamic x balancing
    off/on with fsdp2, and with fsdp and deepspeed on dp=2 + dynamic + balancing."""
    cases = [Case(loss, agg, dp, micro, bal, "fsdp2")
             for loss, agg, dp, micro, bal
             in product(DISTILL_LOSSES, DISTILL_AGG_MODES, DISTILL_DP_SIZES, DISTILL_MICRO, (False, True))]
    dp, micro, bal = DISTILL_STRATEGY_LAYOUT
    cases += [Case(loss, agg, dp, micro, bal, strategy)
              for loss, agg, strategy in product(DISTILL_LOSSES, DISTILL_AGG_MODES, STRATEGIES[1:])]
    return cases


# ---------------------------------------------------------------- policy losses beyond PPO (issue 43)
OBJECTIVE_LOSSES = ("gspo", "gspo_token", "gmpo", "cispo", "sapo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov")
"""The policy losses of this block; a case's ``loss`` is ``"pl_" + name`` (``runner.make_loss_fn``)."""
OBJECTIVE_SEQUENCE_LOSSES = ("gspo", "gspo_token", "gmpo")
"""Correct only in ``seq-mean-token-mean`` (``core_algos/loss_rules.py``)."""
OBJECTIVE_AGG_MODES = ("token-mean", "seq-mean-token-mean")
OBJECTIVE_MICRO = ("one", "fixed1", "dynamic")
OBJECTIVE_CASE_LOSSES = tuple(f"pl_{name}" for name in OBJECTIVE_LOSSES)


def objective_cases() -> list[Case]:
    """Each policy loss in its valid modes on dp in {1, 2} x one / fixed1 / dynamic x balancing off/on
    (fsdp2), and with fsdp and deepspeed at dp=2, dynamic, balancing."""
    cases = []
    for name, agg in product(OBJECTIVE_LOSSES, OBJECTIVE_AGG_MODES):
        if name in OBJECTIVE_SEQUENCE_LOSSES and agg != "seq-mean-token-mean":
            continue
        cases += [Case(f"pl_{name}", agg, dp, micro, bal, "fsdp2")
                  for dp, micro, bal in product((1, 2), OBJECTIVE_MICRO, (False, True))]
        cases += [Case(f"pl_{name}", agg, 2, "dynamic", True, strategy) for strategy in STRATEGIES[1:]]
    return cases


# ---------------------------------------------------------------- mixture of experts (issue 46)
MOE_LOSS = "moe_ppo"
"""PPO (as ``"ppo"``) on a tiny Qwen3-MoE with the router losses and metrics on (``runner.MOE``)."""
MOE_REPLAY_LOSS = "moe_ppo_replay"
"""The same with ``router_replay=rollout`` and a recorded ``routed_experts`` field in the batch that is not
the model's own routing (``batch.moe_batch``), so a field misplaced by balancing, micro-batching or
packing changes the step."""
MOE_LOSSES = (MOE_LOSS, MOE_REPLAY_LOSS)
MOE_AGG_MODE = "token-mean"


def moe_cases() -> list[Case]:
    """The MoE block: dp in {1, 2} x micro one / dynamic (fsdp2, balancing with dp=2), fsdp and deepspeed
    at dp=2 + dynamic + balancing, and replay at dp=2 + dynamic + balancing (fsdp2)."""
    cases = [Case(MOE_LOSS, MOE_AGG_MODE, dp, micro, dp == 2, "fsdp2")
             for dp, micro in product((1, 2), ("one", "dynamic"))]
    cases += [Case(MOE_LOSS, MOE_AGG_MODE, 2, "dynamic", True, strategy) for strategy in STRATEGIES[1:]]
    cases += [Case(MOE_REPLAY_LOSS, MOE_AGG_MODE, 2, "dynamic", True, "fsdp2")]
    return cases


# ---------------------------------------------------------------- reward-model block (Bradley–Terry)
RM_LOSS = "rm"
"""The Bradley–Terry loss (``core_algos/reward_modeling.py``) on a value-model engine; pairs by ``group_id``,
sharing the preference block's spawns."""
RM_AGG = "pair-mean"
RM_MICRO = ("one", "dynamic")


def rm_cases() -> list[Case]:
    """The reward-model block: dp in {1, 2} x micro one / dynamic x balancing off / on with fsdp2 (pairs kept
    whole, a per-pair margin and the centring term on), plus fsdp and deepspeed on dp=2 + dynamic +
    balancing."""
    cases = [Case(RM_LOSS, RM_AGG, dp, micro, bal, "fsdp2")
             for dp, micro, bal in product((1, 2), RM_MICRO, (False, True))]
    cases += [Case(RM_LOSS, RM_AGG, 2, "dynamic", True, strategy) for strategy in STRATEGIES[1:]]
    return cases


# ---------------------------------------------------------------- vision-language model (issue 44)
VLM_LOSS = "vlm_ppo"
"""PPO (as ``"ppo"``) on a tiny Qwen2.5-VL with images in the batch (``batch.vlm_batch``: 12 samples with 0,
1 or 2 images each; ``runner.vlm_model_path``): images ride with their samples through balancing and
micro-batching, the mrope positions through packing."""
VLM_LOSSES = (VLM_LOSS,)
VLM_AGG_MODE = "token-mean"
VLM_MICRO = ("one", "fixed2", "dynamic")
VLM_STRATEGY_LAYOUTS = ((2, "dynamic", True), (2, "fixed2", False))
"""(dp, micro, balance) on which fsdp and deepspeed run the VLM block."""


def vlm_cases() -> list[Case]:
    """The VLM block: dp in {1, 2} x micro one / fixed 2 / dynamic x balancing off / on with fsdp2, and fsdp
    and deepspeed at dp=2 (dynamic + balancing, fixed 2 without); 15 cases in two spawns."""
    cases = [Case(VLM_LOSS, VLM_AGG_MODE, dp, micro, bal, "fsdp2")
             for dp, micro, bal in product((1, 2), VLM_MICRO, (False, True))]
    cases += [Case(VLM_LOSS, VLM_AGG_MODE, dp, micro, bal, strategy)
              for strategy in STRATEGIES[1:] for dp, micro, bal in VLM_STRATEGY_LAYOUTS]
    return [c for c in cases if not c.is_reference]


def all_cases() -> list[Case]:
    """The whole matrix (references excluded), in a stable order."""
    cases: set[Case] = set()
    for loss, agg, (dp, micro, bal) in product(LOSSES, AGG_MODES, layouts()):
        cases.add(Case(loss, agg, dp, micro, bal, "fsdp2"))
    for strategy, (dp, micro, bal) in product(STRATEGIES[1:], layouts()):
        cases.add(Case("ppo", "token-mean", dp, micro, bal, strategy))
    for strategy, loss, agg in product(STRATEGIES[1:], LOSSES, AGG_MODES):
        cases.add(Case(loss, agg, 2, "dynamic", True, strategy))
    cases.update(sp_cases())
    cases.update(tp_cases())
    cases.update(pp_cases())
    cases.update(correction_cases())
    cases.update(multi_turn_cases())
    cases.update(distill_cases())
    for strategy in LIBRARY_BACKENDS:
        cases.update(library_backend_cases(strategy))
    cases.update(preference_cases())
    cases.update(objective_cases())
    cases.update(moe_cases())
    cases.update(rm_cases())
    cases.update(vlm_cases())
    return sorted(c for c in cases if not c.is_reference)


XFAIL: dict[Case, str] = {}
"""Cases known to fail, with the reason: each runs as ``xfail(strict=True)`` in a spawn of its own chunk
(a failing rank ends its spawn), and is left out of the passing table."""


SLICE: tuple[Case, ...] = (
    Case("ppo", "token-mean", 2, "dynamic", True, "fsdp2"),
    Case("ppo", "seq-mean-token-mean", 2, "dynamic", True, "fsdp2"),
    Case("ppo", "token-mean", 2, "fixed1", False, "fsdp"),
    Case("ppo", "token-mean", 2, "fixed2", True, "deepspeed"),
    Case("ppo", "token-mean", 2, "dynamic", True, "fsdp2", sp=2),
    Case("ppo", "token-mean", 1, "dynamic", False, "fsdp2", tp=2),
    Case("ppo", "seq-mean-token-mean", 1, "fixed1", False, "fsdp2", tp=2),
    Case("ppo", "token-mean", 1, "dynamic", False, "fsdp2", pp=2),
    Case(CORRECTION_LOSS, "token-mean", 2, "dynamic", True, "fsdp2"),
    Case(MULTI_TURN_LOSS, "token-mean", 2, "dynamic", True, "fsdp2"),
)
"""The representative slice that runs in the default CI: the headline configuration (PPO with entropy
and KL, dp=2, dynamic micro-batching, balancing with padding samples) in two aggregation modes, plus one
fsdp and one deepspeed case, all on 2 ranks; dp=1 x tp=2 in both modes and dp=1 x pp=2 with dynamic
micro-batches (1F1B) (2 ranks, the same spawn); the headline configuration with the rollout
correction and on the multi-turn batch (the same spawn); and the same headline configuration at
dp=2 x sp=2 on 4 ranks. The default
run costs three process spawns (the 1-rank references, the 2-rank cases, the 4-rank case)."""


def references(cases: list[Case]) -> list[Case]:
    """The distinct references of ``cases``."""
    return sorted({c.reference() for c in cases})
