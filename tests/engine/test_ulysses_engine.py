"""Ulysses SP inside the engine: sp=2 and dp=2 x sp=2 give the sp=1 loss, outputs and updated params."""

import pytest
import torch
import torch.distributed as dist

from tests.engine.common import (
    assert_close_params,
    build_engine,
    collect_params,
    nll_loss,
    padded_log_probs,
    padded_values,
    random_batch,
    rank_shard,
    reference_step,
    relative_error,
    tiny_model,
    value_loss,
)
from verl_trainer.engine import OptimConfig
from verl_trainer.models.loading import load_causal_lm, load_value_model
from verl_trainer.testing.ranks import run_distributed

# lr 1e-3: the first AdamW step is ~lr*sign(g), so elements whose true gradient is ~0 turn round-off
# into ~lr updates; the norm-wise parameter error scales with lr (1.2e-5 at lr 1e-2, seen here).
OPTIM = OptimConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.01)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("ulysses_engine") / "model"))


def _sp_rank(model_path, batch, cases):
    out = {}
    for name, (backend, model_type, sp, extra) in cases.items():
        engine = build_engine(backend, model_type, model_path, OPTIM,
                              ulysses_sequence_parallel_size=sp, **extra)
        topo = engine.topology
        shard = rank_shard(batch, topo.dp_rank, topo.dp_size)  # every SP rank of a DP group: same samples
        entropy = model_type == "language_model"
        with engine.eval_mode():
            infer = engine.infer_batch(shard, calculate_entropy=entropy)["model_output"]
        with engine.train_mode():
            res = engine.train_batch(shard, nll_loss if model_type == "language_model" else value_loss)
        params = collect_params(engine)
        out[name] = {"dp": (topo.dp_size, topo.dp_rank, topo.sp_rank), "infer": infer, "loss": res["loss"],
                     "grad_norm": res["grad_norm"], "params": params if dist.get_rank() == 0 else None}
    return out


def _reference_infer(model_path, batch, model_type):
    """Plain padded HF forward (sdpa), next-token convention, 0 outside real positions > 0."""
    valid = batch["attention_mask"].bool()
    valid[:, 0] = False
    with torch.no_grad():
        if model_type == "language_model":
            model = load_causal_lm(model_path, attn_implementation="sdpa")
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            logits = logits.float()
            logp = torch.log_softmax(logits, -1)
            ent = -(logp.exp() * logp).sum(-1)
            out = {"log_probs": padded_log_probs(logits, batch["input_ids"]),
                   "entropy": torch.cat([ent.new_zeros(ent.shape[0], 1), ent[:, :-1]], 1)}
        else:
            model = load_value_model(model_path, attn_implementation="sdpa", seed=42)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            out = {"values": padded_values(logits)}
    return {k: v * valid for k, v in out.items()}


def test_sp2_and_dp2_sp2_match_sp1(model_path):
    batch = random_batch(8, seed=3)  # odd and even packed lengths: the SP padding path runs
    cases = {
        "fsdp2 lm dp2xsp2": ("fsdp2", "language_model", 2, {"micro_batch_size_per_gpu": 2}),
        "fsdp2 lm sp4 dynamic": ("fsdp2", "language_model", 4,
                                 {"use_dynamic_bsz": True, "max_token_len_per_gpu": 12}),
        "fsdp lm dp2xsp2": ("fsdp", "language_model", 2, {"micro_batch_size_per_gpu": 4}),
        "fsdp2 value dp2xsp2": ("fsdp2", "value_model", 2, {"micro_batch_size_per_gpu": 3}),
    }
    results = run_distributed(_sp_rank, 4, model_path, batch, cases, timeout=400)
    refs = {mt: reference_step(model_path, batch, OPTIM, mt) for mt in ("language_model", "value_model")}
    ref_out = {mt: _reference_infer(model_path, batch, mt) for mt in refs}
    for name, (_, model_type, sp, _) in cases.items():
        ref = refs[model_type]
        per_rank = [r[name] for r in results]
        dp = 4 // sp
        assert [r["dp"] for r in per_rank] == [(dp, rank // sp, rank % sp) for rank in range(4)]
        for r in per_rank:
            assert relative_error(torch.tensor(r["loss"]), torch.tensor(ref["losses"][0])) < 1e-5, name
            assert relative_error(torch.tensor(r["grad_norm"]), torch.tensor(ref["grad_norms"][0])) < 1e-5
            # outputs of this rank's DP shard equal the sp=1 outputs of the same samples
            n = batch.batch_size[0] // dp
            lo = r["dp"][1] * n
            for key, value in r["infer"].items():
                want = ref_out[model_type][key][lo:lo + n]
                torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
        assert_close_params(per_rank[0]["params"], ref["params"])
