"""Process topology of an engine: the ``(dp, sp)`` device mesh and its groups.

``dp_size = world_size // ulysses_sequence_parallel_size``. Ranks of one SP group hold the same samples,
so data-parallel collectives (denominators, the global loss) use the dp group only; parameters are
sharded over the whole world (the flattened mesh).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from verl_trainer.engine.config import EngineConfig
from verl_trainer.utils.distributed import is_initialized


@dataclass
class Topology:
    """Meshes and groups of one engine.

    Attributes:
        world_size: All ranks.
        rank: This process's global rank.
        dp_size: Data-parallel size.
        sp_size: Sequence-parallel (Ulysses) size.
        mesh: ``(dp, sp)`` mesh with dim names ``("dp", "sp")``; ``None`` when not distributed.
        shard_mesh: 1-D mesh over all ranks (``"fsdp"``) that parameters are sharded on.

    """

    world_size: int
    rank: int
    dp_size: int
    sp_size: int
    mesh: DeviceMesh | None = None
    shard_mesh: DeviceMesh | None = None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The DP process group, or ``None`` when not distributed."""
        return None if self.mesh is None else self.mesh.get_group("dp")

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        """The SP process group, or ``None`` when not distributed."""
        return None if self.mesh is None else self.mesh.get_group("sp")

    @property
    def dp_rank(self) -> int:
        """Coordinate of this rank on the dp dimension."""
        return 0 if self.mesh is None else self.mesh.get_local_rank("dp")

    @property
    def sp_rank(self) -> int:
        """Coordinate of this rank on the sp dimension."""
        return 0 if self.mesh is None else self.mesh.get_local_rank("sp")


def build_topology(sp: int, device_type: str) -> Topology:
    """Build the meshes for the current process group (or a single-process topology).

    The Trainer's strategy builds one per run and hands it to every engine it builds; an engine built
    on its own builds its own.

    Args:
        sp: The Ulysses sequence-parallel size.
        device_type: ``"cpu"``, ``"cuda"`` or ``"npu"``.

    Raises:
        ValueError: If the world size is not divisible by the SP size.

    """
    if not is_initialized():
        if sp != 1:
            raise ValueError(
                f"ulysses_sequence_parallel_size={sp} needs an initialised process group with a "
                f"multiple of {sp} ranks; start with torchrun or Trainer(devices=...)"
            )
        return Topology(world_size=1, rank=0, dp_size=1, sp_size=1)
    world = dist.get_world_size()
    if world % sp:
        raise ValueError(
            f"world_size={world} is not divisible by ulysses_sequence_parallel_size={sp}; "
            f"choose an SP size that divides the number of ranks"
        )
    dp = world // sp
    mesh = init_device_mesh(device_type, (dp, sp), mesh_dim_names=("dp", "sp"))
    shard_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
    return Topology(world, dist.get_rank(), dp, sp, mesh, shard_mesh)


def engine_topology(given: Topology | None, config: EngineConfig, device_type: str) -> Topology:
    """The topology an engine runs on: the one its builder handed over, else a new one of its own.

    Raises:
        ValueError: The handed-over topology's SP size is not the engine config's.
    """
    sp = config.ulysses_sequence_parallel_size
    if given is None:
        return build_topology(sp, device_type)
    if given.sp_size != sp:
        raise ValueError(
            f"the run's topology has sp={given.sp_size} but this engine's ulysses_sequence_parallel_size="
            f"{sp}; every engine of a run shares one (dp, sp) mesh: set the same SP size on all of them"
        )
    return given


class TopologyMixin:
    """The engine's topology group, read from ``self.topology`` (set in ``initialize``)."""

    topology: Topology

    def get_data_parallel_size(self) -> int:
        """Return the number of DP ranks (world_size // sp_size)."""
        return self.topology.dp_size

    def get_data_parallel_rank(self) -> int:
        """Return this rank's DP rank."""
        return self.topology.dp_rank

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        """Return the DP process group (``None`` when not distributed)."""
        return self.topology.dp_group

    def is_mp_src_rank_with_outputs(self) -> bool:
        """Only SP rank 0 of each DP group reports outputs (all SP ranks hold the same ones)."""
        return self.topology.sp_rank == 0
