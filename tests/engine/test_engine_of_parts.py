"""The engine of parts, single process: verl's names delegate to small parts, backends declare their
capabilities on the class, HF file knowledge sits below the engine, and each constant has one home."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from verl_trainer.engine import BaseEngine, DeepSpeedEngine, EngineRegistry, FSDPEngine
from verl_trainer.engine.hf_export import HFExport
from verl_trainer.engine.topology import Topology
from verl_trainer.engine.weights import WeightStream
from verl_trainer.training.strategy import check_precision

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "verl_trainer"

VERL_ENGINE_NAMES = (
    "initialize", "to", "train_mode", "eval_mode", "forward_backward_batch", "train_batch", "infer_batch",
    "optimizer_zero_grad", "optimizer_step", "lr_scheduler_step", "get_data_parallel_size",
    "get_data_parallel_rank", "get_data_parallel_group", "is_mp_src_rank_with_outputs",
    "get_per_tensor_param", "save_checkpoint", "load_checkpoint",
)
"""verl's engine interface, kept on ``BaseEngine``."""


def test_verl_names_stay_on_the_engine():
    assert [name for name in VERL_ENGINE_NAMES if not callable(getattr(BaseEngine, name, None))] == []
    for name in ("save_hf", "save_adapter", "disable_adapters", "get_shareable_params"):
        assert callable(getattr(BaseEngine, name))


def test_capabilities_are_declared_on_the_backend_class():
    assert FSDPEngine.RESHARDABLE_CHECKPOINTS and BaseEngine.RESHARDABLE_CHECKPOINTS is False
    assert EngineRegistry.backends("RESHARDABLE_CHECKPOINTS") == ["fsdp", "fsdp2"]
    assert EngineRegistry.backend_class("fsdp2") is FSDPEngine
    assert EngineRegistry.backend_class("no_such_backend") is None
    assert FSDPEngine.CPU_FLOAT16_REFUSAL is None
    if DeepSpeedEngine is not None:
        assert not DeepSpeedEngine.RESHARDABLE_CHECKPOINTS
        assert "DeepSpeed's CPU accelerator" in DeepSpeedEngine.CPU_FLOAT16_REFUSAL


def test_a_plugin_backend_declares_its_capabilities():
    @EngineRegistry.register(model_type="language_model", backend="parts_plugin", device="cpu")
    class Plugin(FSDPEngine):
        CPU_FLOAT16_REFUSAL = "the plug-in has no float16 kernels"

    try:
        assert "parts_plugin" in EngineRegistry.backends("RESHARDABLE_CHECKPOINTS")  # inherited from DCP
        if not _native_cpu_float16():
            with pytest.raises(ValueError, match="the plug-in has no float16 kernels"):
                check_precision("16-mixed", "cpu", "parts_plugin")
    finally:
        EngineRegistry.unregister("language_model", "parts_plugin", "cpu")
    assert "parts_plugin" not in EngineRegistry.backends()


def _native_cpu_float16() -> bool:
    from verl_trainer.training.strategy import fp16_supported_on_cpu

    return fp16_supported_on_cpu()


def test_weight_stream_without_adapters():
    tensors = {"a": torch.ones(2), "b": torch.zeros(3)}

    def named_full_tensors(keep=None):
        yield from ((n, t) for n, t in tensors.items() if keep is None or keep(n))

    stream = WeightStream(named_full_tensors, None, "MyEngine")
    assert [name for name, _ in stream.tensors()] == ["a", "b"]
    with pytest.raises(RuntimeError, match=r"get_per_tensor_param\(adapters_only=True\) needs LoRA adapters, "
                                           r"but MyEngine has none"):
        list(stream.tensors(adapters_only=True))


def test_hf_export_writes_a_loadable_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    from verl_trainer.models.tiny import make_tiny_model

    source = make_tiny_model(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(source)
    export = HFExport(str(source), model.config, "language_model")
    out = export.save(model.state_dict().items(), tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert (Path(out) / "tokenizer_config.json").is_file()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_reports_outputs_is_one_rank_per_dp_rank():
    topo = Topology(world_size=1, rank=0, dp_size=1, sp_size=1)
    assert topo.reports_outputs
    topo.sp_rank = 1
    assert not topo.reports_outputs


def _module_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_engine_does_not_import_export():
    importers = [str(p.relative_to(ROOT)) for p in (PACKAGE / "engine").rglob("*.py")
                 if any(m.startswith("verl_trainer.export") for m in _module_imports(p))]
    assert importers == []


ONE_HOME = {
    "MODEL_TYPES": "verl_trainer/models/hf_files.py",
    "DTYPES": "verl_trainer/models/hf_files.py",
    "SAFE_WEIGHTS_NAME": "verl_trainer/models/hf_files.py",
    "SAFE_WEIGHTS_INDEX_NAME": "verl_trainer/models/hf_files.py",
    "TOKENIZER_FILES": "verl_trainer/models/hf_files.py",
    "META_FILE": "verl_trainer/engine/checkpoint.py",
}


def test_each_constant_has_one_home():
    homes: dict[str, list[str]] = {name: [] for name in ONE_HOME}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            for target in targets:
                if isinstance(target, ast.Name) and target.id in homes:
                    homes[target.id].append(str(path.relative_to(ROOT)))
    assert homes == {name: [home] for name, home in ONE_HOME.items()}
