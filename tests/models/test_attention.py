import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from verl_trainer.data.packing import make_batch, next_token_log_probs_and_entropy, pack_batch
from verl_trainer.models import (
    VARLEN_ATTENTION,
    block_diagonal_causal_mask,
    cu_seqlens_from_position_ids,
    ensure_varlen_attention,
    load_causal_lm,
    load_value_model,
    make_tiny_model,
    packed_forward,
    reference_packed_forward,
    register_varlen_attention,
    varlen_attention,
    varlen_attention_forward,
)

ARCHS = ["qwen2", "llama"]
LENGTHS = [5, 1, 9, 3, 1, 6]  # varied, including length-1 samples


def _batch(lengths=LENGTHS, vocab=99, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]
    prompts = [s[: max(1, n // 2)] for s, n in zip(seqs, lengths)]
    responses = [s[max(1, n // 2) :] for s, n in zip(seqs, lengths)]
    return make_batch(prompts, responses)


def _per_sample(model, batch):
    """[B, T, V] outputs from one unpadded forward per sample (the ground truth)."""
    ids, lens = batch["input_ids"], batch["seq_len"].tolist()
    outs = [model(ids[i : i + 1, :n], use_cache=False).logits[0] for i, n in enumerate(lens)]
    width = ids.shape[1]
    return torch.stack([F.pad(o, (0, 0, 0, width - o.shape[0])) for o in outs])


@pytest.fixture(scope="module", params=ARCHS)
def models(request, tiny_model_paths):
    path = tiny_model_paths[request.param]
    return load_causal_lm(path), load_causal_lm(path, attn_implementation=VARLEN_ATTENTION)


def test_packed_logits_equal_per_sample(models):
    ref_model, model = models
    batch = _batch()
    packed = pack_batch(batch)
    logits = packed_forward(model, packed).logits
    assert logits.shape == (1, sum(LENGTHS), model.config.vocab_size)
    expected = _per_sample(ref_model, batch)
    got = packed.unpack(logits)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_packed_logits_equal_block_diagonal_reference(models):
    ref_model, model = models
    packed = pack_batch(_batch(seed=1))
    logits = packed_forward(model, packed).logits
    for m in (ref_model, model):  # the reference works under sdpa and under verl_varlen (4-D mask given)
        torch.testing.assert_close(reference_packed_forward(m, packed).logits, logits, atol=1e-5, rtol=1e-5)


def test_position_ids_alone_do_not_isolate(models):
    """Regression guard: a packed row with restarting position ids is NOT enough under plain sdpa."""
    ref_model, _ = models
    batch = _batch([6, 8])
    packed = pack_batch(batch)
    expected = packed.unpack(reference_packed_forward(ref_model, packed).logits)
    default = ref_model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits
    with_mask = ref_model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=torch.ones_like(packed.input_ids),
        use_cache=False,
    ).logits
    for leaky in (default, with_mask):
        got = packed.unpack(leaky)
        torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)  # the first sample is fine
        assert (got[1, :8] - expected[1, :8]).abs().max() > 1e-3  # the second one attends to the first


def test_segments_from_position_ids_without_cu_seqlens(models):
    ref_model, model = models
    packed = pack_batch(_batch(seed=2))
    got = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits
    expected = reference_packed_forward(ref_model, packed).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_zero_length_sample_and_log_probs(models):
    """An empty sample (e.g. a synthetic padding sample) is skipped; log-probs follow the schema."""
    ref_model, model = models
    batch = make_batch([[5, 6, 7], [], [8, 9]], [[10, 11], [], [12]])
    packed = pack_batch(batch)
    assert packed.cu_seqlens.tolist() == [0, 5, 5, 8]
    logits = packed_forward(model, packed).logits
    lp, _ = next_token_log_probs_and_entropy(logits, packed.input_ids, packed.cu_seqlens)
    lp = packed.unpack(lp)  # [B, T]
    assert (lp[1] == 0).all() and (lp[:, 0] == 0).all()
    for i in (0, 2):
        n = int(batch["seq_len"][i])
        ids = batch["input_ids"][i, :n]
        expected = torch.log_softmax(ref_model(ids[None], use_cache=False).logits[0, :-1], -1)
        expected = expected.gather(-1, ids[1:, None]).squeeze(-1)
        torch.testing.assert_close(lp[i, 1:n], expected, atol=1e-5, rtol=1e-5)


def test_gradients_match_per_sample(models):
    ref_model, model = models
    batch = _batch(seed=3)
    packed = pack_batch(batch)
    weights = torch.randn(batch["input_ids"].shape + (model.config.vocab_size,))
    mask = batch["attention_mask"][..., None].float()
    model.zero_grad()
    (packed.unpack(packed_forward(model, packed).logits) * weights * mask).sum().backward()
    ref_model.zero_grad()
    (_per_sample(ref_model, batch) * weights * mask).sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_value_model_packed(tiny_model_paths, arch):
    ref = load_value_model(tiny_model_paths[arch])
    model = ensure_varlen_attention(load_value_model(tiny_model_paths[arch]))
    model.train()  # head dropout is 0: deterministic in train mode too
    batch = _batch(seed=4)
    packed = pack_batch(batch)
    values = packed_forward(model, packed).logits
    assert values.shape == (1, packed.num_tokens, 1)
    torch.testing.assert_close(packed.unpack(values), _per_sample(ref, batch), atol=1e-5, rtol=1e-5)


def test_padded_forward_and_generate_unchanged(models):
    """A model switched to verl_varlen still works for ordinary padded batches and generation."""
    ref_model, model = models
    batch = _batch([4, 7, 2], seed=5)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    torch.testing.assert_close(
        (model(ids, attention_mask=mask).logits * mask[..., None]),
        (ref_model(ids, attention_mask=mask).logits * mask[..., None]),
        atol=1e-5,
        rtol=1e-5,
    )
    left = torch.tensor([[0, 0, 7, 8], [5, 6, 7, 8]])
    left_mask = (left != 0).long()
    kwargs = dict(attention_mask=left_mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(left, **kwargs), ref_model.generate(left, **kwargs))


def test_sliding_window_model(tmp_path):
    """Sliding-window layers over rows longer than the window fall back to sdpa's (packed) 4-D mask."""
    path = make_tiny_model(tmp_path, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    ref_model, model = load_causal_lm(path), load_causal_lm(path, attn_implementation=VARLEN_ATTENTION)
    assert set(model.config.layer_types) == {"sliding_attention"}
    for lengths in ([3, 4, 1], [7, 2, 6]):  # segments within the window; segments longer than it
        batch = _batch(lengths, seed=6)
        packed = pack_batch(batch)
        got = packed.unpack(packed_forward(model, packed).logits)
        torch.testing.assert_close(got, _per_sample(ref_model, batch), atol=1e-5, rtol=1e-5)
    ids = torch.randint(4, 99, (2, 7))
    torch.testing.assert_close(model(ids).logits, ref_model(ids).logits, atol=1e-5, rtol=1e-5)


def test_ensure_and_guard(tiny_model_paths):
    model = load_causal_lm(tiny_model_paths["qwen2"])
    packed = pack_batch(_batch([3, 2]))
    with pytest.raises(ValueError, match="ensure_varlen_attention"):
        packed_forward(model, packed)
    assert ensure_varlen_attention(model) is model
    assert model.config._attn_implementation == VARLEN_ATTENTION
    with pytest.raises(ValueError, match="registered"):
        ensure_varlen_attention(model, name="nope")


def test_wrapped_function_receives_cu_seqlens_and_no_mask(tiny_model_paths):
    """What a wrapper (Ulysses SP) sees: q/k/v of the packed row, cu_seqlens, no O(N^2) mask."""
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
        seen.append((query.shape, key.shape, attention_mask, cu, max_len))
        return varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)

    register_varlen_attention("verl_test_spy", spy)
    model = ensure_varlen_attention(load_causal_lm(tiny_model_paths["llama"]), name="verl_test_spy")
    packed = pack_batch(_batch())
    packed_forward(model, packed)
    assert len(seen) == model.config.num_hidden_layers
    q_shape, k_shape, mask, cu, max_len = seen[0]
    n = packed.num_tokens
    assert q_shape == (1, 4, n, 16) and k_shape == (1, 2, n, 16)
    assert mask is None and torch.equal(cu, packed.cu_seqlens) and max_len == max(LENGTHS)


@pytest.mark.parametrize("num_kv", [1, 2, 4])
def test_varlen_attention_function(num_kv):
    lens = [3, 1, 0, 5]
    cu = torch.tensor([0, 3, 4, 4, 9], dtype=torch.int32)
    q = torch.randn(1, 4, 9, 8, requires_grad=True)
    k = torch.randn(1, num_kv, 9, 8)
    v = torch.randn(1, num_kv, 9, 8)
    out = varlen_attention(q, k, v, cu, scaling=0.3)
    assert out.shape == (1, 9, 4, 8)
    rep = 4 // num_kv
    k_full, v_full = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    mask = block_diagonal_causal_mask(cu)
    ref = F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    start = 0
    for n in lens:  # each segment alone
        if n:
            seg = F.scaled_dot_product_attention(
                q[:, :, start : start + n], k_full[:, :, start : start + n], v_full[:, :, start : start + n],
                is_causal=True, scale=0.3,
            ).transpose(1, 2)
            torch.testing.assert_close(out[:, start : start + n], seg, atol=1e-6, rtol=1e-5)
        start += n
    with pytest.raises(ValueError, match="cu_seqlens ends at"):
        varlen_attention(q, k, v, cu[:-1])


def test_cu_seqlens_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 0]])
    assert cu_seqlens_from_position_ids(pos).tolist() == [0, 3, 4, 6, 7]
    assert cu_seqlens_from_position_ids(torch.arange(4)).tolist() == [0, 4]


def test_block_diagonal_mask():
    mask = block_diagonal_causal_mask(torch.tensor([0, 2, 3], dtype=torch.int32))
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
