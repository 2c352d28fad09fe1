"""Measure the call path of one GRPO step: which project files it runs through and how it hops between them.

    python scripts/step_path.py [--list] [--no-balancing] [--json]

Builds a tiny Qwen2 and the arithmetic task in a temporary directory, fits GRPO for two steps on one
process (with ``SequenceBalancing``, as the README's multi-rank runs use it; ``--no-balancing``: the
default recipe's step) and traces the second step with ``sys.setprofile`` from ``on_train_batch_start``
to ``on_train_batch_end``. Each call's caller is the nearest project frame on the real call stack (so the
fit loop's own calls after the callback returns are seen, and nothing is attributed by a guessed stack).
It prints two views:

* **full depth**: every project function call; ``files`` = distinct files entered, ``hops`` = distinct
  (caller function, callee function) pairs in different files, ``back`` = hops into a file that the step
  had already entered (the ping-pong the top-floor design avoids).
* **orchestration**: calls made by the top floor (trainer, training loop, module, strategy, algorithms,
  callbacks) and calls from lower layers back up into it, without calls into leaf helpers: functions
  whose whole call tree stays in their own file (value constructors such as ``Metric.mean``, masks, rank
  queries), which a reader steps over like builtins. Calls *inside* a lower layer (the engine's packing
  and attention, the pure functions, metrics arithmetic) are that layer's own business.

Budgets (issue 30, ``tests/test_architecture.py``): a GRPO step with ``SequenceBalancing`` at most 14 files
/ 30 hops orchestration and 35 files / 110 hops full depth. Measured 2026-12-04: 13 / 22 (10 back)
orchestration and 34 / 103 (71 back) full depth; without balancing 10 / 16 / 7 and 31 / 94 / 64.

``--list`` prints the files and hops of the orchestration view; ``--json`` prints both views (and the
files entered) as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_FLOOR = ("verl_trainer/trainer.py", "verl_trainer/training/", "verl_trainer/module.py",
             "verl_trainer/algorithms/", "callbacks/", "recipes/")


def _project_file(filename: str) -> str | None:
    try:
        rel = str(Path(filename).resolve().relative_to(ROOT))
    except ValueError:
        return None
    return rel if rel.startswith(("verl_trainer/", "callbacks/", "recipes/")) else None


def _is_top(path: str) -> bool:
    return path.startswith(TOP_FLOOR)


class StepTracer:
    """Records (caller, callee) function pairs of project code while active.

    The caller of a call is the nearest project frame below it on the interpreter's stack (frames of
    other code, torch's ``Module.__call__`` say, are passed through).
    """

    def __init__(self) -> None:
        self.edges: dict[tuple[tuple[str, str], tuple[str, str]], int] = {}
        self._paths: dict[str, str | None] = {}

    def _path(self, filename: str) -> str | None:
        if filename not in self._paths:
            self._paths[filename] = _project_file(filename)
        return self._paths[filename]

    def __call__(self, frame, event, arg):  # noqa: ANN001, D102  (sys.setprofile signature)
        if event != "call":
            return
        path = self._path(frame.f_code.co_filename)
        if path is None:
            return
        caller_frame = frame.f_back
        while caller_frame is not None and self._path(caller_frame.f_code.co_filename) is None:
            caller_frame = caller_frame.f_back
        if caller_frame is None:
            return
        caller = (self._path(caller_frame.f_code.co_filename), caller_frame.f_code.co_qualname)
        self.edges.setdefault((caller, (path, frame.f_code.co_qualname)), len(self.edges))

    def start(self) -> None:
        """Trace from now on."""
        sys.setprofile(self)

    @staticmethod
    def stop() -> None:
        """Stop tracing."""
        sys.setprofile(None)


def summarise(edges: list[tuple[tuple[str, str], tuple[str, str]]]) -> dict[str, object]:
    """Files, hops (cross-file function pairs) and back-hops of ``edges`` in first-call order."""
    files: list[str] = []
    seen: set[str] = set()
    hops, back, entered = [], 0, Counter()
    for caller, callee in edges:
        for path in (caller[0], callee[0]):
            if path not in files:
                files.append(path)
        seen.add(caller[0])
        if caller[0] != callee[0]:
            hops.append((caller, callee))
            entered[callee[0]] += 1
            back += callee[0] in seen
        seen.add(callee[0])
    return {"files": files, "hops": hops, "back": back, "entered": entered.most_common(5)}


def step_path(edges: list[tuple[tuple[str, str], tuple[str, str]]]) -> list:
    """The orchestration edges: made by the top floor, or from a lower layer back up into it."""
    return [(a, b) for a, b in edges if _is_top(a[0]) or _is_top(b[0])]


def without_leaf_calls(edges: list[tuple[tuple[str, str], tuple[str, str]]]) -> list:
    """``edges`` without calls into leaf helpers: functions whose whole call tree stays in their file.

    A function that reaches another project file only through a helper of its own file is not a leaf
    (judged at every depth, not one call deep). A reader following the step steps over a leaf call (a
    value constructor, a mask, a rank query) as over a builtin; what remains is how control moves
    between the parts.
    """
    reaches_out = {a for a, b in edges if a[0] != b[0]}
    grew = True
    while grew:  # a caller of a function that reaches out, in the same file, reaches out too
        before = len(reaches_out)
        reaches_out |= {a for a, b in edges if b in reaches_out}
        grew = len(reaches_out) > before
    return [(a, b) for a, b in edges if b in reaches_out]


def trace_one_grpo_step(balancing: bool = True) -> list:
    """Fit GRPO for two steps on a tiny model; the project calls of the second step.

    Args:
        balancing: Add ``SequenceBalancing`` (the README's multi-rank runs); without it the step is the
            default recipe's.
    """
    sys.path.insert(0, str(ROOT / "recipes"))
    os.environ.setdefault("WANDB_MODE", "offline")
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.callbacks import Callback, SequenceBalancing
    from verl_trainer.data.tasks import ArithmeticTaskConfig, write_arithmetic_task
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.models.tiny import make_tiny_model
    from verl_trainer.recipe_config import GRPORecipeConfig, load_config

    tracer = StepTracer()

    class TraceSecondStep(Callback):
        def __init__(self) -> None:
            self.steps = 0

        def on_train_batch_start(self, trainer, module, batch, batch_idx):  # noqa: ANN001, D102
            self.steps += 1
            if self.steps == 2:
                tracer.start()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # noqa: ANN001, D102
            if self.steps == 2:
                tracer.stop()

    tmp = Path(tempfile.mkdtemp(prefix="step_path_"))
    make_tiny_model(tmp / "model", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, seed=1)
    write_arithmetic_task(tmp / "data", ArithmeticTaskConfig(num_train=64, num_val=4, holdout_fraction=0.2))
    cfg = load_config(GRPORecipeConfig, ROOT / "configs" / "grpo.yaml", [
        f"algorithm.model_path={tmp / 'model'}", f"data.train_files={tmp / 'data' / 'train.jsonl'}",
        "data.val_files=null", "data.train_batch_size=4", "algorithm.rollout.max_new_tokens=3",
        "algorithm.actor.engine.micro_batch_size_per_gpu=2", "algorithm.actor.ppo_mini_batch_size=2",
    ])
    from verl_trainer import Trainer

    callbacks = [TraceSecondStep(), SequenceBalancing()] if balancing else [TraceSecondStep()]
    trainer = Trainer(max_steps=2, callbacks=callbacks, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False,
                      default_root_dir=str(tmp / "run"))
    trainer.fit(GRPO(cfg.algorithm), datamodule=PromptDataModule(cfg.data, load_tokenizer(tmp / "model")))
    return list(tracer.edges)


FULL, ORCHESTRATION = "full depth", "orchestration"


def measure(edges: list[tuple[tuple[str, str], tuple[str, str]]]) -> dict[str, dict[str, object]]:
    """The two views of one traced step, by name (see the module docstring)."""
    return {FULL: summarise(edges), ORCHESTRATION: summarise(step_path(without_leaf_calls(edges)))}


def main() -> None:
    """Trace one step and print both views."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print the files and hops of the orchestration")
    parser.add_argument("--no-balancing", action="store_true",
                        help="trace the default recipe's step, without SequenceBalancing")
    parser.add_argument("--json", action="store_true", help="print both views as one JSON object")
    args = parser.parse_args()
    views = measure(trace_one_grpo_step(balancing=not args.no_balancing))
    if args.json:
        print(json.dumps({name: {"files": view["files"], "hops": len(view["hops"]), "back": view["back"]}
                          for name, view in views.items()}))
        return
    for name, view in views.items():
        print(f"{name}: {len(view['files'])} files, {len(view['hops'])} hops, {view['back']} back into "
              f"a file already entered; most entered: {view['entered']}")
    path = views[ORCHESTRATION]
    if args.list:
        print(f"\n{ORCHESTRATION} files:\n  " + "\n  ".join(path["files"]))
        print(f"\n{ORCHESTRATION} hops:")
        for (a, fa), (b, fb) in path["hops"]:
            print(f"  {a}:{fa} -> {b}:{fb}")


if __name__ == "__main__":
    main()
