"""The GRPO recipe on a Ray cluster: Ray Train's ``TorchTrainer`` starts the ranks, the recipe runs unchanged.

    pip install 'verl-trainer[ray]'
    ray start --head                          # head node; `ray start --address=HEAD:6379` on the others
    python examples/ray_grpo.py --address auto trainer.devices=4 trainer.num_nodes=2 trainer.max_steps=50

Everything after the options is the recipe's own command line (``recipes/grpo.py``: ``--config PATH`` and
``key=value`` overrides). The config is loaded and checked here, on the driver, before any worker starts.
``trainer.devices × trainer.num_nodes`` Ray workers are started (one rank each; ``--gpus`` gives each one
GPU), spread over the nodes when ``num_nodes > 1`` (``docs/ray.md``). Each worker changes to the directory
this script was started in, so relative paths (``trainer.default_root_dir``, ``task.dir``, ``--config``)
mean what they mean on the command line; on several nodes that directory must be on a shared file system,
as the checkpoints are.

Checkpoints: every save of the recipe's ``ModelCheckpoint`` (``trainer.checkpoint.every_n_train_steps``) is
reported to Ray Train (:class:`~verl_trainer.callbacks.RayTrainReport`) and stored under
``--storage-path/--name``. When a worker dies, Ray restarts all of them (up to ``--max-failures`` times) and
the run resumes from its latest checkpoint (the newer of Ray's latest registered one and the newest this
run wrote into the Trainer's checkpoint directory); running the script again with the same ``--name`` and
``--storage-path`` resumes the same way.

A separate rollout pool (``algorithm.rollout.placement=separate algorithm.rollout.rollout_ranks=R``): the
last ``R`` workers generate, the others train; the rollout workers report each checkpoint too, and their
``grpo.main`` ends after the fit (``docs/rollout.md``, "A separate rollout pool").
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: the recipe, from the launch directory, resuming from Ray's latest checkpoint."""
    os.chdir(config["launch_dir"])
    from verl_trainer.callbacks import RayTrainReport
    from verl_trainer.recipes import grpo

    argv = list(config["argv"])
    resume = RayTrainReport.resume_path(config["checkpoint_dir"])
    if resume is not None:
        print(f"resuming from this Ray run's latest checkpoint {resume}", flush=True)
        argv.append(f"trainer.ckpt_path={resume}")  # the last override wins
    grpo.main(argv=argv, callbacks=[RayTrainReport(metrics=("reward/mean",))])


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """This script's options, and the rest: the recipe's command line."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local Ray)")
    parser.add_argument("--node-ip-address", default=None,
                        help="this machine's address in the cluster (`ray start --node-ip-address`)")
    parser.add_argument("--name", default="ray_grpo", help="Ray Train run name (the same name resumes)")
    parser.add_argument("--storage-path", default="outputs/ray_results",
                        help="where Ray stores the reported checkpoints (a shared path on several nodes)")
    parser.add_argument("--max-failures", type=int, default=1, help="worker-group restarts after a failure")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0, help="Ray CPUs reserved per rank")
    parser.add_argument("--gpus", action="store_true", help="one GPU per rank (trainer.accelerator=cuda)")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Check the recipe's config, connect to Ray, run the TorchTrainer."""
    args, recipe_argv = parse_args(argv)
    from verl_trainer.recipe_config import GRPORecipeConfig, parse_recipe_args
    from verl_trainer.recipes.grpo import CONFIG

    # every config error, before Ray starts anything
    cfg = parse_recipe_args(GRPORecipeConfig, CONFIG, argv=recipe_argv)
    if not cfg.trainer.enable_checkpointing:
        raise SystemExit("trainer.enable_checkpointing=false: Ray could not resume a failed run; turn it on")
    workers = cfg.trainer.devices * cfg.trainer.num_nodes
    checkpoint_dir = str(Path(cfg.trainer.checkpoint.dirpath or Path(cfg.trainer.default_root_dir or ".",
                                                                      "checkpoints")).absolute())

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=args.address, _node_ip_address=args.node_ip_address)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"launch_dir": os.getcwd(), "argv": recipe_argv, "checkpoint_dir": checkpoint_dir},
        torch_config=TorchConfig(backend="nccl" if args.gpus else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=workers, use_gpu=args.gpus, resources_per_worker={"CPU": args.cpus_per_worker},
            placement_strategy="SPREAD" if cfg.trainer.num_nodes > 1 else "PACK",
        ),
        run_config=RunConfig(name=args.name, storage_path=str(Path(args.storage_path).absolute()),
                             failure_config=FailureConfig(max_failures=args.max_failures)),
    )
    result = trainer.fit()
    latest = result.checkpoint.path if result.checkpoint else None
    print(f"ray run done: {workers} workers, latest checkpoint {latest}", flush=True)


if __name__ == "__main__":
    main()
