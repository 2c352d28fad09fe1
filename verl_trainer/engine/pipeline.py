"""Pipeline parallelism part: the stage split, the pipelined schedule of one step, the stage-owned export.

With ``pipeline_model_parallel_size = pp > 1`` the topology is a ``(pp, dp)`` mesh, the model is cut into
``pp`` stages (``engine/pipeline_stage.py``: HF names kept), each sharded by FSDP2 over its dp group. An
engine with ``pp > 1`` holds one :class:`PipelineParallel` (``engine.pipeline``) as its loop's schedule; an
engine with ``pp == 1`` never builds it. Invariants:

* every stage of a dp rank plans the same micro-batches; each is packed and padded to the step's longest
  row ``T``, so the hidden states between stages have one static shape ``[1, T, H]`` per step;
* 1F1B with at least ``pp`` micro-batches, else GPipe (also forward only); ``scale_grads=False``: each
  micro-batch loss is already the global-denominator partial sum (docs/design.md §4);
* outputs and the loss are computed on the last stage with the same ``GlobalBatchInfo``; losses, metrics and
  (forward only) the ``[B, T]`` outputs are broadcast from it, so every rank returns the same result
  (``is_mp_src_rank_with_outputs``: the last stage, verl's choice); ``on_before_backward`` runs there only;
* the grad norm sums the stages' squared norms over the pipeline group; the export yields every tensor on
  every rank under its HF name, in the unsplit model's order.

How it runs: docs/internals.md, "Pipeline parallelism (fsdp2)".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from verl_trainer.data.packing import pack_batch
from verl_trainer.engine.compute import MicroBatchStep, ScheduledEngine, ScheduleResult
from verl_trainer.engine.config import EngineConfig, to_dtype
from verl_trainer.engine.heads import ModelType
from verl_trainer.engine.pipeline_stage import StageForward, check_pipeline_compatible, make_stage, pad_packed
from verl_trainer.engine.topology import Topology
from verl_trainer.models.source import resolve_model_path
from verl_trainer.utils.distributed import all_gather_object, broadcast_object

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

    from verl_trainer.models.attention import ForwardModel

__all__ = ["PipelineParallel", "check_pipeline_model"]


def _meta(shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
    """A shape / dtype placeholder; ``requires_grad`` marks the activations whose gradients are sent."""
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=requires_grad)


def check_pipeline_model(config: EngineConfig, model_type: ModelType) -> None:
    """Before the weights load: refuse a model the stage split cannot run (from its ``config.json``).

    Every rank reads the same config, so every rank raises the same error together.
    """
    from transformers import AutoConfig


    hf_config = AutoConfig.from_pretrained(resolve_model_path(config.model_path))
    check_pipeline_compatible(hf_config, config.pipeline_model_parallel_size,
                              causal_lm=model_type.name == "language_model")


class PipelineParallel:
    """The pipeline part of an engine: this rank's stage, its schedule and the stage-owned export.

    Args:
        topology: The engine's ``(pp, dp)`` topology.
        model: The whole model; cut to this rank's stage in place (a collective over the pipeline group).

    Raises:
        RuntimeError: If a tensor of the unsplit model is owned by no stage.
    """

    def __init__(self, topology: Topology, model: torch.nn.Module) -> None:
        self.topology = topology
        whole = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
        self.stage_forward: StageForward = make_stage(model, topology.pp_rank, topology.pp_size)
        owned: list[list[str]] = all_gather_object(list(model.state_dict()), topology.pp_group)
        owner = {name: stage for stage, names in enumerate(owned) for name in names}
        lost = sorted(set(whole) - set(owner))
        if lost:
            raise RuntimeError(f"pipeline stages own no copy of {lost[:5]} ({len(lost)} tensors)")
        self.full_params = [(name, shape, dtype, owner[name]) for name, (shape, dtype) in whole.items()]
        """``(name, shape, dtype, owner stage)`` of every tensor of the unsplit model, in its order."""

    # ------------------------------------------------------------------------------ the schedule
    def run(self, engine: ScheduledEngine, step: MicroBatchStep) -> ScheduleResult:
        """Run every micro-batch through the stages (forward, and backward unless forward only).

        Returns:
            The last stage's losses (summed) and metrics and (forward only) its outputs ``[B, T]`` in the
            original order, broadcast to every rank of the pipeline group.
        """
        run = _PipelineRun(engine, self, step)
        run.execute()
        local_loss, metrics = run.share_results()
        return local_loss, metrics, run.share_outputs() if step.forward_only else None

    # ------------------------------------------------------------------------------- weight export
    def full_tensors(
        self, module: torch.nn.Module, device: torch.device, keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the whole model under its HF name, on every rank; a collective.

        The owning stage gathers the full tensor over its dp group, then broadcasts it to the pipeline
        group; tensors come one at a time, in the unsplit model's state-dict order.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.distributed.tensor import DTensor

        topo = self.topology
        local = get_model_state_dict(module)
        group = topo.pp_group
        for name, shape, dtype, owner in self.full_params:
            if keep is not None and not keep(name):
                continue
            if owner == topo.pp_rank:
                value = local[name]
                value = value.full_tensor() if isinstance(value, DTensor) else value
                value = value.detach().to(device).contiguous()
            else:
                value = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(value, src=dist.get_global_rank(group, owner), group=group)
            yield name, value


class _PipelineRun:
    """One step of a stage: the padded rows, the torch schedule, the last stage's results."""

    def __init__(self, engine: ScheduledEngine, pipeline: PipelineParallel, step: MicroBatchStep) -> None:
        self.engine = engine
        self.stage_forward = pipeline.stage_forward
        self.step = step
        self.micro_batches = [mb.to(engine.device) for mb in step.micro_batches]
        self.packed = [pack_batch(mb, keys=()) for mb in self.micro_batches]
        self.total = max([1, *(p.num_tokens for p in self.packed)])
        self.padded = [pad_packed(p, self.total) for p in self.packed]
        self.keys = engine.model_type.output_keys(step.calculate_entropy)
        topo = pipeline.topology
        self.stage, self.num_stages, self.group = topo.pp_rank, topo.pp_size, topo.pp_group
        self.last_rank = dist.get_global_rank(self.group, self.num_stages - 1)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    # --------------------------------------------------------------------------- the last stage
    def last_stage(self, run: ForwardModel, index: int) -> tuple[torch.Tensor, ...]:
        """Model outputs ``[1, T]`` of micro-batch ``index`` from the received hidden states."""
        model_type, padded, step = self.engine.model_type, self.padded[index], self.step
        hf_output = model_type.forward_packed(run, padded)
        outputs = model_type.outputs(hf_output, padded, step.calculate_entropy, step.temperature)
        if step.forward_only:
            step.keep(index, self._unpack(index, tuple(outputs[k] for k in self.keys)))
        return tuple(outputs[k].reshape(1, -1).clone() for k in self.keys)  # not views: FSDP hooks them

    def _unpack(self, index: int, values: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        packed = self.packed[index]
        n = packed.num_tokens
        return {key: packed.unpack(value.reshape(-1)[:n]) for key, value in zip(self.keys, values)}

    def loss(self, output: torch.Tensor | tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        """The torch schedule's loss: the step's ``loss_fn(model_output, micro_batch, info)`` (last stage)."""
        index = int(target.reshape(-1)[0])
        values = output if isinstance(output, tuple) else (output,)
        return self.step.loss(self._unpack(index, values), self.micro_batches[index])

    # ------------------------------------------------------------------------------ the schedule
    def _build_stage(self) -> PipelineStage:
        from torch.distributed.pipelining import PipelineStage

        engine, total = self.engine, self.total
        hidden = (1, total, int(engine.model_config.hidden_size))
        hidden_dtype, grads = to_dtype(engine.config.param_dtype), not self.step.forward_only
        inputs = _meta((1, total), torch.long) if self.is_first else _meta(hidden, hidden_dtype, grads)
        if self.is_last:
            outputs: torch.Tensor | tuple[torch.Tensor, ...] = tuple(
                _meta((1, total), torch.float32) for _ in self.keys)
        else:
            outputs = _meta(hidden, hidden_dtype, grads)
        return PipelineStage(engine.module, self.stage, self.num_stages, engine.device, input_args=inputs,
                             output_args=outputs, group=self.group)

    def execute(self) -> None:
        """Run every micro-batch through the stages (forward, and backward unless forward only)."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        forward, step = self.stage_forward, self.step
        forward.batches, forward.last_stage = self.padded, self.last_stage
        count = len(self.micro_batches)
        loss_fn = self.loss if step.loss_function is not None else None
        one_f_one_b = not step.forward_only and count >= self.num_stages
        schedule = (Schedule1F1B if one_f_one_b else ScheduleGPipe)(
            self._build_stage(), count, loss_fn=loss_fn, scale_grads=False)
        device = self.engine.device
        args = (torch.cat([p.input_ids for p in self.padded]).to(device),) if self.is_first else ()
        kwargs = {"mb": torch.arange(count, device=device)}
        target = torch.arange(count, device=device) if self.is_last and loss_fn is not None else None
        try:
            if step.forward_only:
                schedule.eval(*args, target=target, **kwargs)
            else:
                schedule.step(*args, target=target, **kwargs)
        finally:
            forward.batches, forward.last_stage = [], None

    # ------------------------------------------------------------------------- sharing results
    def share_results(self) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """The last stage's summed loss and per-micro-batch metrics, on every rank of the pipeline group."""
        step = self.step
        payload = (float(step.local_loss()), step.metrics) if self.is_last else None
        shared: tuple[float, list[dict[str, Any]]] = broadcast_object(payload, src=self.last_rank,
                                                                     group=self.group)
        return torch.tensor(shared[0], dtype=torch.float64), shared[1]

    def share_outputs(self) -> dict[str, torch.Tensor]:
        """The forward-only outputs ``[B, T]`` in the original order, broadcast from the last stage."""
        step, device = self.step, self.engine.device
        ids = step.data["input_ids"]
        mine = step.model_output() if self.is_last else {}
        shared: dict[str, torch.Tensor] = {}
        for key in self.keys:
            if self.is_last:
                value = mine[key].to(device).float().contiguous()
            else:
                value = torch.empty(tuple(ids.shape), dtype=torch.float32, device=device)
            dist.broadcast(value, src=self.last_rank, group=self.group)
            shared[key] = value.to(step.out_device)
        return shared
