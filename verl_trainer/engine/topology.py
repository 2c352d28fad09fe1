"""Process topology of an engine: the ``(dp, sp)``, ``(dp, tp)`` or ``(pp, dp)`` device mesh and its groups.

``dp_size = world_size // (sp * tp * pp)`` (the ulysses / tensor / pipeline model-parallel sizes; at most
one of them is above 1). Ranks of one SP, TP or PP group hold the same samples, so data-parallel
collectives (denominators, the global loss) use the dp group only. Without TP / PP, parameters are
sharded over the whole world (the flattened 1-D ``"fsdp"`` mesh); with TP (``tp > 1``, sp must be 1)
the mesh is ``(dp, tp)``, the TP plan shards the projections over ``tp`` and FSDP shards over ``dp``
(``shard_mesh = mesh["dp"]``, a sub-mesh of the same root, as FSDP2's 2-D composition requires). TP
ranks are adjacent (rank = dp_rank * tp + tp_rank). With PP (``pp > 1``) the mesh is ``(pp, dp)``: each
pipeline stage is a dp group sharded by FSDP over ``mesh["dp"]``, and the stages of one dp rank are
``dp`` ranks apart (rank = pp_rank * dp + dp_rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from verl_trainer.engine.config import EngineConfig, check_parallel_sizes
from verl_trainer.utils.distributed import is_initialized


@dataclass
class Topology:
    """Meshes and groups of one engine.

    The groups and coordinates are read off the mesh once, at construction, and kept as plain
    attributes (a step reads them many times).

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
        pp_size: Pipeline-parallel size (``pipeline_model_parallel_size``): the mesh is ``(pp, dp)``.
        dp_group: The DP process group, or ``None`` when not distributed.
        sp_group: The SP process group, or ``None`` when not distributed or under TP / PP (no SP dim).
        pp_group: The pipeline group (this dp rank's stages, in stage order), or ``None`` without PP.
        tp_mesh: The 1-D ``"tp"`` sub-mesh the TP plan shards on (``None`` without TP).
        dp_rank: Coordinate of this rank on the dp dimension.
        sp_rank: Coordinate of this rank on the sp dimension (0 under TP / PP).
        tp_rank: Coordinate of this rank on the tp dimension (0 without TP).
        pp_rank: This rank's pipeline stage (0 without PP).

    """

    world_size: int
    rank: int
    dp_size: int
    sp_size: int
    mesh: DeviceMesh | None = None
    shard_mesh: DeviceMesh | None = None
    tp_size: int = 1
    pp_size: int = 1
    dp_group: dist.ProcessGroup | None = field(init=False, default=None)
    sp_group: dist.ProcessGroup | None = field(init=False, default=None)
    pp_group: dist.ProcessGroup | None = field(init=False, default=None)
    tp_mesh: DeviceMesh | None = field(init=False, default=None)
    dp_rank: int = field(init=False, default=0)
    sp_rank: int = field(init=False, default=0)
    tp_rank: int = field(init=False, default=0)
    pp_rank: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        mesh = self.mesh
        names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
        for dim in ("dp", "sp", "pp"):
            if dim in names:
                setattr(self, f"{dim}_group", mesh.get_group(dim))
                setattr(self, f"{dim}_rank", mesh.get_local_rank(dim))
        if mesh is not None and self.tp_size > 1:
            self.tp_mesh = mesh["tp"]
            self.tp_rank = mesh.get_local_rank("tp")

    @property
    def reports_outputs(self) -> bool:
        """One rank per DP rank reports outputs: SP / TP rank 0, and under PP the last stage (verl's choice).

        Every SP / TP / PP rank of a DP rank returns the same outputs (PP broadcasts the last stage's).
        """
        return self.sp_rank == 0 and self.tp_rank == 0 and self.pp_rank == self.pp_size - 1


def _first_parallel(sp: int, tp: int, pp: int = 1) -> tuple[str, int]:
    if sp != 1:
        return "ulysses_sequence_parallel_size", sp
    return ("tensor_model_parallel_size", tp) if tp != 1 else ("pipeline_model_parallel_size", pp)


def build_topology(sp: int, device_type: str, tp: int = 1, pp: int = 1) -> Topology:
    """Build the meshes for the current process group (or a single-process topology).

    The Trainer's strategy builds one per run and hands it to every engine it builds; an engine built
    on its own builds its own.

    Args:
        sp: The Ulysses sequence-parallel size.
        device_type: ``"cpu"``, ``"cuda"`` or ``"npu"``.
        tp: The tensor-parallel size.
        pp: The pipeline-parallel size.

    Raises:
        ValueError: If the world size is not divisible by ``sp * tp * pp``, or for more than one of them
            above 1.

    """
    check_parallel_sizes(sp, tp, pp)
    if not is_initialized():
        if sp != 1 or tp != 1 or pp != 1:
            name, size = _first_parallel(sp, tp, pp)
            raise ValueError(
                f"{name}={size} needs an initialised process group with a multiple of {size} ranks; "
                f"start with torchrun or Trainer(devices=...)"
            )
        return Topology(world_size=1, rank=0, dp_size=1, sp_size=1)
    world = dist.get_world_size()
    if world % (sp * tp * pp):
        name, size = _first_parallel(sp, tp, pp)
        raise ValueError(
            f"world_size={world} is not divisible by {name}={size}; choose a size that divides the number "
            f"of ranks"
        )
    dp = world // (sp * tp * pp)
    if pp > 1:
        mesh = init_device_mesh(device_type, (pp, dp), mesh_dim_names=("pp", "dp"))
        return Topology(world, dist.get_rank(), dp, 1, mesh, mesh["dp"], pp_size=pp)
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
    pp = config.pipeline_model_parallel_size
    if given is None:
        return build_topology(sp, device_type, tp, pp)
    check_same_sizes(given, sp, tp, pp)
    return given


def check_same_sizes(given: Topology, sp: int, tp: int, pp: int = 1) -> None:
    """Every engine of a run shares one mesh: refuse an engine whose SP / TP / PP size differs from it.

    Raises:
        ValueError: Naming the size that differs.
    """
    for name, have, want in (("ulysses_sequence_parallel_size", given.sp_size, sp),
                             ("tensor_model_parallel_size", given.tp_size, tp),
                             ("pipeline_model_parallel_size", given.pp_size, pp)):
        if have != want:
            raise ValueError(
                f"the run's topology has {name}={have} but an engine asks for {name}={want}; every "
                f"engine of a run shares one mesh: set the same size on all of them"
            )

