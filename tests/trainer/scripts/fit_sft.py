"""A plain ``python fit_sft.py`` SFT run used by the launch and resume tests (started as a subprocess).

Every rank writes ``<root>/pids/rank<r>.pid``; rank 0 writes the final parameters to ``--params-out``.
Fault injection: ``--kill-at-step N`` SIGKILLs the whole process group (the test starts the script in a
new session) at the start of step N+1 (``--kill-mode start``) or in the middle of step N's checkpoint
write (``--kill-mode midwrite``); ``--fail-rank R --fail-step S`` raises on rank R in step S (or
SIGKILLs it with ``--fail-mode sigkill``, or stalls it for 120 s in user code with ``--fail-mode stall``).
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from tests.trainer.common import SFTData, sft_module  # noqa: E402
from verl_trainer import Trainer  # noqa: E402
from verl_trainer.callbacks import Callback, ModelCheckpoint  # noqa: E402


class Faults(Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def _kill(self) -> None:
        sys.stdout.flush()
        os.killpg(os.getpgid(0), signal.SIGKILL)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        a = self.args
        if a.kill_at_step and a.kill_mode == "start" and trainer.global_step == a.kill_at_step:
            if trainer.is_global_zero:
                self._kill()
        if a.fail_step and trainer.global_step + 1 == a.fail_step and trainer.global_rank == a.fail_rank:
            if a.fail_mode == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if a.fail_mode == "stall":
                time.sleep(120)
            raise ValueError(f"injected failure on rank {a.fail_rank} at step {a.fail_step}")

    def on_save_checkpoint(self, trainer, module, checkpoint):
        a = self.args
        if a.kill_at_step and a.kill_mode == "midwrite" and trainer.global_step == a.kill_at_step:
            if trainer.is_global_zero:
                self._kill()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--strategy", default="fsdp2")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=2)
    p.add_argument("--every-n", type=int, default=0)
    p.add_argument("--logger", default="csv")
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--params-out", default=None)
    p.add_argument("--kill-at-step", type=int, default=0)
    p.add_argument("--kill-mode", choices=["start", "midwrite"], default="start")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=0)
    p.add_argument("--fail-mode", choices=["raise", "sigkill", "stall"], default="raise")
    p.add_argument("--collective-timeout", type=float, default=None)
    args = p.parse_args()

    rank = os.environ.get("LOCAL_RANK", "0")
    pids = Path(args.root) / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / f"rank{rank}.pid").write_text(str(os.getpid()))

    callbacks = [Faults(args)]
    if args.every_n:
        callbacks.append(ModelCheckpoint(every_n_train_steps=args.every_n, keep_last_k=2))
    loggers = args.logger.split(",") if args.logger else False
    trainer = Trainer(strategy=args.strategy, devices=args.devices, max_steps=args.max_steps,
                      default_root_dir=args.root, callbacks=callbacks, logger=loggers, seed=7,
                      collective_timeout=args.collective_timeout)
    module = sft_module(args.model)
    trainer.fit(module, SFTData(n=28, batch_size=4), ckpt_path=args.ckpt_path)
    params = {name: t.detach().cpu().clone() for name, t in module.engines["actor"].get_per_tensor_param()}
    if trainer.is_global_zero:
        if args.params_out:
            torch.save(params, args.params_out)
        print(f"fit done: world_size={trainer.world_size} global_step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
