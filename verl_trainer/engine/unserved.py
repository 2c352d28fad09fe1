"""verl's engine backends this project names but does not build, each with the reason and what to use instead.

verl's engine layer has seven backends: fsdp / fsdp2, megatron, veomni, torchtitan, automodel and mindspeed.
The ones listed here are refused by name when selected (``Trainer(strategy=...)``, ``EngineRegistry.new``),
before any model loads: the error says what the backend needs (its library, its device), what was measured on
a CPU machine, and the backend that runs instead. docs/backends.md has the table of all seven.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UnservedBackend:
    """A verl backend name with no engine here.

    Attributes:
        needs: The library and device the backend runs on.
        measured: What was measured when it was tried here.
        instead: The registered backend to use in its place, and why.
    """

    needs: str
    measured: str
    instead: str

    def message(self, name: str) -> str:
        """The refusal of strategy ``name``: what it needs, what was measured, what to use."""
        return (f"strategy {name!r} (verl's {name} engine) is not built in verl-trainer: it needs "
                f"{self.needs}. Measured: {self.measured}. Use {self.instead}.")


UNSERVED_BACKENDS: dict[str, UnservedBackend] = {
    "veomni": UnservedBackend(
        needs="the `veomni` library (ByteDance VeOmni) and CUDA GPUs for its fused kernels",
        measured=("`pip install veomni` (0.1.12) replaces the CPU torch with a CUDA torch build through "
                  "timm -> torchvision (its gpu extra pins torch 2.11.0+cu130); installed with --no-deps "
                  "beside transformers 5.25, `import veomni` fails (ImportError: "
                  "Qwen2_5OmniThinkerCausalLMOutputWithPast from transformers' qwen2_5_omni), so none of its "
                  "code runs here; its HF-model path is fully_shard (FSDP2), what strategy='fsdp2' runs"),
        instead="strategy='fsdp2' (the same FSDP2 sharding of the HF model, with TP, PP and Ulysses SP)",
    ),
    "automodel": UnservedBackend(
        needs="NVIDIA NeMo Automodel (`nemo-automodel`) and NVIDIA GPUs",
        measured=("nemo-automodel 0.7.0 pins transformers==5.18.0, brings 2.8 GB of CUDA-only packages, "
                  "and its from_pretrained is hard-wired to CUDA"),
        instead="strategy='fsdp2' (DTensor FSDP2 and TP of the HF model, as Automodel does) or 'torchtitan'",
    ),
    "mindspeed": UnservedBackend(
        needs="Huawei Ascend NPUs with torch_npu and MindSpeed from Ascend's own distribution",
        measured=("the `mindspeed` package on PyPI (0.0.1.dev1) is an Ascend placeholder whose sdist fails "
                  "to build here (pip: 'Failed to build ... when getting requirements')"),
        instead=("strategy='megatron' (MindSpeed adapts Megatron-Core to Ascend) or 'fsdp2', which is "
                 "registered for device 'npu'"),
    ),
}
"""verl's backends refused here by name, keyed on the strategy name."""


def unserved_backend_message(name: str) -> str | None:
    """The refusal message of strategy ``name`` when it is a verl backend not built here, else ``None``."""
    entry = UNSERVED_BACKENDS.get(name)
    return None if entry is None else entry.message(name)
