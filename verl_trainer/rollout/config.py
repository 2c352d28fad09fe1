"""Typed configuration of a rollout (generation) backend."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from verl_trainer.agents.config import MultiTurnConfig
from verl_trainer.rollout.lora_sync import LORA_SYNCS
from verl_trainer.rollout.registry import AUTO, backend_only_settings, rollout_class
from verl_trainer.rollout_pool.config import check_placement

DECODINGS = ("auto", "generate", "drop_finished")
CACHE_IMPLEMENTATIONS = ("auto", "dynamic", "static")


@dataclass
class RolloutConfig:
    """How prompts are turned into sampled responses.

    Sampling follows verl's ``actor_rollout_ref.rollout`` names where they exist (``n``, ``temperature``,
    ``top_p``, ``top_k``, ``do_sample``); ``max_new_tokens`` is verl's ``response_length``.

    Attributes:
        name: Backend: a registered name — ``"hf"`` (transformers ``generate``, CPU or GPU), ``"vllm"`` (a
            colocated vLLM engine, CPU with the ``vllm`` extra or CUDA; ``docs/rollout.md``) —, or
            ``"auto"``: what measured faster where it runs (:func:`verl_trainer.rollout.resolve_rollout_name`:
            vllm where it is installed and can run the model, on CUDA or on CPU for models of at least
            ``AUTO_CPU_VLLM_MIN_PARAMS`` decoder parameters), or a :class:`~verl_trainer.rollout.BaseRollout`
            subclass by where it is defined, ``"package.module:Class"`` or ``"path/to/file.py:Class"``
            (:func:`verl_trainer.rollout.registry.rollout_class`).
        n: Samples per prompt (GRPO group size). The ``n`` samples of a prompt are adjacent in the
            output and share its ``uid``.
        temperature: Sampling temperature (> 0 when ``do_sample``).
        top_p: Nucleus sampling mass in ``(0, 1]``; 1 disables it.
        top_k: Top-k sampling; ``-1`` or ``0`` disables it.
        max_new_tokens: Longest response, in tokens (the eos token included).
        do_sample: ``False`` decodes greedily (temperature/top_p/top_k are ignored).
        seed: Base seed. Call ``c`` of :meth:`BaseRollout.generate` on rank ``r`` samples from a seed
            derived from ``(seed, r, c)``, so a run is reproducible and ranks draw different samples.
        generation_batch_size: Sequences (prompts x n) per ``generate`` call; ``None`` = all at once.
        device: ``"auto"`` (this process's accelerator, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        dtype: Parameter dtype of the rollout copy: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        attn_implementation: Passed to ``from_pretrained`` (``None`` = transformers' default, sdpa).
        decoding: hf only. ``"generate"``: transformers' ``model.generate``; ``"drop_finished"``: our
            loop that removes finished sequences from the batch and the KV cache
            (``rollout/sampling.py: sample_dropping_finished``; same sampling, less work when lengths vary);
            ``"auto"``: ``drop_finished`` on CPU, ``generate`` on CUDA (static cache, compiled).
        cache_implementation: hf ``generate`` only: ``"dynamic"``, ``"static"`` (preallocated KV cache,
            what compiled decoding needs) or ``"auto"`` (static on CUDA, dynamic elsewhere).
        compile_decoding: hf ``generate`` with a static cache only: compile the decoding forward
            (transformers' ``CompileConfig``); ``None``: on CUDA with a static cache.
        share_weights: hf only: where the actor engine holds its parameters whole on this rank (one
            shard rank, no TP / LoRA / offload: ``engine.get_shareable_params()``) in the rollout's
            device and dtype, the rollout model uses that storage itself (no second copy of the weights,
            no per-step copy); ``False``: a private copy, synced after every update. Not used with
            ``max_staleness >= 1``: generation then runs while the actor trains, so it needs its own copy.
        gpu_memory_utilization: vLLM only: fraction of GPU memory vLLM may take.
        tensor_parallel_size: vLLM only; must be 1 (one engine per training process, synced with full
            tensors whatever the actor's TP size).
        enforce_eager: vLLM only: disable CUDA graphs (always eager on CPU).
        max_model_len: vLLM only: longest prompt + response the engine plans for (``None``: the model's
            ``max_position_embeddings``).
        free_cache_engine: vLLM only (verl's name): sleep between rollouts — free the KV cache and offload
            the weights while training runs (CUDA; vLLM has no sleep mode on CPU, where it is a no-op).
        multi_turn: Multi-turn, tool-calling and environment rollouts (``docs/agents.md``); with it on,
            ``max_new_tokens`` is the budget of a whole trajectory (model and tool tokens together).
        max_staleness: ``0``: synchronous (generate, then train, every step). ``k >= 1``: asynchronous
            rollout — a background thread generates the next ``k`` steps' responses while this step trains;
            a step trains on responses sampled by weights at most ``k`` updates older (admission control;
            ``1`` is verl's one-step-off) (:mod:`verl_trainer.algorithms.async_rollout`; hf or vllm
            rollout, single-turn, and ``rollout_correction`` on; ``docs/rollout.md``).
        partial_rollout: With ``max_staleness >= 1``: responses are generated ``partial_chunk_tokens``
            at a time and each chunk uses the newest weights its step may use, so a generation in flight
            at a weight update continues under the new weights, its prefix and behaviour log-probs kept
            (:mod:`verl_trainer.algorithms.partial_rollout`). With ``max_staleness=0`` nothing is in flight
            at an update: no effect (the synchronous run, bitwise).
        partial_chunk_tokens: Tokens generated between two checks for newer weights (``>= 1``).
        lora_sync: With LoRA on the actor: ``"adapter"`` sends only the adapters after each update and
            vLLM serves them as a LoRA request on the checkpoint's base weights; ``"merged"`` streams the
            whole model with the adapters merged (any backend); ``"auto"``: adapter with the vllm rollout
            on an accelerator (LoRA on linear layers), else merged (on CPU vLLM's LoRA halves generation
            speed) (:mod:`verl_trainer.rollout.lora_sync`).
        max_lora_rank: vLLM with ``lora_sync=adapter``: the largest adapter rank the engine serves
            (``0``: the actor's; rounded up to a rank vLLM accepts).
        placement: ``"colocated"``: every training process generates its own responses. ``"separate"``:
            ``rollout_ranks`` processes of the run's ``devices`` generate, the others train; weights are
            broadcast to them after each update (:mod:`verl_trainer.rollout_pool`; ``docs/rollout.md``).
        rollout_ranks: With ``placement="separate"``: processes that generate (``>= 1``); the trainer ranks
            (``devices - rollout_ranks``) must be a multiple of it.
        weight_sync_bucket_mb: With ``placement="separate"``: size of one broadcast bucket, in MiB (``> 0``).
        weight_sync_timeout_s: With ``placement="separate"``: seconds a rollout rank may stay silent (a
            weight broadcast, a sample group) before the run fails naming it (``> 0``).

    """

    name: str = "hf"
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    do_sample: bool = True
    seed: int = 0
    generation_batch_size: int | None = None
    device: str = "auto"
    dtype: str = "float32"
    attn_implementation: str | None = None
    decoding: str = "auto"
    cache_implementation: str = "auto"
    compile_decoding: bool | None = None
    share_weights: bool = True
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    max_model_len: int | None = None
    free_cache_engine: bool = True
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    max_staleness: int = 0
    partial_rollout: bool = False
    partial_chunk_tokens: int = 16
    lora_sync: str = "auto"
    max_lora_rank: int = 0
    placement: str = "colocated"
    rollout_ranks: int = 1
    weight_sync_bucket_mb: float = 64.0
    weight_sync_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; raise ``ValueError`` naming the field, its value and the valid range."""
        if self.name != AUTO:
            rollout_class(self.name)  # an unknown name, or a user's class that does not load, fails here
        if self.n < 1:
            raise ValueError(f"rollout n={self.n} must be >= 1 (samples per prompt)")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(
                f"rollout temperature={self.temperature} must be > 0 when do_sample=True; "
                "use do_sample=False for greedy decoding"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"rollout top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"rollout top_k={self.top_k} must be -1 or 0 (disabled) or a positive count")
        if self.generation_batch_size is not None and self.generation_batch_size < 1:
            raise ValueError(
                f"rollout generation_batch_size={self.generation_batch_size} must be >= 1, "
                "or None (all at once)"
            )
        if self.decoding not in DECODINGS:
            raise ValueError(f"rollout decoding={self.decoding!r} is unknown; choose one of {DECODINGS}")
        if self.cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ValueError(f"rollout cache_implementation={self.cache_implementation!r} is unknown; "
                             f"choose one of {CACHE_IMPLEMENTATIONS}")
        static = self.cache_implementation == "static"
        if self.decoding == "drop_finished" and (static or self.compile_decoding):
            raise ValueError(
                f"rollout decoding='drop_finished' shrinks the batch and its dynamic KV cache as sequences "
                f"finish, so it cannot use cache_implementation={self.cache_implementation!r} / "
                f"compile_decoding={self.compile_decoding}; use decoding='generate' for a static cache or "
                "compiled decoding"
            )
        if self.compile_decoding and self.cache_implementation == "dynamic":
            raise ValueError("rollout compile_decoding=True needs cache_implementation='static' (or 'auto'): "
                             "transformers compiles decoding only over a static KV cache")
        if self.max_model_len is not None and self.max_model_len < self.max_new_tokens + 1:
            raise ValueError(f"rollout max_model_len={self.max_model_len} must exceed max_new_tokens="
                             f"{self.max_new_tokens} (prompt + response), or be None (the model's length)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"rollout dtype={self.dtype!r}; choose float32, bfloat16 or float16")
        self._check_staleness()
        if self.lora_sync not in LORA_SYNCS:
            raise ValueError(f"rollout lora_sync={self.lora_sync!r} is unknown; choose one of {LORA_SYNCS}")
        if isinstance(self.max_lora_rank, bool) or not isinstance(self.max_lora_rank, int) \
                or self.max_lora_rank < 0:
            raise ValueError(f"rollout max_lora_rank={self.max_lora_rank!r} must be an int >= 0 (0: the "
                             "actor's LoRA rank)")
        check_placement(self)

    def _check_staleness(self) -> None:
        """``max_staleness`` is an int >= 0, and >= 1 only with the backends and modes built for it."""
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) \
                or self.max_staleness < 0:
            raise ValueError(
                f"rollout max_staleness={self.max_staleness!r} must be an int >= 0 (0: synchronous, k >= 1: "
                "asynchronous rollout, responses sampled by weights at most k updates old)"
            )
        if self.partial_chunk_tokens < 1:
            raise ValueError(f"rollout partial_chunk_tokens={self.partial_chunk_tokens} must be >= 1 (tokens "
                             "generated between two checks for newer weights)")
        if not self.max_staleness:
            return
        backend = None if self.name == AUTO else rollout_class(self.name)  # auto: checked once built
        if backend is not None and not backend.one_step_off:
            raise ValueError(
                f"rollout max_staleness={self.max_staleness} with name={self.name!r}: the "
                f"{backend.__name__} backend cannot generate while the actor trains (it does not declare "
                "one_step_off: a backend with its own weights that may generate on a background thread); use "
                f"name='hf' or name='vllm' for the asynchronous rollout, or max_staleness=0 with {self.name}"
            )
        if self.multi_turn.enable:
            raise ValueError(
                f"rollout max_staleness={self.max_staleness} with multi_turn.enable=true: the asynchronous "
                "rollout is built for single-turn sampling only (tool calls and environments are not proven "
                "on a background thread); set max_staleness=0 for multi-turn rollouts"
            )

    def ignored_by(self, backend: str) -> list[str]:
        """``name=value`` of the settings changed from their defaults that ``backend`` does not read.

        The candidates are the registered backends' ``backend_settings``; ``backend`` reads its own.

        Args:
            backend: The backend the run resolved to (a registered name or ``"module:Class"``).
        """
        defaults, reads = type(self)(), set(rollout_class(backend).backend_settings)
        return [f"{name}={getattr(self, name)}" for name in backend_only_settings()
                if name not in reads and getattr(self, name) != getattr(defaults, name)]

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of the fields (for overrides and config mapping)."""
        return tuple(f.name for f in fields(cls))
