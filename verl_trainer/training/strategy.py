"""The Trainer's strategy: which engine backend builds the module's engines, and how ranks talk.

``Trainer(strategy="fsdp2")`` is shorthand for ``Trainer(strategy=Strategy("fsdp2"))``. A strategy name
is an engine backend registered with :class:`~verl_trainer.engine.EngineRegistry` (``fsdp``, ``fsdp2``,
``deepspeed``, ``deepspeed_stage_1/2/3``, and whatever plug-ins register). The strategy owns the run's
process topology: :meth:`Strategy.build_engines` builds the ``(dp, sp)`` / ``(dp, tp)`` meshes once, after
launch (every engine spec must ask for the same sp and tp sizes, checked before any model loads), and
turns a module's :class:`~verl_trainer.engine.config.EngineSpec` values into initialised engines of its
backend on that topology, with the Trainer's precision and seed applied to each
:class:`~verl_trainer.engine.EngineConfig`. ``Strategy.topology`` is what the Trainer reports as the
data-parallel group (``trainer.dp_group``).

Precision (Lightning's names) maps onto the engine's dtypes:

==============  ===========  ============  ===========
precision       param_dtype  reduce_dtype  model_dtype
==============  ===========  ============  ===========
``32-true``     float32      float32       float32
``bf16-mixed``  bfloat16     float32       float32
``bf16-true``   bfloat16     bfloat16      bfloat16
``16-mixed``    float16      float32       float32
==============  ===========  ============  ===========

Where each precision runs, and the warnings and refusals: :func:`check_precision`; the float16 loss
scaling: ``engine/loss_scale.py``.
"""

from __future__ import annotations

import platform
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from verl_trainer.engine.base import BaseEngine
from verl_trainer.engine.config import EngineConfig, EngineSpec, to_dtype
from verl_trainer.engine.registry import EngineRegistry, missing_package
from verl_trainer.engine.topology import Topology, build_topology, check_same_sizes
from verl_trainer.engine.unserved import unserved_backend_message
from verl_trainer.utils.distributed import is_initialized, set_collective_timeout

__all__ = [
    "PRECISIONS", "Strategy", "available_strategies", "check_precision", "normalize_precision",
    "resolve_strategy",
]

