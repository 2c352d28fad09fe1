"""Typed configs of the engine layer: :class:`OptimConfig`, :class:`EngineConfig` and :class:`EngineSpec`.

Every field is validated in ``__post_init__``; a bad value raises ``ValueError`` that shows the value,
the valid choices and the fix. ``replace(**overrides)`` returns a validated copy (the registry uses it to
apply the preset arguments of aliases such as ``deepspeed_stage_3``); an unknown key is an error.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from verl_trainer.engine.optimizers import DEFAULT_IMPL, optimizer_kwargs, resolve_optimizer
from verl_trainer.models.hf_files import DTYPES as DTYPES  # re-exported: the recipes' configs read it here
from verl_trainer.models.hf_files import MODEL_TYPES, to_dtype
from verl_trainer.models.moe_config import MoEConfig
from verl_trainer.models.vlm import check_vlm_settings, directory_is_vision_language

if TYPE_CHECKING:
    from typing_extensions import Self

LR_SCHEDULERS = ("constant", "cosine", "linear")
DECAYING_SCHEDULERS = ("cosine", "linear")


class _Validated:
    """Mixin: ``replace`` with a clear error for unknown keys."""

    def replace(self, **overrides: Any) -> Self:
        """Return a validated copy with ``overrides`` applied.

        Raises:
            ValueError: If a key is not a field of this config.

        """
        names = {f.name for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(
                f"unknown {type(self).__name__} field(s) {unknown}; valid fields: {sorted(names)}"
            )
        return dataclasses.replace(self, **overrides)  # type: ignore[type-var]

    def to_dict(self) -> dict[str, Any]:
        """Return the config as plain data (for logs and checkpoints)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_parallel_sizes(sp: int, tp: int, pp: int = 1) -> None:
    """Refuse a combination of model-parallel sizes this project does not build (same on every rank).

    Raises:
        ValueError: ``tp > 1`` together with ``sp > 1`` (a ``(dp, sp, tp)`` mesh is not supported yet), or
            ``pp > 1`` together with ``sp > 1`` or ``tp > 1`` (only the ``(pp, dp)`` mesh is built).
    """
    _check(
        tp == 1 or sp == 1,
        f"tensor_model_parallel_size={tp} with ulysses_sequence_parallel_size={sp} is not supported "
        f"(a (dp, sp, tp) mesh is not built yet); set one of them to 1",
    )
    for name, size in (("ulysses_sequence_parallel_size", sp), ("tensor_model_parallel_size", tp)):
        _check(
            pp == 1 or size == 1,
            f"pipeline_model_parallel_size={pp} with {name}={size} is not supported (only the (pp, dp) "
            f"mesh is built: pipeline stages with FSDP over dp); set {name}=1, or "
            f"pipeline_model_parallel_size=1 to use {name.split('_model')[0].split('_sequence')[0]} "
            f"parallelism",
        )


RUN_LENGTH = -1
"""``OptimConfig.total_training_steps`` value meaning "the run's length, set before the engine is built"."""


