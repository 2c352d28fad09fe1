"""The LM head runs only where outputs are used, and gives the full path's values there (0 elsewhere)."""

import pytest
import torch

from verl_trainer.data.packing import next_token_log_probs_and_entropy, pack_batch
from verl_trainer.engine.heads import LanguageModel, head_positions
from verl_trainer.models import VARLEN_ATTENTION, load_causal_lm, packed_forward

from .common import random_batch, tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("head"))
    return load_causal_lm(path, attn_implementation=VARLEN_ATTENTION)


def test_head_positions_follow_the_output_mask():
    batch = random_batch(6, seed=3)
    packed = pack_batch(batch, keys=())
    positions = head_positions(packed)
    want = batch["loss_mask"] > 0
    assert torch.equal(packed.unpack(packed.output_mask), want)
    targets = torch.zeros(packed.num_tokens, dtype=torch.bool)
    targets[positions + 1] = True
    assert torch.equal(packed.unpack(targets), want)  # prompt-only and first tokens never get a logit
    del batch["loss_mask"], batch["response_mask"]
    assert head_positions(pack_batch(batch, keys=())) is None


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_selected_outputs_equal_full_head(model, temperature):
    batch = random_batch(6, seed=4)
    packed = pack_batch(batch, keys=())
    head = LanguageModel()
    hf_output = head.forward_packed(model, packed)
    assert hf_output.logits.shape[1] == head_positions(packed).numel() < packed.num_tokens
    got = head.outputs(hf_output, packed, calculate_entropy=True, temperature=temperature)
    weight = torch.randn(packed.num_tokens, generator=torch.Generator().manual_seed(0))
    (got["log_probs"] @ weight + got["entropy"] @ weight).backward()
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    full = packed_forward(model, packed).logits
    lp, ent = next_token_log_probs_and_entropy(full, packed.input_ids, packed.cu_seqlens, temperature, True)
    used = packed.output_mask.float()
    ((lp * used) @ weight + (ent * used) @ weight).backward()
    torch.testing.assert_close(got["log_probs"], lp * used, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["entropy"], ent * used, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            got_grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )
    model.zero_grad()
