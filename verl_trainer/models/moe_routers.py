"""The routers of a transformers mixture-of-experts model: found, captured, and replayed by forward hooks.

transformers 5.x gives every MoE block a router module (``Qwen3MoeTopKRouter``, ``Qwen2MoeTopKRouter``,
``MixtralTopKRouter``, ``DeepseekV3TopkRouter``) whose ``forward(hidden [N, H])`` returns
``(router_logits [N, E], top_k_weights [N, k], top_k_index [N, k])`` and whose block passes the last two to
its fused experts module. A forward hook on the router therefore sees each token's logits and selection,
and may return a different selection (router replay): the weights are recomputed from the live logits at
the replayed experts, so the router still gets gradients through the probabilities, while which experts
run is fixed.

Two scoring kinds: ``softmax`` (Qwen2/3-MoE: ``softmax(logits)`` at the top-k, renormalised when
``norm_topk_prob``; Mixtral: always renormalised) and ``sigmoid`` (DeepSeek-V3: ``sigmoid(logits)`` at the
top-k, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``; its group-limited choice and
score-correction bias only choose, they do not weigh). The recomputation repeats the router's own
operations in the same order, so replaying a forward's own selection changes no bit of its output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from verl_trainer.data import schema
from verl_trainer.models.moe_config import MoEConfig

ROUTED_EXPERTS = schema.ROUTED_EXPERTS
"""Output / batch key: ``[b, t, L, k]`` long, the experts each token was routed to in each MoE layer."""
AUX_LOSS_TERMS = "moe_aux_loss_terms"
"""Output key: ``[b, t]`` each token's term of the sequence-wise load-balancing loss (see
:func:`router_token_outputs`)."""
Z_LOSS_TERMS = "moe_z_loss_terms"
"""Output key: ``[b, t]`` each token's router z-loss ``logsumexp(logits)^2``, mean over MoE layers."""
ROUTER_ENTROPY = "moe_router_entropy"
"""Output key: ``[b, t]`` the entropy of each token's routing distribution, mean over MoE layers."""
ROUTER_OUTPUT_KEYS = (ROUTED_EXPERTS, AUX_LOSS_TERMS, Z_LOSS_TERMS, ROUTER_ENTROPY)

_ROUTER_SUFFIXES = ("TopKRouter", "TopkRouter")


@dataclass(frozen=True)
class Router:
    """One MoE layer's router.

    Attributes:
        name: Its module name in the model.
        module: The router module.
        kind: ``"softmax"`` or ``"sigmoid"`` (see the module docstring).
        top_k: Experts per token.
        num_experts: Routed experts.
    """

    name: str
    module: nn.Module
    kind: str
    top_k: int
    num_experts: int


def find_routers(model: nn.Module) -> list[Router]:
    """The routers of ``model`` in layer order; ``[]`` for a dense model.

    Raises:
        NotImplementedError: A router-like module (class name ending in ``TopKRouter``) of a kind this
            module does not know, rather than replaying it wrongly.
    """
    routers = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if not cls.endswith(_ROUTER_SUFFIXES):
            continue
        if cls.startswith("DeepseekV3"):
            kind = "sigmoid"
        elif cls.startswith(("Qwen3Moe", "Qwen2Moe", "Mixtral")):
            kind = "softmax"
        else:
            raise NotImplementedError(
                f"router {name!r} ({cls}) is not one of the routers this project captures and replays "
                "(Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3); set actor.engine.moe.router_replay=off, "
                "aux_loss_coeff=0, z_loss_coeff=0, router_metrics=false to train it without router features")
        routers.append(Router(name, module, kind, int(module.top_k), int(module.num_experts)))
    return routers


def routing_probs(router: Router, logits: torch.Tensor) -> torch.Tensor:
    """``[N, E]`` float32 routing distribution: softmax, or the normalised sigmoid scores (DeepSeek-V3)."""
    if router.kind == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    scores = logits.float().sigmoid()
    return scores / scores.sum(-1, keepdim=True)