@dataclass
class OptimConfig(_Validated):
    """Optimizer (AdamW by default) + learning-rate schedule + gradient clipping.

    Attributes:
        optimizer: The optimizer class (verl's ``optim.optimizer``): ``"adamw"`` (default), ``"adam"``,
            ``"sgd"`` (any case), another ``torch.optim`` class by name, or ``"module:Class"`` /
            ``"file.py:Class"`` (``engine/optimizers.py``). An unknown name raises, listing the valid ones.
        optimizer_impl: verl's ``optim.optimizer_impl``: the module a class name is taken from
            (``"torch.optim"``: the registered names, then ``torch.optim``).
        override_optimizer_config: verl's key: more keyword arguments of the optimizer (``momentum``,
            ``nesterov``, ``amsgrad``, ...), applied over ``lr`` / ``betas`` / ``eps`` / ``weight_decay``.
        lr: Peak learning rate.
        betas: Adam-family betas (passed to classes that take ``betas``).
        weight_decay: Weight decay (AdamW's decoupled; applied to every parameter, as verl does).
        eps: Adam-family epsilon (passed to classes that take ``eps``).
        clip_grad: Max total grad norm; ``None`` or ``<= 0`` disables clipping (the norm is still
            computed and a non-finite norm still skips the step).
        lr_scheduler: ``"constant"`` (after warmup), ``"cosine"`` (warmup then cosine decay to
            ``min_lr_ratio * lr`` at ``total_training_steps``) or ``"linear"`` (HF's default: warmup then
            linear decay to ``min_lr_ratio * lr``, 0 by default, at ``total_training_steps``).
        warmup_steps: Linear warmup steps; step ``s < warmup_steps`` uses ``lr * (s + 1) / warmup_steps``.
        total_training_steps: Optimizer steps of the whole run (required by ``"cosine"`` and
            ``"linear"``). ``-1`` (verl's "set by the program"): the recipe sets it to the run's length
            before the engine is built (``recipes/common.py``: ``max_steps``, or ``max_epochs`` × steps per
            epoch); an engine built with ``-1`` and a decaying schedule raises.
        min_lr_ratio: Final lr of the cosine / linear schedule as a fraction of ``lr``.

    """

    optimizer: str = "adamw"
    optimizer_impl: str = DEFAULT_IMPL
    override_optimizer_config: dict[str, Any] = field(default_factory=dict)
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    eps: float = 1e-8
    clip_grad: float | None = 1.0
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0
    total_training_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # type: ignore[assignment]  # YAML gives lists
        self.override_optimizer_config = dict(self.override_optimizer_config or {})  # verl's null: none
        _check(self.lr >= 0, f"OptimConfig.lr must be >= 0, got {self.lr}")
        _check(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            f"OptimConfig.betas must be two numbers in [0, 1), got {self.betas}",
        )
        _check(self.weight_decay >= 0, f"OptimConfig.weight_decay must be >= 0, got {self.weight_decay}")
        _check(self.eps > 0, f"OptimConfig.eps must be > 0, got {self.eps}")
        _check(
            self.lr_scheduler in LR_SCHEDULERS,
            f"OptimConfig.lr_scheduler={self.lr_scheduler!r}; choose one of {LR_SCHEDULERS}",
        )
        _check(self.warmup_steps >= 0, f"OptimConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(
            0.0 <= self.min_lr_ratio <= 1.0,
            f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}",
        )
        if self.lr_scheduler in DECAYING_SCHEDULERS and self.total_training_steps != RUN_LENGTH:
            _check(
                self.total_training_steps is not None and self.total_training_steps > self.warmup_steps,
                f"lr_scheduler={self.lr_scheduler!r} needs total_training_steps > warmup_steps "
                f"(got total_training_steps={self.total_training_steps}, "
                f"warmup_steps={self.warmup_steps}); set OptimConfig.total_training_steps to the number "
                f"of optimizer steps of the run (the recipes' configs set it to trainer.max_steps: give "
                f"trainer.max_steps > {self.warmup_steps}, or lower warmup_steps), or use "
                f"lr_scheduler='constant'",
            )
        cls = resolve_optimizer(self.optimizer, self.optimizer_impl)  # an unknown name fails here, early
        self._check_optimizer_kwargs(cls)

    def _check_optimizer_kwargs(self, cls: type[torch.optim.Optimizer]) -> None:
        """Build ``cls`` over one tensor: a keyword it does not take or a bad value fails here, early."""
        kwargs = optimizer_kwargs(cls, self)
        try:
            cls([torch.zeros(1, requires_grad=True)], **kwargs)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"optim.optimizer={self.optimizer!r} ({cls.__module__}.{cls.__qualname__}) refuses its "
                f"arguments {kwargs}: {err}; fix optim.override_optimizer_config (or lr / betas / eps / "
                f"weight_decay)"
            ) from None


