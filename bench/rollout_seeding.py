"""Row-seeded sampling (a response's seed from (seed, step, prompt, sample)) against one shared RNG.

The rollout used to draw every row of a batch with one ``torch.multinomial`` on the global RNG; it now
draws each row from its own seed (``rollout/sampling.py``: one uniform per row and token, the token found by
inverting the row's CDF) and also returns the sampled tokens' log-probs. This measures, in the same run and
on the same prompts and weights, the time of one rollout batch both ways:

* ``drop_finished`` (the CPU default): ``sample_dropping_finished(seeds=None)`` (the old shared-RNG draw)
  vs ``seeds=[...]`` (what ``HFRollout`` runs now);
* ``generate``: ``model.generate(do_sample=True)`` vs greedy ``generate`` over ``RowSampler``.

Shapes: ``default`` is the default recipe's rollout (``configs/grpo.yaml``: tiny Qwen2 hidden 64 / 2 layers,
32 prompts x n=8, 4 new tokens, temperature 1); ``long`` is 16 prompts x 8 with up to 32 new tokens on a
hidden-256 / 4-layer model (an eos logit bias makes lengths vary, so rows are dropped). Target: the
default recipe's rollout is not slower (ratio new / old <= ~1.05 within noise). The two sides draw
different tokens, so their responses differ in length; the last column divides by the response tokens
made. ``draw`` rows time the sampling step alone (the only code that differs), on ``[256, V]`` scores.

Usage: python bench/rollout_seeding.py [--repeats 5] [--shapes default long]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_trainer.models.tiny import make_tiny_model  # noqa: E402
from verl_trainer.rollout import HFRollout, RolloutConfig  # noqa: E402
from verl_trainer.rollout.sampling import (
    sample_dropping_finished,  # noqa: E402
    sample_rows,  # noqa: E402
)

SHAPES = {
    "default": dict(hidden=64, layers=2, prompts=32, n=8, new=4, eos_bias=0.0),
    "long": dict(hidden=256, layers=4, prompts=16, n=8, new=32, eos_bias=3.0),
}


def _rollout(workdir: Path, shape: dict, decoding: str) -> HFRollout:
    path = workdir / f"m{shape['hidden']}x{shape['layers']}"
    if not (path / "config.json").exists():
        make_tiny_model(path, hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                        num_attention_heads=4, num_key_value_heads=2, seed=0)
    config = RolloutConfig(n=shape["n"], max_new_tokens=shape["new"], temperature=1.0, decoding=decoding)
    rollout = HFRollout(config, path)
    if shape["eos_bias"]:  # an eos logit bias: responses end at varied lengths
        old = rollout.model.lm_head
        head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            head.weight.copy_(old.weight)
            head.bias.zero_()
            head.bias[rollout.eos_token_ids[0]] = shape["eos_bias"]
        rollout.model.lm_head = head.requires_grad_(False)
    return rollout


def _time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _tokens(ids: list[list[int]], eos: int) -> int:
    return sum(len(r[: r.index(eos) + 1]) if eos in r else len(r) for r in ids)


def measure(rollout: HFRollout, shape: dict, repeats: int) -> tuple[float, float, int, int]:
    """Fastest seconds of one batch (the least disturbed by other load) and the response tokens it made:
    ``(shared RNG s, row-seeded s, shared tokens, row-seeded tokens)``, interleaved. The shared RNG is
    reseeded before every batch, so both sides repeat the same draws (``min`` then compares like with like).
    """
    texts = [f"{a}+{b}=" for a in range(10) for b in range(10)][: shape["prompts"]]
    encode = rollout.tokenizer.encode
    prompts = [encode(t, add_special_tokens=False) for t in texts for _ in range(shape["n"])]
    ids, mask = rollout._left_pad(prompts)
    gen_config = rollout.generation_config(rollout.config)
    seeds = list(range(len(prompts)))
    eos = rollout.eos_token_ids[0]
    made = {}
    if rollout.config.decoding == "drop_finished":
        def old() -> None:
            torch.manual_seed(0)
            made["old"] = _tokens(sample_dropping_finished(rollout.model, ids, mask, gen_config)[0], eos)

        def new() -> None:
            made["new"] = _tokens(sample_dropping_finished(rollout.model, ids, mask, gen_config,
                                                           seeds=seeds)[0], eos)
    else:
        def old() -> None:
            torch.manual_seed(0)
            out = rollout.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
            made["old"] = _tokens(out[:, ids.shape[1]:].tolist(), eos)

        def new() -> None:
            made["new"] = _tokens(rollout._generate(ids, mask, gen_config, seeds)[0], eos)
    olds, news = [], []
    with torch.no_grad():
        old(), new()  # warm-up
        for _ in range(repeats):  # interleaved: machine load hits both alike
            olds += _time(old, 1)
            news += _time(new, 1)
    return min(olds), min(news), made["old"], made["new"]


def sampling_op(rows: int, vocab: int, repeats: int) -> tuple[float, float]:
    """Fastest seconds of the draw alone on ``[rows, vocab]`` scores: multinomial + the sampled log-prob
    (the old loop's step) vs ``sample_rows`` at given uniforms (the new one's)."""
    scores = torch.randn(rows, vocab)
    uniforms = torch.rand(rows)

    def old() -> None:
        tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        torch.log_softmax(scores, dim=-1).gather(-1, tokens[:, None])

    def new() -> None:
        sample_rows(scores, uniforms)

    old(), new()
    return min(_time(old, repeats)), min(_time(new, repeats))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"{'shape':8} {'decoding':14} {'shared RNG ms':>14} {'row-seeded ms':>14} {'ratio':>7} "
          f"{'tokens (shared / seeded)':>25} {'ratio per 1k tokens':>20}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            shape = SHAPES[name]
            for decoding in ("drop_finished", "generate"):
                rollout = _rollout(Path(tmp), shape, decoding)
                repeats = args.repeats * (3 if name == "default" else 1)
                old, new, old_tok, new_tok = measure(rollout, shape, repeats)
                per_token = (new / new_tok) / (old / old_tok)
                print(f"{name:8} {decoding:14} {old * 1e3:14.1f} {new * 1e3:14.1f} {new / old:7.3f} "
                      f"{f'{old_tok} / {new_tok}':>25} {per_token:20.3f}")
        for rows, vocab in ((256, rollout.model.lm_head.out_features), (256, 151_936)):
            old, new = sampling_op(rows, vocab, args.repeats * 4)
            print(f"{'draw':8} {f'{rows}x{vocab}':14} {old * 1e3:14.3f} {new * 1e3:14.3f} {new / old:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
