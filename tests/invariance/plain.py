"""A plain single-process PyTorch step: the HF model (sdpa, padded batch, no packing) on the whole batch.

Its outputs (log-probs and entropy, or values, of the initial parameters) are what every case's forward
must reproduce.

The same loss function with the whole batch's denominators, ``loss.backward()``, ``clip_grad_norm_`` and
``torch.optim.AdamW`` — the step the engine's dp=1, one-micro-batch reference must equal.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from tests.engine.common import padded_log_probs, padded_values
from tests.invariance.batch import VALUE_SEED, batch_for
from tests.invariance.cases import PPO_LOSSES, VERSION_LOSS, Case
from tests.invariance.runner import OPTIM, make_loss_fn, outputs_by_uid
from verl_trainer.engine import GlobalBatchInfo
from verl_trainer.metrics import reduce_metrics
from verl_trainer.models.loading import load_causal_lm, load_value_model


def padded_entropy(logits: torch.Tensor) -> torch.Tensor:
    """[B, T] entropy of the next-token distribution read at t - 1 (position 0 is 0)."""
    ent = torch.distributions.Categorical(logits=logits[:, :-1].float()).entropy()
    return torch.cat([ent.new_zeros(ent.shape[0], 1), ent], 1)


def plain_step(case: Case, model_path: str, batch: TensorDict) -> dict[str, Any]:
    """One single-process plain-PyTorch step of ``case``'s loss on the whole padded batch."""
    batch = batch_for(case, batch)
    if case.model_type == "value_model":
        model = load_value_model(model_path, attn_implementation="sdpa", seed=VALUE_SEED)
    else:
        model = load_causal_lm(model_path, attn_implementation="sdpa")
    model.train()
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    if case.model_type == "value_model":
        model_output = {"values": padded_values(out.logits)}
        outputs = outputs_by_uid(model_output, batch)
    else:
        model_output = {"log_probs": padded_log_probs(out.logits, batch["input_ids"])}
        with torch.no_grad():
            outputs = outputs_by_uid({**model_output, "entropy": padded_entropy(out.logits)}, batch)
        if case.loss in PPO_LOSSES:
            model_output["entropy"] = padded_entropy(out.logits)
        if case.loss == VERSION_LOSS:  # the version-fields block: PPO's entropy bonus
            model_output["entropy"] = padded_entropy(out.logits)
    # global_batch_size counts every real sample, the all-zero-mask one included (the engine's definition)
    info = GlobalBatchInfo(dp_size=1, batch_num_tokens=int(batch["loss_mask"].sum()),
                           global_batch_size=batch.batch_size[0])
    loss, metrics = make_loss_fn(case)(model_output, batch, info)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_grad)
    torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                      weight_decay=OPTIM.weight_decay).step()
    return {"outputs": outputs, "loss": float(loss.detach()), "grad_norm": float(grad_norm),
            "metrics": reduce_metrics([metrics]),
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}