@dataclass
class EngineConfig(_Validated):
    """What an engine builds and how it runs (model, parallelism, micro-batching, offload, precision).

    Attributes:
        model_path: Directory of a HF model (``from_pretrained``).
        micro_batch_size_per_gpu: Samples per micro-batch in fixed mode.
        use_dynamic_bsz: Plan micro-batches by a token budget instead of a fixed sample count.
        max_token_len_per_gpu: Token budget per micro-batch in dynamic mode (× sp size); required with
            ``use_dynamic_bsz``: a memory bound, no default (``docs/architecture.md``).
        ulysses_sequence_parallel_size: SP degree; the device mesh is ``(dp, sp)`` with
            ``dp = world_size // sp``; DP collectives and denominators use the dp group only.
        tensor_model_parallel_size: TP degree (verl / Megatron's name; fsdp2 only): the mesh is
            ``(dp, tp)`` with ``dp = world_size // tp``; the attention and MLP projections are split
            column- / row-wise over ``tp`` (``engine/tensor_parallel.py``), untied embeddings and the LM
            head over the vocabulary, and FSDP shards over ``dp``.
            Not combinable with ``ulysses_sequence_parallel_size > 1`` or LoRA yet.
        pipeline_model_parallel_size: PP degree (Megatron's name; fsdp2 only): the mesh is ``(pp, dp)``
            with ``dp = world_size // pp``; the decoder layers are split into ``pp`` contiguous stages
            run by a ``torch.distributed.pipelining`` schedule (``engine/pipeline.py``), FSDP shards
            each stage over ``dp``. Not combinable with sp, tp, LoRA, offload or gradient checkpointing.
        expert_model_parallel_size: EP degree (Megatron's name; the library backends only, for a
            mixture-of-experts model): each MoE layer's experts are split over ``ep`` ranks of the
            data-parallel group, tokens reach their experts by all-to-all; dp is unchanged
            (docs/torchtitan.md, docs/megatron.md).
        param_offload: Keep parameters (and their gradients) on CPU between phases; the mode
            contexts load them onto the device on enter and offload them again on exit.
        optimizer_offload: Keep optimizer state on CPU between train phases.
        param_dtype: Compute dtype of parameters (mixed precision).
        reduce_dtype: Dtype of gradient reduction.
        model_dtype: Dtype the (master) weights are loaded and kept in.
        seed: Seed set on every rank before the model is built.
        reshard_after_forward: FSDP: free gathered params after forward (ZeRO-3 style).
        fsdp_cpu_offload: FSDP's own CPU offload (``CPUOffloadPolicy`` / ``CPUOffload``).
        wrap_modules: Class names wrapped/sharded one by one; default: the model's
            ``_no_split_modules`` (its decoder layer).
        enable_gradient_checkpointing: Recompute activations in backward.
        zero_stage: DeepSpeed ZeRO stage (1, 2 or 3).
        deepspeed_config: Extra raw DeepSpeed config merged over the generated one.
        temperature: Logits are divided by it before log-probs / entropy (the rollout temperature).
        strategy_kwargs: Extra backend-specific options (free-form, for plug-in backends).
        lora_rank: LoRA rank; ``0`` trains the full model. With ``> 0`` the model gets peft LoRA
            adapters before sharding and only they (and a value model's head) are trained
            (``engine/lora.py``).
        lora_alpha: LoRA scaling numerator (the update is ``lora_alpha / lora_rank · B·A``).
        target_modules: ``"all-linear"`` (every linear layer but the output head) or a list of module
            names, e.g. ``["q_proj", "v_proj"]``.
        target_parameters: Parameters to adapt that no linear layer holds (peft's ``target_parameters``),
            e.g. a MoE model's fused experts ``["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``
            (name suffixes); ``null``: none beyond what ``target_modules`` selects (docs/moe.md, LoRA).
        lora_dropout: Dropout on the adapters' input.
        lora_adapter_path: A saved peft adapter directory (``adapter_config.json`` +
            ``adapter_model.safetensors``) to start from; its own rank, alpha and targets apply.
        moe: Mixture-of-experts router losses, metrics and replay (``models/moe_config.py``,
            docs/moe.md); ignored by a dense model.
        freeze_vision_tower: A vision-language model's vision tower is not trained (``requires_grad``
            off before sharding; docs/vlm.md). ``True`` on a text-only checkpoint is refused here; with
            LoRA the tower is frozen anyway (the adapters go on the language model only).

    """

    model_path: str = ""
    micro_batch_size_per_gpu: int = 1
    use_dynamic_bsz: bool = False
    max_token_len_per_gpu: int | None = None
    ulysses_sequence_parallel_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    param_offload: bool = False
    optimizer_offload: bool = False
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    model_dtype: str = "float32"
    seed: int = 42
    reshard_after_forward: bool = True
    fsdp_cpu_offload: bool = False
    wrap_modules: list[str] | None = None
    enable_gradient_checkpointing: bool = False
    zero_stage: int = 2
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    temperature: float = 1.0
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    lora_rank: int = 0
    lora_alpha: float = 16
    target_modules: Any = "all-linear"  # "all-linear" or list[str] (OmegaConf has no str | list union)
    target_parameters: Any = None  # null or list[str] (peft's target_parameters)
    lora_dropout: float = 0.0
    lora_adapter_path: str | None = None
    moe: MoEConfig = field(default_factory=MoEConfig)
    freeze_vision_tower: bool = False

    def __post_init__(self) -> None:
        self._check_lora()
        check_vlm_settings(self.model_path, directory_is_vision_language(self.model_path),
                           self.ulysses_sequence_parallel_size, self.freeze_vision_tower,
                           self.tensor_model_parallel_size, self.pipeline_model_parallel_size)
        _check(
            self.micro_batch_size_per_gpu >= 1,
            f"EngineConfig.micro_batch_size_per_gpu must be >= 1, got {self.micro_batch_size_per_gpu}",
        )
        if self.use_dynamic_bsz:
            budget = self.max_token_len_per_gpu
            _check(
                isinstance(budget, numbers.Integral) and not isinstance(budget, bool) and budget > 0,
                f"use_dynamic_bsz=True needs max_token_len_per_gpu > 0 (an integer number of tokens), got "
                f"{budget!r}; set EngineConfig.max_token_len_per_gpu to the most tokens one micro-batch may "
                f"hold on this device, at least the longest sample (e.g. 4096). There is no default or "
                f"'auto': it is a memory bound, and no budget measured clearly faster on CPU "
                f"(bench/token_budget.py, docs/architecture.md)",
            )
        _check(
            self.ulysses_sequence_parallel_size >= 1,
            f"EngineConfig.ulysses_sequence_parallel_size must be >= 1, got "
            f"{self.ulysses_sequence_parallel_size}",
        )
        self._check_model_parallel()
        for name in ("param_dtype", "reduce_dtype", "model_dtype"):
            try:
                to_dtype(getattr(self, name))
            except ValueError as e:
                raise ValueError(f"EngineConfig.{name}: {e}") from None
        _check(
            self.tensor_model_parallel_size == 1 or to_dtype(self.param_dtype) != torch.float16,
            f"float16 compute (precision='16-mixed', param_dtype={self.param_dtype!r}) with "
            f"tensor_model_parallel_size={self.tensor_model_parallel_size} is not supported yet (the loss "
            f"scaler's overflow check would not span the (dp, tp) mesh); use precision='bf16-mixed' or "
            f"tensor_model_parallel_size=1",
        )
        _check(
            self.zero_stage in (1, 2, 3),
            f"EngineConfig.zero_stage must be 1, 2 or 3, got {self.zero_stage}",
        )
        _check(self.temperature > 0, f"EngineConfig.temperature must be > 0, got {self.temperature}")

    def _check_model_parallel(self) -> None:
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        _check(
            isinstance(tp, int) and tp >= 1,
            f"EngineConfig.tensor_model_parallel_size must be an int >= 1 (1 = off), got {tp!r}",
        )
        _check(
            isinstance(pp, int) and pp >= 1,
            f"EngineConfig.pipeline_model_parallel_size must be an int >= 1 (1 = off), got {pp!r}",
        )
        ep = self.expert_model_parallel_size
        _check(
            isinstance(ep, int) and not isinstance(ep, bool) and ep >= 1,
            f"EngineConfig.expert_model_parallel_size must be an int >= 1 (1 = off), got {ep!r}",
        )
        check_parallel_sizes(self.ulysses_sequence_parallel_size, tp, pp)
        if pp > 1:
            for name, value, off in (
                ("LoRA (lora_rank / lora_adapter_path)", self.lora_enabled, "lora_rank=0"),
                ("param_offload", self.param_offload, "param_offload=False"),
                ("optimizer_offload", self.optimizer_offload, "optimizer_offload=False"),
                ("fsdp_cpu_offload", self.fsdp_cpu_offload, "fsdp_cpu_offload=False"),
                ("enable_gradient_checkpointing", self.enable_gradient_checkpointing,
                 "enable_gradient_checkpointing=False"),
            ):
                _check(
                    not value,
                    f"pipeline_model_parallel_size={pp} with {name} is not supported (not proven exact "
                    f"yet); set {off}, or pipeline_model_parallel_size=1",
                )
        _check(
            tp == 1 or not self.lora_enabled,
            f"tensor_model_parallel_size={tp} with LoRA (lora_rank={self.lora_rank}, lora_adapter_path="
            f"{self.lora_adapter_path!r}) is not supported yet; set tensor_model_parallel_size=1 or "
            f"lora_rank=0",
        )

    def _check_lora(self) -> None:
        _check(
            isinstance(self.lora_rank, int) and self.lora_rank >= 0,
            f"EngineConfig.lora_rank must be an int >= 0 (0 = no LoRA), got {self.lora_rank!r}",
        )
        _check(self.lora_alpha > 0, f"EngineConfig.lora_alpha must be > 0, got {self.lora_alpha}")
        _check(
            0.0 <= self.lora_dropout < 1.0,
            f"EngineConfig.lora_dropout must be in [0, 1), got {self.lora_dropout}",
        )
        targets = self.target_modules
        if not isinstance(targets, str) and hasattr(targets, "__iter__"):  # a list, tuple or ListConfig
            targets = list(targets)
        _check(
            targets == "all-linear"
            or (isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)),
            f"EngineConfig.target_modules={self.target_modules!r}; use 'all-linear' or a non-empty list of "
            f"module names, e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj']",
        )
        self.target_modules = targets
        params = self.target_parameters
        if params is not None and not isinstance(params, str) and hasattr(params, "__iter__"):
            params = list(params)
        _check(
            params is None or (isinstance(params, list) and params and all(isinstance(t, str) and t
                                                                            for t in params)),
            f"EngineConfig.target_parameters={self.target_parameters!r}; use null or a non-empty list of "
            f"parameter names, e.g. ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']",
        )
        self.target_parameters = params
        _check(
            params is None or self.lora_dropout == 0.0,
            f"EngineConfig.lora_dropout={self.lora_dropout} with target_parameters={params}: peft's LoRA on "
            f"parameters cannot apply dropout to the adapters' input; set lora_dropout=0.0",
        )
        _check(
            self.lora_adapter_path is None or isinstance(self.lora_adapter_path, str),
            f"EngineConfig.lora_adapter_path must be a directory path or null, got "
            f"{self.lora_adapter_path!r}",
        )
        if self.lora_adapter_path == "":
            self.lora_adapter_path = None

    @property
    def lora_enabled(self) -> bool:
        """True when the engine trains LoRA adapters (``lora_rank > 0`` or a saved adapter to load)."""
        return self.lora_rank > 0 or self.lora_adapter_path is not None

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold the same samples: the SP size times the TP size times the PP size."""
        return (self.ulysses_sequence_parallel_size * self.tensor_model_parallel_size
                * self.pipeline_model_parallel_size)

    def dp_size(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` ranks.

        Raises:
            ValueError: If ``world_size`` is not a multiple of the SP x TP size.

        """
        mp = self.model_parallel_size
        if world_size % mp:
            raise ValueError(
                f"world_size={world_size} is not divisible by ulysses_sequence_parallel_size x "
                f"tensor_model_parallel_size x pipeline_model_parallel_size={mp}; choose sizes whose "
                f"product divides the number of ranks"
            )
        return world_size // mp