def _replayed_weights(router: Router, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The router's top-k weights at ``index`` ``[N, k]``, computed from ``logits`` as its forward does."""
    module = router.module
    if router.kind == "sigmoid":
        weights = logits.sigmoid().gather(1, index)
        if module.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * module.routed_scaling_factor
    probs = torch.softmax(logits.float(), dim=-1)
    weights = probs.gather(1, index)
    if getattr(module, "norm_topk_prob", True):  # Mixtral's router always renormalises
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if hasattr(module, "norm_topk_prob"):  # the Qwen routers cast back to the logits' dtype
        weights = weights.to(logits.dtype)
    return weights


@dataclass
class RouterCapture:
    """What the hooks saw during one forward: per router, the logits and the experts used.

    Attributes:
        routers: The model's routers.
        replay: ``[N, L, k]`` long experts to use (``-1`` in a row: that token routes freely), or ``None``.
        logits: Per router, each call's ``[n, E]`` logits (with their graph).
        selected: Per router, each call's ``[n, k]`` experts used.
    """

    routers: list[Router]
    replay: torch.Tensor | None = None
    logits: list[list[torch.Tensor]] = field(default_factory=list)
    selected: list[list[torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.logits = [[] for _ in self.routers]
        self.selected = [[] for _ in self.routers]

    def hook(self, layer: int):  # noqa: ANN201  (a torch forward hook)
        """The forward hook of router ``layer``: record, and replay when :attr:`replay` is set."""
        router = self.routers[layer]

        def _hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
            logits, weights, index = output
            replaced = None
            if self.replay is not None:
                wanted = self.replay[:, layer].to(device=index.device, dtype=index.dtype)
                if wanted.shape != index.shape:
                    raise ValueError(
                        f"router replay: {router.name} routed {tuple(index.shape)} (tokens, top_k) but the "
                        f"recorded experts are {tuple(wanted.shape)}; the batch's {ROUTED_EXPERTS!r} must be "
                        "[B, T, layers, top_k] from the same model")
                free = (wanted < 0).any(-1, keepdim=True)
                index = torch.where(free, index, wanted)
                replaced = (logits, _replayed_weights(router, logits, index), index)
            self.logits[layer].append(logits)
            self.selected[layer].append(index.detach())
            return replaced

        return _hook

    def layer_logits(self, layer: int) -> torch.Tensor:
        """``[N, E]``: router ``layer``'s logits of every call, concatenated."""
        return torch.cat(self.logits[layer])

    def routed(self) -> torch.Tensor:
        """``[N, L, k]`` long: the experts used by every token in every layer."""
        return torch.stack([torch.cat(s) for s in self.selected], dim=1)


@contextlib.contextmanager
def capture_routers(routers: list[Router], replay: torch.Tensor | None = None) -> Iterator[RouterCapture]:
    """Hook every router for the duration of the block; yields the :class:`RouterCapture`."""
    capture = RouterCapture(routers, replay)
    handles = [r.module.register_forward_hook(capture.hook(i)) for i, r in enumerate(routers)]
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()


def router_token_outputs(capture: RouterCapture, seq_lens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token router outputs ``{key: [N, ...]}`` of one packed row (samples of ``seq_lens`` in order).

    With ``p_t`` a token's routing distribution, ``T_s`` its sequence's tokens, ``c_se`` the tokens of
    sequence ``s`` routed to expert ``e`` and ``f_se = E / (k T_s) · c_se`` (1 when balanced):

    * :data:`AUX_LOSS_TERMS`: ``a_t = sum_e f_se · p_te`` (``f`` detached); its token mean within
      sequence ``s`` is the sequence-wise load-balancing loss ``sum_e f_se P_se`` (DeepSeek-V3, arXiv
      2412.19437 eq. 17-20; Megatron ``seq_aux_loss``), mean over MoE layers. Each sequence lies whole in
      one micro-batch, so it is exact under any micro-batching and dp size.
    * :data:`Z_LOSS_TERMS`: ``logsumexp(logits_t)^2`` (ST-MoE, arXiv 2202.08906 eq. 5), mean over layers.
    * :data:`ROUTER_ENTROPY`: ``-sum_e p_te log p_te`` (detached), mean over layers.
    * :data:`ROUTED_EXPERTS`: ``[N, L, k]`` the experts used.
    """
    routed = capture.routed()
    seq_lens = seq_lens.to(device=routed.device, dtype=torch.long)
    seg = torch.repeat_interleave(torch.arange(seq_lens.numel(), device=routed.device), seq_lens)
    aux, z, entropy = [], [], []
    for layer, router in enumerate(capture.routers):
        logits = capture.layer_logits(layer)
        probs = routing_probs(router, logits)
        hits = torch.zeros_like(probs).scatter_(1, routed[:, layer], 1.0)           # [N, E]
        counts = probs.new_zeros(seq_lens.numel(), router.num_experts).index_add_(0, seg, hits)
        tokens = seq_lens.to(probs.device, torch.float32).clamp_min(1)[:, None]
        f = counts * router.num_experts / (router.top_k * tokens)                    # [B, E]
        aux.append((f[seg] * probs).sum(-1))
        z.append(torch.logsumexp(logits.float(), dim=-1) ** 2)
        entropy.append(-(probs * probs.clamp_min(1e-30).log()).sum(-1).detach())
    return {
        ROUTED_EXPERTS: routed,
        AUX_LOSS_TERMS: torch.stack(aux).mean(0),
        Z_LOSS_TERMS: torch.stack(z).mean(0),
        ROUTER_ENTROPY: torch.stack(entropy).mean(0),
    }


def refuse_under_sequence_parallel(routers: list[Router], sp_size: int, moe: MoEConfig) -> None:
    """Refuse router losses or replay under Ulysses SP; the router metrics are just not logged there.

    Each SP rank routes a slice of the row, and the sequence-wise terms are not split over SP ranks yet.

    Raises:
        NotImplementedError: ``routers`` (a MoE model), ``sp_size > 1`` and a loss coefficient > 0 or
            ``router_replay != "off"``.
    """
    if routers and sp_size > 1 and (moe.aux_loss_coeff > 0 or moe.z_loss_coeff > 0
                                    or moe.router_replay != "off"):
        raise NotImplementedError(
            f"mixture-of-experts router losses / replay with ulysses_sequence_parallel_size={sp_size} are "
            "not supported; set ulysses_sequence_parallel_size=1, or turn them off (actor.engine.moe: "
            "aux_loss_coeff=0, z_loss_coeff=0, router_replay=off)")


class NoRouters:
    """The router part of a forward for a dense model (or with every router feature off): nothing."""

    def token_outputs(self, seq_lens: torch.Tensor) -> dict[str, torch.Tensor]:
        """No router outputs."""
        return {}


class TrainingRouters:
    """The router part of one packed training forward: capture (and replay) around it, outputs after.

    Use: ``with TrainingRouters.around(module, moe, micro_batch, sp_size) as routers: forward``, then
    ``routers.token_outputs(packed.seq_lens)``.
    """

    def __init__(self, capture: RouterCapture) -> None:
        self.capture = capture

    @staticmethod
    @contextlib.contextmanager
    def around(module: nn.Module | None, moe, micro_batch, sp_size: int = 1) -> Iterator[NoRouters | TrainingRouters]:  # noqa: ANN001, E501
        """Hook ``module``'s routers for one forward of ``micro_batch`` (``[b, t]``, right-padded).

        Replays ``micro_batch[ROUTED_EXPERTS]`` when ``moe.router_replay != "off"`` and the batch has it.

        Raises:
            NotImplementedError: See :func:`refuse_under_sequence_parallel`.
        """
        routers = find_routers(module) if module is not None and moe.needs_router_outputs else []
        if not routers:
            yield NoRouters()
            return
        refuse_under_sequence_parallel(routers, sp_size, moe)
        replay = None
        if moe.router_replay != "off" and ROUTED_EXPERTS in micro_batch.keys():
            width = micro_batch[schema.INPUT_IDS].shape[1]
            lens = schema.sequence_lengths(micro_batch)
            valid = torch.arange(width, device=lens.device)[None, :] < lens[:, None]
            replay = micro_batch[ROUTED_EXPERTS][valid]
        with capture_routers(routers, replay) as capture:
            yield TrainingRouters(capture)

    def token_outputs(self, seq_lens: torch.Tensor) -> dict[str, torch.Tensor]:
        """:func:`router_token_outputs` of the captured forward."""
        return router_token_outputs(self.capture, seq_lens)
