"""The token server's engine thread: admitted requests in, batched rollout calls, results out.

One thread owns the rollout backend (an HF model is not thread-safe): it takes the queued requests, groups
those with the same sampling settings (at most ``max_batch`` prompts) and makes one
``generate_token_ids`` call per group. Each request's future gets ``(ids, log_probs)`` per prompt, or the
exception the backend raised. A request whose future was cancelled (its client timed out) is skipped.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EngineJob", "EngineThread", "GenerateFn"]

GenerateFn = Callable[[list[list[int]], Any, list[int]], tuple[list[list[int]], list[list[float]]]]


@dataclass
class EngineJob:
    """Prompts of one request, sampled with ``config`` (a ``RolloutConfig``) from ``seeds``."""

    prompts: list[list[int]]
    config: Any
    seeds: list[int]
    future: Future = field(default_factory=Future)

    def key(self) -> tuple:
        """The sampling settings: jobs with equal keys share one backend call."""
        c = self.config
        return (c.temperature, c.top_p, c.top_k, c.do_sample, c.max_new_tokens)


class EngineThread:
    """Runs :class:`EngineJob` s on one daemon thread through ``generate``.

    Args:
        generate: The backend's ``generate_token_ids``.
        max_batch: Most prompts per backend call.
    """

    def __init__(self, generate: GenerateFn, max_batch: int) -> None:
        self.generate = generate
        self.max_batch = max_batch
        self.calls = 0
        """Backend calls made."""
        self.prompts = 0
        """Prompts generated (``prompts / calls``: the mean batch)."""
        self._queue: queue.Queue[EngineJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="token-server-engine", daemon=True)
        self._thread.start()

    def submit(self, job: EngineJob) -> Future:
        """Queue ``job``; its future gets ``(ids, log_probs)`` or the backend's exception."""
        self._queue.put(job)
        return job.future

    def stop(self) -> None:
        """End the thread after the jobs queued before this call."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _take_group(self, first: EngineJob) -> tuple[list[EngineJob], bool]:
        group, rest, stop = [first], [], False
        size = len(first.prompts)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                stop = True
                break
            if job.key() == first.key() and size + len(job.prompts) <= self.max_batch:
                group.append(job)
                size += len(job.prompts)
            else:
                rest.append(job)
        for job in rest:  # other settings: next round, in order
            self._queue.put(job)
        return group, stop

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            group, stop = self._take_group(first)
            group = [j for j in group if j.future.set_running_or_notify_cancel()]
            if group:
                self._run(group)
            if stop:
                return

    def _run(self, group: list[EngineJob]) -> None:
        prompts = [p for j in group for p in j.prompts]
        seeds = [s for j in group for s in j.seeds]
        self.calls += 1
        self.prompts += len(prompts)
        try:
            ids, log_probs = self.generate(prompts, group[0].config, seeds)
            if len(ids) != len(prompts) or len(log_probs) != len(prompts):
                raise RuntimeError(f"the backend returned {len(ids)} responses for {len(prompts)} prompts")
        except BaseException as exc:  # noqa: BLE001 - every waiting request gets the backend's error
            for job in group:
                job.future.set_exception(exc)
            return
        start = 0
        for job in group:
            end = start + len(job.prompts)
            job.future.set_result((ids[start:end], log_probs[start:end]))
            start = end