PRECISIONS: dict[str, dict[str, str]] = {
    "32-true": {"param_dtype": "float32", "reduce_dtype": "float32", "model_dtype": "float32"},
    "bf16-mixed": {"param_dtype": "bfloat16", "reduce_dtype": "float32", "model_dtype": "float32"},
    "bf16-true": {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16", "model_dtype": "bfloat16"},
    "16-mixed": {"param_dtype": "float16", "reduce_dtype": "float32", "model_dtype": "float32"},
}
_PRECISION_ALIASES: dict[str | int, str] = {
    32: "32-true", "32": "32-true", "bf16": "bf16-mixed",
    16: "16-mixed", "16": "16-mixed", "fp16": "16-mixed",
}


def normalize_precision(precision: str | int) -> str:
    """Lightning's precision name for ``precision`` (``32`` → ``"32-true"``, ``"bf16"`` → ``"bf16-mixed"``).

    Raises:
        ValueError: For a precision outside :data:`PRECISIONS`.
    """
    name = _PRECISION_ALIASES.get(precision, precision)
    if name not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; choose one of {sorted(PRECISIONS)}")
    return str(name)


def check_precision(precision: str, device_type: str, backend: str | None = None) -> str:
    """``precision`` if this ``device_type`` (and strategy ``backend``) can run it; a warning when slow.

    ``bf16-mixed`` is allowed wherever autocast / bfloat16 kernels run (a CPU without native bfloat16
    emulates it, slowly: warned); ``bf16-true`` needs native bfloat16. ``16-mixed`` runs on CUDA and, with
    the FSDP strategies, on CPU (emulated float16 without AVX512-FP16 / AMX-FP16: warned); DeepSpeed's CPU
    accelerator refuses float16 there.

    Raises:
        ValueError: The precision cannot run here; the message names what to use.
    """
    if precision == "16-mixed":
        if device_type == "cpu" and not fp16_supported_on_cpu():
            refusal = getattr(EngineRegistry.backend_class(backend or ""), "CPU_FLOAT16_REFUSAL", None)
            if refusal is not None:  # declared by the backend class (DeepSpeed's CPU accelerator)
                raise ValueError(
                    f"precision='16-mixed' with strategy={backend!r} on this CPU: {refusal} (no AVX512-FP16 "
                    f"/ AMX-FP16); use strategy='fsdp2' (torch emulates float16) or precision='bf16-mixed' "
                    f"/ '32-true'"
                )
            warnings.warn(
                "precision='16-mixed' on a CPU without native float16 (AVX512-FP16 / AMX-FP16): torch "
                "emulates it, so steps are slower than precision='32-true'", stacklevel=3,
            )
        return precision
    if precision.startswith("bf16") and not bf16_supported(device_type):
        if precision == "bf16-true" or device_type != "cpu":
            raise ValueError(
                f"precision={precision!r} needs native bfloat16, which this {device_type} lacks (CPU: "
                f"AVX512-BF16 or AMX; GPU: Ampere or newer); use precision='32-true'"
                + (" or 'bf16-mixed' (emulated, slow)" if device_type == "cpu" else "")
            )
        warnings.warn(
            "precision='bf16-mixed' on a CPU without native bfloat16 (AVX512-BF16 / AMX): torch emulates "
            "it, so steps are slower than precision='32-true'", stacklevel=3,
        )
    return precision


def fp16_supported_on_cpu() -> bool:
    """Whether this CPU computes float16 natively (oneDNN's probe, as DeepSpeed's CPU accelerator)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def bf16_supported(device_type: str) -> bool:
    """Whether ``device_type`` computes in bfloat16 natively (CUDA: Ampere+; x86 CPU: AVX512-BF16/AMX)."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True  # ARM/others: torch picks a bf16 kernel or upcasts; no reliable probe, do not block
    cpu = torch.cpu
    probes = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(p is None for p in probes):
        return True
    return any(p() for p in probes if p is not None)


def available_strategies() -> list[str]:
    """The strategy names this installation can build (the registered engine backends)."""
    return EngineRegistry.backends()


DEFAULT_TIMEOUT_S = 600.0
"""The default collective timeout in seconds (verl's ``nccl_timeout``)."""


@dataclass
class Strategy:
    """An engine backend and the process-group settings of a run.

    Attributes:
        backend: Engine backend name registered with ``EngineRegistry`` (e.g. ``"fsdp2"``).
        engine_overrides: ``EngineConfig`` fields applied to every engine this strategy builds (e.g.
            ``{"zero_stage": 3}`` or ``{"ulysses_sequence_parallel_size": 2}``).
        process_group_backend: ``"gloo"`` / ``"nccl"``; default: nccl on CUDA, gloo on CPU.
        timeout: Collective timeout of the process group: a collective that waits longer fails (the last
            resort against a rank stalled in user code). 600 s, verl's ``nccl_timeout`` default.
    """

    backend: str = "fsdp2"
    engine_overrides: dict[str, Any] = field(default_factory=dict)
    process_group_backend: str | None = None
    timeout: timedelta = field(default_factory=lambda: timedelta(seconds=DEFAULT_TIMEOUT_S))
    topology: Topology | None = field(default=None, init=False, repr=False, compare=False)

    def data_parallel(self, global_rank: int,
                      world_size: int) -> tuple[torch.distributed.ProcessGroup | None, int, int]:
        """``(dp_group, dp_rank, dp_size)`` of the topology.

        Before the topology exists: ``(None, global_rank, world_size)``; a ``None`` group is the whole world.
        """
        topo = self.topology
        if topo is None:
            return None, global_rank, world_size
        return topo.dp_group, topo.dp_rank, topo.dp_size

    def validate(self) -> None:
        """Check the backend exists here and its package is installed.

        Raises:
            ValueError: Unknown backend (the message lists the registered ones), one of verl's backends not
                built here (what it needs, what was measured, what to use), a missing package (the
                message names the extra), or an unknown ``engine_overrides`` key.
        """
        unserved = unserved_backend_message(self.backend)
        if unserved is not None and self.backend not in EngineRegistry.backends():
            raise ValueError(unserved)
        missing = missing_package(self.backend)
        if missing is not None:
            package, extra = missing
            raise ValueError(
                f"strategy {self.backend!r} needs the package {package!r}, which is not installed; install "
                f"it with `pip install 'verl-trainer[{extra}]'` or choose another strategy"
            )
        known = EngineRegistry.backends()
        if self.backend not in known:
            raise ValueError(
                f"unknown strategy {self.backend!r}; registered strategies (engine backends): "
                f"{', '.join(known)}. Register an engine with EngineRegistry.register to add one."
            )
        EngineConfig().replace(**self.engine_overrides)  # unknown keys raise with the valid fields
        if self.process_group_backend not in (None, "gloo", "nccl"):
            raise ValueError(
                f"process_group_backend={self.process_group_backend!r}; choose 'gloo', 'nccl' or None (auto)"
            )

    def dist_backend(self, device_type: str) -> str:
        """The process-group backend for ``device_type`` (explicit setting first)."""
        return self.process_group_backend or ("nccl" if device_type == "cuda" else "gloo")

    def engine_config(self, config: EngineConfig, precision: str, seed: int | None) -> EngineConfig:
        """``config`` with this strategy's overrides, the precision's dtypes and the seed applied.

        Raises:
            ValueError: If ``config`` sets a dtype that contradicts ``precision``.
        """
        default = EngineConfig()
        dtypes = PRECISIONS[precision]
        for name, value in dtypes.items():
            own = getattr(config, name)
            if to_dtype(own) != to_dtype(getattr(default, name)) and to_dtype(own) != to_dtype(value):
                raise ValueError(
                    f"EngineConfig.{name}={own!r} contradicts Trainer(precision={precision!r}), which sets "
                    f"{name}={value!r}; set the precision on the Trainer only"
                )
        overrides: dict[str, Any] = {**dtypes, **self.engine_overrides}
        if seed is not None:
            overrides["seed"] = seed
        return config.replace(**overrides)

    def build_engine(self, spec: EngineSpec, precision: str, seed: int | None) -> BaseEngine:
        """Build (not initialise) the engine ``spec`` describes, on the run's topology once it exists."""
        return self._new_engine(spec, self.engine_config(spec.config, precision, seed))

    def _new_engine(self, spec: EngineSpec, config: EngineConfig) -> BaseEngine:
        return EngineRegistry.new(spec.model_type, self.backend, config, spec.optim, topology=self.topology,
                                  model_factory=spec.model)

    def setup_topology(self, sp_size: int, device_type: str, tp_size: int = 1, pp_size: int = 1) -> Topology:
        """The run's ``(dp, sp)`` / ``(dp, tp)`` meshes, built once per process group (collective).

        Raises:
            ValueError: ``sp_size`` / ``tp_size`` differs from the topology already built, or does not
                divide the world.
        """
        topo = self.topology
        if topo is None or (topo.mesh is not None) != is_initialized():  # none yet, or another group state
            topo = self.topology = build_topology(sp_size, device_type, tp_size, pp_size)
            for mesh in (topo.mesh, topo.shard_mesh):
                if mesh is not None:
                    set_collective_timeout(self.timeout, mesh.get_all_groups())
        check_same_sizes(topo, sp_size, tp_size, pp_size)
        return topo

    def check_mesh_sizes(self, specs: Mapping[str, EngineSpec | BaseEngine], precision: str,
                          seed: int | None) -> None:
        """Before any model loads: every engine spec asks for the same SP, TP and PP sizes (one mesh)."""
        sizes = {name: (c.ulysses_sequence_parallel_size, c.tensor_model_parallel_size,
                        c.pipeline_model_parallel_size)
                 for name, spec in specs.items() if isinstance(spec, EngineSpec)
                 for c in [self.engine_config(spec.config, precision, seed)]}
        if len(set(sizes.values())) > 1:
            listed = ", ".join(f"{name}: sp={sp} tp={tp} pp={pp}" for name, (sp, tp, pp) in sizes.items())
            raise ValueError(
                f"the engines of a run share one mesh but ask for different sizes ({listed}); set the same "
                f"ulysses_sequence_parallel_size, tensor_model_parallel_size and "
                f"pipeline_model_parallel_size on every engine (e.g. "
                f"algorithm.ref.engine.tensor_model_parallel_size as algorithm.actor.engine's)"
            )

    def build_engines(
        self, specs: Mapping[str, EngineSpec | BaseEngine], precision: str, seed: int | None, device_type: str
    ) -> dict[str, BaseEngine]:
        """Build and initialise a module's engines, in order, on one topology (collective).

        The first spec's SP / TP sizes fix the topology (the actor's); an engine the module built itself is
        initialised as it is.

        Raises:
            ValueError: No engines, or engines that disagree on the SP size.
        """
        if not specs:
            raise ValueError("configure_engines() returned no engines; return at least the actor")
        self.check_mesh_sizes(specs, precision, seed)
        engines: dict[str, BaseEngine] = {}
        for name, spec in specs.items():
            if isinstance(spec, EngineSpec):
                config = self.engine_config(spec.config, precision, seed)
                self.setup_topology(config.ulysses_sequence_parallel_size, device_type,
                                    config.tensor_model_parallel_size, config.pipeline_model_parallel_size)
                engine = self._new_engine(spec, config)
            else:
                engine = spec
            engine.initialize()
            if self.topology is None:
                self.topology = engine.topology
            engines[name] = engine
        return engines


def resolve_strategy(strategy: str | Strategy) -> Strategy:
    """A validated :class:`Strategy` from a registry name or a strategy object.

    Raises:
        TypeError: For anything else.
        ValueError: See :meth:`Strategy.validate`.
    """
    if isinstance(strategy, str):
        strategy = Strategy(backend=strategy)
    if not isinstance(strategy, Strategy):
        raise TypeError(
            "strategy must be a registered name (e.g. 'fsdp2') or a verl_trainer.training.strategy.Strategy, "
            f"got {type(strategy).__name__}"
        )
    strategy.validate()
    return strategy
