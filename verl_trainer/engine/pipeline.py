"""Pipeline parallelism part: one step of a stage model under a ``torch.distributed.pipelining`` schedule.

With ``pipeline_model_parallel_size = pp > 1`` the engine's topology is a ``(pp, dp)`` mesh, the model is
cut into ``pp`` stages (``engine/pipeline_stage.py``: HF names kept) and every stage is sharded by FSDP2
over its dp group. Every stage of a dp rank holds the same samples and plans the same micro-batches
(the engine's planner, fixed size or dynamic by token budget); :class:`PipelineMixin` then:

1. packs each micro-batch into one row and pads every row of the step to the longest one's token count
   ``T`` (one extra segment that nothing attends to), so the hidden states sent between stages have one
   static shape ``[1, T, H]`` per step: the stage is built with that shape (no shape-inference pass) and
   dynamic micro-batches of any length work;
2. runs the schedule: **1F1B** (at most ``pp`` micro-batches' activations alive on a stage; GPipe keeps
   all of them) when there are at least ``pp`` micro-batches, else GPipe (the same order then); forward
   only: GPipe's forward loop. ``scale_grads=False``: each micro-batch loss is already the partial sum
   over the global denominators (DESIGN §4), so nothing is divided by the micro-batch count;
3. computes the model outputs and the loss on the last stage only, with the same ``GlobalBatchInfo``;
   the losses, metrics and (forward only) the ``[B, T]`` outputs are then broadcast from the last stage
   to the pipeline group, so every rank returns the same result (``is_mp_src_rank_with_outputs`` is the
   last stage, verl's choice);
4. the grad norm sums the stages' squared norms over the pipeline group (``total_grad_norm(sum_over=)``);
   the export gathers each tensor on the stage that owns it and broadcasts it over the pipeline group,
   so every rank yields every tensor under its HF name, in the unsplit model's order.

The per-micro-batch hooks see the last stage only: ``on_before_backward`` runs where the loss exists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.data import schema
from verl_trainer.data.packing import pack_batch
from verl_trainer.engine.batch_info import GlobalBatchInfo
from verl_trainer.engine.config import EngineConfig, to_dtype
from verl_trainer.engine.hooks import NO_HOOKS, StepHooks
from verl_trainer.engine.optim import total_grad_norm
from verl_trainer.engine.pipeline_stage import StageForward, make_stage, pad_packed
from verl_trainer.engine.topology import Topology
from verl_trainer.utils.distributed import all_gather_object, broadcast_object


def _meta(shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
    """A shape / dtype placeholder; ``requires_grad`` marks the activations whose gradients are sent."""
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=requires_grad)


class PipelineMixin:
    """``forward_backward_batch``, grad norm and export of a pipeline stage (active when ``pp > 1``).

    Placed before ``MicroBatchComputeMixin`` / ``OptimizerMixin`` in an engine's bases; with ``pp == 1``
    every method defers to them.
    """

    config: EngineConfig
    topology: Topology
    module: torch.nn.Module | None
    device: torch.device
    model_config: Any
    MODEL_TYPE: str
    stage_forward: StageForward | None = None
    full_params: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []
    """``(name, shape, dtype, owner stage)`` of every tensor of the unsplit model, in its order."""

    @property
    def pipelined(self) -> bool:
        """True when the engine runs pipeline stages (``pipeline_model_parallel_size > 1``)."""
        return getattr(self, "topology", None) is not None and self.topology.pp_size > 1

    def check_pipeline_model(self) -> None:
        """Before the weights load: refuse a model the stage split cannot run (from its ``config.json``).

        Every rank reads the same config, so every rank raises the same error together.
        """
        pp = self.config.pipeline_model_parallel_size
        if pp == 1 or getattr(self, "model_factory", None) is not None:
            return  # a factory's model is checked by make_stage, after it is built
        from transformers import AutoConfig

        from verl_trainer.engine.pipeline_stage import check_pipeline_compatible
        from verl_trainer.models.source import resolve_model_path

        config = AutoConfig.from_pretrained(resolve_model_path(self.config.model_path))
        check_pipeline_compatible(config, pp, causal_lm=self.MODEL_TYPE == "language_model")

    def split_into_stage(self, model: torch.nn.Module) -> None:
        """Cut ``model`` to this rank's stage (before sharding); a collective over the pipeline group."""
        topo = self.topology
        whole = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
        self.stage_forward = make_stage(model, topo.pp_rank, topo.pp_size)
        owned = all_gather_object(list(model.state_dict()), topo.pp_group)
        owner = {name: stage for stage, names in enumerate(owned) for name in names}  # type: ignore[arg-type]
        lost = sorted(set(whole) - set(owner))
        if lost:
            raise RuntimeError(f"pipeline stages own no copy of {lost[:5]} ({len(lost)} tensors)")
        self.full_params = [(name, shape, dtype, owner[name]) for name, (shape, dtype) in whole.items()]

    # ------------------------------------------------------------------------------------ compute
    def forward_backward_batch(
        self,
        data: TensorDict,
        loss_function: Any,
        forward_only: bool = False,
        calculate_entropy: bool = False,
        temperature: float | None = None,
        hooks: StepHooks | None = None,
    ) -> dict[str, Any]:
        """See ``MicroBatchComputeMixin.forward_backward_batch``; under PP the pipelined version."""
        if not self.pipelined:
            return super().forward_backward_batch(  # type: ignore[misc]
                data, loss_function, forward_only, calculate_entropy, temperature, hooks)
        if not getattr(self, "initialized", False):
            raise RuntimeError(f"{type(self).__name__} is not initialized; call engine.initialize() first")
        if loss_function is None and not forward_only:
            raise ValueError("forward_backward_batch needs a loss_function unless forward_only=True")
        temperature = self.config.temperature if temperature is None else temperature
        info: GlobalBatchInfo = self.compute_global_batch_info(data)  # type: ignore[attr-defined]
        micro_batches, batch_idx = self.make_micro_batches(data)  # type: ignore[attr-defined]
        hooks = hooks or NO_HOOKS
        hooks.on_micro_batches(micro_batches)
        micro_batches = [mb.to(self.device) for mb in micro_batches]
        run = _PipelineStep(self, micro_batches, info, loss_function, forward_only, calculate_entropy,
                            temperature, hooks)
        run.execute()
        losses, metrics = run.share_results()
        local_loss = torch.tensor(sum(losses), dtype=torch.float64) if losses else torch.zeros(
            (), dtype=torch.float64)
        result: dict[str, Any] = {
            "local_loss": float(local_loss),
            "loss": self._global_loss(local_loss),  # type: ignore[attr-defined]
            "metrics": metrics,
            "num_micro_batches": len(micro_batches),
        }
        if forward_only:
            result["model_output"] = run.share_outputs(data, batch_idx)
        return result

    def output_keys(self, calculate_entropy: bool) -> tuple[str, ...]:
        """The model outputs the last stage produces, in the order it sends them."""
        if self.MODEL_TYPE == "value_model":
            return ("values",)
        return ("log_probs", "entropy") if calculate_entropy else ("log_probs",)

    # ----------------------------------------------------------------------------------- optimizer
    def _clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """The norm over every stage's gradients (squared norms summed over the pipeline group)."""
        if not self.pipelined:
            return super()._clip_grad_norm(max_norm)  # type: ignore[misc]
        assert self.module is not None
        return total_grad_norm(self.module.parameters(), max_norm, sum_over=self.topology.pp_group)

    # ------------------------------------------------------------------------------- weight export
    def pipeline_full_tensors(
        self, keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the whole model under its HF name, on every rank; a collective.

        The owning stage gathers the full tensor over its dp group, then broadcasts it to the pipeline
        group; tensors come one at a time, in the unsplit model's state-dict order.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.distributed.tensor import DTensor

        topo = self.topology
        local = get_model_state_dict(self.module)
        group = topo.pp_group
        for name, shape, dtype, owner in self.full_params:
            if keep is not None and not keep(name):
                continue
            if owner == topo.pp_rank:
                value = local[name]
                value = value.full_tensor() if isinstance(value, DTensor) else value
                value = value.detach().to(self.device).contiguous()
            else:
                value = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(value, src=dist.get_global_rank(group, owner), group=group)
            yield name, value


class _PipelineStep:
    """One ``forward_backward_batch`` of a stage: the padded rows, the schedule, the last stage's results."""

    def __init__(self, engine: PipelineMixin, micro_batches: list[TensorDict], info: GlobalBatchInfo,
                 loss_function: Any, forward_only: bool, calculate_entropy: bool, temperature: float,
                 hooks: StepHooks) -> None:
        self.engine = engine
        self.micro_batches = micro_batches
        self.info = info
        self.loss_function = loss_function
        self.forward_only = forward_only
        self.calculate_entropy = calculate_entropy
        self.temperature = temperature
        self.hooks = hooks
        self.packed = [pack_batch(mb, keys=()) for mb in micro_batches]
        self.total = max([1, *(p.num_tokens for p in self.packed)])
        self.padded = [pad_packed(p, self.total) for p in self.packed]
        self.keys = engine.output_keys(calculate_entropy)
        self.losses: list[float] = []
        self.metrics: list[dict[str, Any]] = []
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}
        topo = engine.topology
        self.stage, self.num_stages, self.group = topo.pp_rank, topo.pp_size, topo.pp_group
        self.last_rank = dist.get_global_rank(self.group, self.num_stages - 1)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    # --------------------------------------------------------------------------- the last stage
    def last_stage(self, run: Callable[..., Any], index: int) -> tuple[torch.Tensor, ...]:
        """Model outputs ``[1, T]`` of micro-batch ``index`` from the received hidden states."""
        engine, padded = self.engine, self.padded[index]
        hf_output = engine._forward_packed(padded, model=run)  # type: ignore[attr-defined]
        outputs = engine.compute_packed_outputs(  # type: ignore[attr-defined]
            hf_output, padded, self.calculate_entropy, self.temperature)
        if self.forward_only:
            self.outputs[index] = self._unpack(index, tuple(outputs[k] for k in self.keys), detach=True)
        return tuple(outputs[k].reshape(1, -1).clone() for k in self.keys)  # not views: FSDP hooks them

    def _unpack(self, index: int, values: tuple[torch.Tensor, ...], detach: bool = False
                ) -> dict[str, torch.Tensor]:
        packed = self.packed[index]
        out = {}
        for key, value in zip(self.keys, values):
            value = value.reshape(-1)[: packed.num_tokens]
            out[key] = packed.unpack(value.detach() if detach else value)
        return out

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: the engine's ``loss_fn(model_output, micro_batch, info)`` (last stage)."""
        index = int(target.reshape(-1)[0])
        values = output if isinstance(output, tuple) else (output,)
        loss, metrics = self.loss_function(self._unpack(index, values), self.micro_batches[index], self.info)
        if not self.forward_only:
            self.hooks.on_before_backward(loss)
        self.losses.append(float(loss.detach().to(torch.float64)))
        self.metrics.append(dict(metrics or {}))
        return loss

    # ------------------------------------------------------------------------------ the schedule
    def _build_stage(self) -> Any:
        from torch.distributed.pipelining import PipelineStage

        engine, total = self.engine, self.total
        hidden = (1, total, int(engine.model_config.hidden_size))
        hidden_dtype, grads = to_dtype(engine.config.param_dtype), not self.forward_only
        inputs = _meta((1, total), torch.long) if self.is_first else _meta(hidden, hidden_dtype, grads)
        if self.is_last:
            outputs: Any = tuple(_meta((1, total), torch.float32) for _ in self.keys)
        else:
            outputs = _meta(hidden, hidden_dtype, grads)
        return PipelineStage(engine.module, self.stage, self.num_stages, engine.device, input_args=inputs,
                             output_args=outputs, group=self.group)

    def execute(self) -> None:
        """Run every micro-batch through the stages (forward, and backward unless forward only)."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        engine = self.engine
        forward = engine.stage_forward
        assert forward is not None
        forward.batches, forward.last_stage = self.padded, self.last_stage
        count = len(self.micro_batches)
        loss_fn = self.loss if self.loss_function is not None else None
        one_f_one_b = not self.forward_only and count >= self.num_stages
        schedule = (Schedule1F1B if one_f_one_b else ScheduleGPipe)(
            self._build_stage(), count, loss_fn=loss_fn, scale_grads=False)
        device = engine.device
        args = (torch.cat([p.input_ids for p in self.padded]).to(device),) if self.is_first else ()
        kwargs = {"mb": torch.arange(count, device=device)}
        target = torch.arange(count, device=device) if self.is_last and loss_fn is not None else None
        try:
            if self.forward_only:
                schedule.eval(*args, target=target, **kwargs)
            else:
                schedule.step(*args, target=target, **kwargs)
        finally:
            forward.batches, forward.last_stage = [], None

    # ------------------------------------------------------------------------- sharing results
    def share_results(self) -> tuple[list[float], list[dict[str, Any]]]:
        """The last stage's per-micro-batch losses and metrics, on every rank of the pipeline group."""
        payload = (self.losses, self.metrics) if self.is_last else None
        losses, metrics = broadcast_object(payload, src=self.last_rank, group=self.group)  # type: ignore[misc]
        return losses, metrics

    def share_outputs(self, data: TensorDict, batch_idx: list[int] | None) -> dict[str, torch.Tensor]:
        """The forward-only outputs ``[B, T]`` in the original order, broadcast from the last stage."""
        from verl_trainer.engine.compute import _pad_width, _restore

        width = data[schema.INPUT_IDS].shape[1]
        rows = data[schema.INPUT_IDS].shape[0]
        out_device = data.device if data.device is not None else torch.device("cpu")
        shared: dict[str, torch.Tensor] = {}
        for key in self.keys:
            if self.is_last:
                parts = [_pad_width(self.outputs[i][key], width) for i in range(len(self.micro_batches))]
                value = _restore(torch.cat(parts), batch_idx).to(self.engine.device).float().contiguous()
            else:
                value = torch.empty((rows, width), dtype=torch.float32, device=self.engine.device)
            dist.broadcast(value, src=self.last_rank, group=self.group)
            shared[key] = value.to(out_device)
        return shared
