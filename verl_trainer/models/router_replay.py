"""Router replay's rollout side: the experts a generation selected, as the batch's ``routed_experts``.

The HF rollout runs ``model.generate`` over left-padded prompts ``[B, W]`` with the routers hooked
(``models/moe_routers.py: capture_routers``): the first call (prefill) routes ``B × W`` tokens, each later
call ``B × 1`` — call ``s`` feeds generated token ``s - 1`` of every row (finished rows are fed padding,
rows are never dropped). :func:`generation_routing` turns those calls into ``[B, W + C - 1, L, k]``, and
:func:`place_routing` moves each row into the batch layout (prompt then response, right-padded, the
layout of ``rollout/base.py``). A response's last token is never fed back during generation, so it has no
recorded experts: it and every padding position hold ``-1``, which the training forward's replay reads
as "route freely" (that token's routing changes no log-prob of the response, only its router terms).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from verl_trainer.models.moe_config import MoEConfig
from verl_trainer.models.moe_routers import ROUTED_EXPERTS, RouterCapture

if TYPE_CHECKING:
    from tensordict import TensorDict

NOT_RECORDED = -1
"""The ``routed_experts`` value of a token without a recorded selection."""


def generation_routing(capture: RouterCapture, rows: int) -> torch.Tensor:
    """``[rows, W + C - 1, L, k]`` long: the experts of each fed position of one ``generate`` call.

    Raises:
        ValueError: A call whose token count is not a multiple of ``rows`` (the rows changed mid-call:
            a decoding loop that drops finished rows cannot be recorded this way).
    """
    layers = []
    for selected in capture.selected:
        calls = []
        for chosen in selected:
            if chosen.shape[0] % rows:
                raise ValueError(
                    f"router replay: a forward of {chosen.shape[0]} tokens over {rows} rows; the decoding "
                    "loop dropped rows mid-generation (record with decoding='generate')")
            calls.append(chosen.reshape(rows, -1, chosen.shape[-1]))
        layers.append(torch.cat(calls, dim=1))
    return torch.stack(layers, dim=2).cpu()


def row_routing(routing: torch.Tensor, prompt_width: int, prompt_lens: list[int]) -> list[torch.Tensor]:
    """Per row, the experts of its own tokens ``[p_i + C - 1, L, k]``: its left padding cut off.

    Args:
        routing: :func:`generation_routing` of a call over prompts left-padded to ``prompt_width``.
        prompt_width: ``W``.
        prompt_lens: Each row's prompt tokens ``p_i``.
    """
    return [routing[i, prompt_width - p:] for i, p in enumerate(prompt_lens)]


def place_routing(per_row: list[torch.Tensor], prompt_lens: torch.Tensor, seq_lens: torch.Tensor,
                  width: int) -> torch.Tensor:
    """``[B, width, L, k]`` long in the batch layout; :data:`NOT_RECORDED` where nothing was recorded.

    Args:
        per_row: Row ``i``'s experts from its first prompt token on (``[n_i, L, k]``).
        prompt_lens: ``[B]`` prompt tokens of each row.
        seq_lens: ``[B]`` prompt + response tokens of each row (the response cut at its eos).
        width: The batch's padded width ``T``.
    """
    layers, k = per_row[0].shape[1:] if per_row else (0, 0)
    out = torch.full((len(per_row), width, layers, k), NOT_RECORDED, dtype=torch.long)
    for i, routed in enumerate(per_row):
        n = min(int(seq_lens[i]), routed.shape[0])
        out[i, :n] = routed[:n]
    return out


def record_rollout_routing(rollout: object, moe: MoEConfig) -> None:
    """Turn on the rollout's recording when ``moe.router_replay == "rollout"``.

    Raises:
        ValueError: The rollout cannot record (it has no ``record_routing``: not the HF rollout).
    """
    if moe.router_replay != "rollout":
        return
    if not hasattr(rollout, "record_routing"):
        raise ValueError(f"actor.engine.moe.router_replay=rollout needs a rollout that records its experts; "
                         f"{type(rollout).__name__} does not (only the HF rollout does). Set "
                         "rollout.name=hf, or router_replay=old_policy")
    rollout.record_routing = True


def keep_old_policy_routing(moe: MoEConfig, output: dict[str, torch.Tensor], batch: TensorDict) -> None:
    """With ``router_replay == "old_policy"``: store the old-policy forward's experts in ``batch``."""
    if moe.router_replay == "old_policy" and ROUTED_EXPERTS in output:
        batch[ROUTED_EXPERTS] = output[ROUTED_EXPERTS]
