"""Process topology of an engine: the ``(dp, sp)`` or ``(dp, tp)`` device mesh and its groups.

``dp_size = world_size // (ulysses_sequence_parallel_size * tensor_model_parallel_size)``. Ranks of one
SP or TP group hold the same samples, so data-parallel collectives (denominators, the global loss) use the
dp group only. Without TP, parameters are sharded over the whole world (the flattened 1-D ``"fsdp"``
mesh); with TP (``tp > 1``, sp must be 1) the mesh is ``(dp, tp)``, the TP plan shards the projections
over ``tp`` and FSDP shards over ``dp`` (``shard_mesh = mesh["dp"]``, a sub-mesh of the same root, as
FSDP2's 2-D composition requires). TP ranks are adjacent (rank = dp_rank * tp + tp_rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from verl_trainer.engine.config import EngineConfig, check_parallel_sizes
from verl_trainer.utils.distributed import is_initialized


@dataclass
class Topology:
    """Meshes and groups of one engine.

    Attributes:
        world_size: All ranks.
        rank: This process's global rank.
        dp_size: Data-parallel size.
        sp_size: Sequence-parallel (Ulysses) size.
        mesh: ``(dp, sp)`` mesh with dim names ``("dp", "sp")``, or with TP ``(dp, tp)`` named
            ``("dp", "tp")``; ``None`` when not distributed.
        shard_mesh: The 1-D mesh FSDP shards parameters on: all ranks (``"fsdp"``), or ``mesh["dp"]``
            with TP.
        tp_size: Tensor-parallel size (``tensor_model_parallel_size``).

    """

    world_size: int
    rank: int
    dp_size: int
    sp_size: int
    mesh: DeviceMesh | None = None
    shard_mesh: DeviceMesh | None = None
    tp_size: int = 1

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The DP process group, or ``None`` when not distributed."""
        return None if self.mesh is None else self.mesh.get_group("dp")

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        """The SP process group, or ``None`` when not distributed or under TP (which has no SP dim)."""
        return None if self.mesh is None or self.tp_size > 1 else self.mesh.get_group("sp")

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D ``"tp"`` sub-mesh the TP plan shards on (``None`` without TP)."""
        return None if self.mesh is None or self.tp_size == 1 else self.mesh["tp"]

    @property
    def tp_rank(self) -> int:
        """Coordinate of this rank on the tp dimension (0 without TP)."""
        return 0 if self.tp_mesh is None else self.mesh.get_local_rank("tp")  # type: ignore[union-attr]

    @property
    def dp_rank(self) -> int:
        """Coordinate of this rank on the dp dimension."""
        return 0 if self.mesh is None else self.mesh.get_local_rank("dp")

    @property
    def sp_rank(self) -> int:
        """Coordinate of this rank on the sp dimension (0 under TP)."""
        return 0 if self.mesh is None or self.tp_size > 1 else self.mesh.get_local_rank("sp")


def _first_parallel(sp: int, tp: int) -> tuple[str, int]:
    return ("ulysses_sequence_parallel_size", sp) if sp != 1 else ("tensor_model_parallel_size", tp)


def build_topology(sp: int, device_type: str, tp: int = 1) -> Topology:
    """Build the meshes for the current process group (or a single-process topology).

    The Trainer's strategy builds one per run and hands it to every engine it builds; an engine built
    on its own builds its own.

    Args:
        sp: The Ulysses sequence-parallel size.
        device_type: ``"cpu"``, ``"cuda"`` or ``"npu"``.
        tp: The tensor-parallel size.

    Raises:
        ValueError: If the world size is not divisible by ``sp * tp``, or for ``sp > 1`` with ``tp > 1``.

    """
    check_parallel_sizes(sp, tp)
    if not is_initialized():
        if sp != 1 or tp != 1:
            name, size = _first_parallel(sp, tp)
            raise ValueError(
                f"{name}={size} needs an initialised process group with a multiple of {size} ranks; "
                f"start with torchrun or Trainer(devices=...)"
            )
        return Topology(world_size=1, rank=0, dp_size=1, sp_size=1)
    world = dist.get_world_size()
    if world % (sp * tp):
        name, size = _first_parallel(sp, tp)
        raise ValueError(
            f"world_size={world} is not divisible by {name}={size}; choose a size that divides the number "
            f"of ranks"
        )
    dp = world // (sp * tp)
    if tp > 1:
        mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
        return Topology(world, dist.get_rank(), dp, 1, mesh, mesh["dp"], tp_size=tp)
    mesh = init_device_mesh(device_type, (dp, sp), mesh_dim_names=("dp", "sp"))
    shard_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
    return Topology(world, dist.get_rank(), dp, sp, mesh, shard_mesh)


def engine_topology(given: Topology | None, config: EngineConfig, device_type: str) -> Topology:
    """The topology an engine runs on: the one its builder handed over, else a new one of its own.

    Raises:
        ValueError: The handed-over topology's SP or TP size is not the engine config's.
    """
    sp, tp = config.ulysses_sequence_parallel_size, config.tensor_model_parallel_size
    if given is None:
        return build_topology(sp, device_type, tp)
    check_same_sizes(given, sp, tp)
    return given


def check_same_sizes(given: Topology, sp: int, tp: int) -> None:
    """Every engine of a run shares one mesh: refuse an engine whose SP / TP size differs from it.

    Raises:
        ValueError: Naming the size that differs.
    """
    for name, have, want in (("ulysses_sequence_parallel_size", given.sp_size, sp),
                             ("tensor_model_parallel_size", given.tp_size, tp)):
        if have != want:
            raise ValueError(
                f"the run's topology has {name}={have} but an engine asks for {name}={want}; every "
                f"engine of a run shares one mesh: set the same size on all of them"
            )


class TopologyMixin:
    """The engine's topology group, read from ``self.topology`` (set in ``initialize``)."""

    topology: Topology

    def get_data_parallel_size(self) -> int:
        """Return the number of DP ranks (world_size // (sp_size * tp_size))."""
        return self.topology.dp_size

    def get_data_parallel_rank(self) -> int:
        """Return this rank's DP rank."""
        return self.topology.dp_rank

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        """Return the DP process group (``None`` when not distributed)."""
        return self.topology.dp_group

    def is_mp_src_rank_with_outputs(self) -> bool:
        """Only SP / TP rank 0 of each DP group reports outputs (all SP / TP ranks hold the same ones)."""
        return self.topology.sp_rank == 0 and self.topology.tp_rank == 0