@dataclass
class EngineSpec:
    """An engine a module asks for; the Trainer's strategy builds it (backend, precision, seed, topology).

    Attributes:
        model_type: ``"language_model"`` or ``"value_model"``.
        config: The engine config (model path, micro-batching, ...); dtypes come from the Trainer's
            precision.
        optim: Optimizer config; ``None`` builds an inference-only engine (e.g. a reference policy).
        model: A zero-argument callable that builds the model in place of loading ``config.model_path``:
            a transformers model (a token-classification model with ``num_labels=1`` for
            ``"value_model"``) or a ``PeftModel``. It runs on every rank, after the seed is set and
            before sharding; the engine switches it to padding-free attention. Its adapters are trained
            as they are (keep ``config.lora_rank=0``); a plain model gets adapters from
            ``config.lora_rank`` as a loaded one would.

    Example::

        from peft import LoraConfig, get_peft_model

        def build_policy():
            base = AutoModelForCausalLM.from_pretrained("path/to/model")
            return get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                   task_type="CAUSAL_LM"))

        spec = EngineSpec("language_model", EngineConfig(model_path="path/to/model"), OptimConfig(lr=1e-4),
                          model=build_policy)
    """

    model_type: str
    config: EngineConfig
    optim: OptimConfig | None = None
    model: Callable[[], torch.nn.Module] | None = None

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"EngineSpec.model_type={self.model_type!r}; choose one of {MODEL_TYPES}")
        if not isinstance(self.config, EngineConfig):
            raise TypeError(f"EngineSpec.config must be an EngineConfig, got {type(self.config).__name__}")
        if self.model is not None and not callable(self.model):
            raise TypeError(
                f"EngineSpec.model must be a callable returning the model (e.g. a function calling "
                f"get_peft_model), got {type(self.model).__name__}"
            )
