"""The token server's overhead: the same requests through HTTP on 127.0.0.1 and as direct rollout calls.

A tiny Qwen2 (hidden 64, 2 layers: the default recipe's policy) behind :class:`TokenServer`. Measured in
the same run, on the same prompts, seeds and weights:

* ``direct 1x1``: ``rollout.generate_token_ids`` on one prompt at a time (a call's latency);
* ``server 1x1``: one ``/v1/completions`` request at a time (token-id prompt): latency with HTTP, JSON and the
  engine thread;
* ``direct batch``: all prompts in ``--concurrency``-sized batches (the throughput a caller that batches
  itself gets);
* ``server concurrent``: ``--concurrency`` client threads sending one request each at a time (the engine
  thread batches requests of equal settings); the clients share the server's process and GIL;
* ``server processes``: the same from ``--concurrency`` client processes (as external agents run).

Printed: mean / p50 / p95 latency per request, requests/s and sampled tokens/s, and each server row's ratio
to its direct baseline (latency ratio for 1x1, throughput ratio for concurrent). Bounded: ``--requests``
requests per row and ``--time-limit`` seconds in all (a row stops early past its share).

Usage: python bench/token_server.py [--requests 32] [--concurrency 8] [--max-new-tokens 16]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from verl_trainer.models.tiny import make_tiny_model  # noqa: E402
from verl_trainer.rollout import HFRollout, RolloutConfig  # noqa: E402
from verl_trainer.rollout.base import derive_sample_seed  # noqa: E402
from verl_trainer.serving import ServerConfig, TokenServer  # noqa: E402


def _row(name: str, latencies: list[float], tokens: int, wall: float) -> dict:
    ordered = sorted(latencies)
    return {"name": name, "n": len(latencies), "mean": statistics.fmean(ordered),
            "p50": ordered[len(ordered) // 2],
            "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], "rps": len(ordered) / wall,
            "tps": tokens / wall}


def _post_once(url: str, prompt: list[int], seed: int, max_tokens: int) -> tuple[float, int]:
    """One request from a client process: ``(latency s, sampled tokens)``."""
    t = time.perf_counter()
    answer = httpx.post(url + "/completions", json={"prompt": prompt, "seed": seed, "max_tokens": max_tokens},
                        timeout=120)
    answer.raise_for_status()
    return time.perf_counter() - t, len(answer.json()["choices"][0]["token_ids"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--time-limit", type=float, default=240.0)
    args = parser.parse_args()
    share = args.time_limit / 4

    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(Path(tmp) / "policy")
        config = RolloutConfig(max_new_tokens=args.max_new_tokens, device="cpu")
        rollout = HFRollout(config, str(Path(tmp) / "policy"))
    tok = rollout.tokenizer
    prompts = [tok.encode(f"user: {i}+{i % 7}=?\nassistant: ", add_special_tokens=False)
               for i in range(args.requests)]
    seeds = [derive_sample_seed(0, 0, i, 0) for i in range(args.requests)]
    rows = []

    def timed_direct(batch: int, name: str) -> None:
        latencies, tokens, start = [], 0, time.perf_counter()
        for i in range(0, args.requests, batch):
            t = time.perf_counter()
            ids, _ = rollout.generate_token_ids(prompts[i: i + batch], config, seeds[i: i + batch])
            latencies.extend([time.perf_counter() - t] * len(ids))
            tokens += sum(len(x) for x in ids)
            if time.perf_counter() - start > share:
                break
        rows.append(_row(name, latencies, tokens, time.perf_counter() - start))

    rollout.generate_token_ids(prompts[:1], config, seeds[:1])  # warm-up
    timed_direct(1, "direct 1x1")
    with TokenServer(rollout.generate_token_ids, config, tok, rollout.eos_token_ids,
                     ServerConfig(max_batch=args.concurrency)) as server:
        client = httpx.Client(base_url=server.url, timeout=120)
        client.post("/completions", json={"prompt": prompts[0], "seed": 0})  # warm-up

        def ask(i: int, out: list, counts: list, client: httpx.Client) -> None:
            t = time.perf_counter()
            answer = client.post("/completions", json={"prompt": prompts[i], "seed": i,
                                                       "max_tokens": args.max_new_tokens})
            answer.raise_for_status()
            out.append(time.perf_counter() - t)
            counts.append(len(answer.json()["choices"][0]["token_ids"]))

        latencies, counts, start = [], [], time.perf_counter()
        for i in range(args.requests):
            ask(i, latencies, counts, client)
            if time.perf_counter() - start > share:
                break
        rows.append(_row("server 1x1", latencies, sum(counts), time.perf_counter() - start))
        timed_direct(args.concurrency, "direct batch")

        latencies, counts, start = [], [], time.perf_counter()
        todo = iter(range(args.requests))
        lock = threading.Lock()

        def worker() -> None:
            with httpx.Client(base_url=server.url, timeout=120) as own:
                while time.perf_counter() - start < share:
                    with lock:
                        i = next(todo, None)
                    if i is None:
                        return
                    ask(i, latencies, counts, own)

        calls_before, prompts_before = server.engine.calls, server.engine.prompts
        threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows.append(_row("server concurrent", latencies, sum(counts), time.perf_counter() - start))
        calls = server.engine.calls - calls_before
        batched = server.engine.prompts - prompts_before
        with ProcessPoolExecutor(args.concurrency, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_post_once, [server.url] * args.concurrency, prompts[: args.concurrency],
                          range(args.concurrency), [1] * args.concurrency))  # start the client processes
            start = time.perf_counter()
            results = list(pool.map(_post_once, [server.url] * args.requests, prompts, range(args.requests),
                                    [args.max_new_tokens] * args.requests))
            rows.append(_row("server processes", [r[0] for r in results], sum(r[1] for r in results),
                             time.perf_counter() - start))
        client.close()

    base = {r["name"]: r for r in rows}
    print(f"{'row':<18} {'n':>4} {'mean ms':>8} {'p50 ms':>8} {'p95 ms':>8} {'req/s':>7} {'tok/s':>8}  ratio")
    for r in rows:
        ratio = ""
        if r["name"] == "server 1x1":
            ratio = f"latency x{r['mean'] / base['direct 1x1']['mean']:.2f} vs direct 1x1"
        elif r["name"] in ("server concurrent", "server processes"):
            ratio = f"throughput x{r['tps'] / base['direct batch']['tps']:.2f} vs direct batch"
        ms = f"{r['mean'] * 1e3:>8.1f} {r['p50'] * 1e3:>8.1f} {r['p95'] * 1e3:>8.1f}"
        print(f"{r['name']:<18} {r['n']:>4} {ms} {r['rps']:>7.1f} {r['tps']:>8.0f}  {ratio}")
    print(f"engine: {calls} backend calls for {batched} concurrent requests (mean batch "
          f"{batched / max(calls, 1):.1f}); clients run in the server's process (they share its GIL)")


if __name__ == "__main__":
    main()
