"""``ModelCheckpoint(save_hf=True)``, ``module.save_hf`` and the converter CLI on a trainer checkpoint.

One 1-rank run (fsdp2, SFT) saves at step 2 with an HF export inside the checkpoint (``step_000002/hf``) and
calls ``module.save_hf`` after fit; converting the checkpoints directory on this process (its newest step,
``python -m verl_trainer.export`` in-process) gives the same weights bit for bit, and they load with plain
transformers. Bad converter inputs fail with messages that say what to pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.common import SFTData, sft_module, tiny_model
from verl_trainer import Trainer
from verl_trainer.callbacks import ModelCheckpoint
from verl_trainer.testing.ranks import run_distributed


def _fit(model_path: str, root: str) -> list[str]:
    trainer = Trainer(strategy="fsdp2", devices=1, max_steps=2, default_root_dir=root, logger=False,
                      enable_progress_bar=False, seed=3,
                      callbacks=[ModelCheckpoint(every_n_train_steps=2, save_hf=True)])
    module = sft_module(model_path)
    trainer.fit(module, SFTData(n=16, batch_size=4))
    module.save_hf(Path(root) / "final")  # after fit: the same weights as the step-2 checkpoint
    return sorted(p.name for p in (Path(root) / "checkpoints" / "step_000002").iterdir())


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_model_checkpoint_save_hf_and_converter_agree(tmp_path):
    from transformers import AutoModelForCausalLM

    from verl_trainer.export.__main__ import main as export_main
    from verl_trainer.export.convert import convert_checkpoint

    model_path = tiny_model(tmp_path / "model")
    names = run_distributed(_fit, 1, model_path, str(tmp_path / "run"), timeout=300)[0]
    assert "hf" in names and "engines" in names
    hf = tmp_path / "run" / "checkpoints" / "step_000002" / "hf"
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in hf.iterdir()}
    out = tmp_path / "converted"
    assert export_main([str(tmp_path / "run" / "checkpoints"), str(out)]) == 0  # the CLI, in this process
    exported, converted, final = _tensors(hf), _tensors(out), _tensors(tmp_path / "run" / "final")
    assert exported.keys() == converted.keys() == final.keys()
    assert all(torch.equal(exported[k], converted[k]) for k in exported)
    assert all(torch.equal(exported[k], final[k]) for k in exported)
    initial = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(out).state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(initial[name], trained[name])

    with pytest.raises(FileNotFoundError, match="no engine 'critic'.*--engine"):
        convert_checkpoint(tmp_path / "run" / "checkpoints", tmp_path / "c2", engine="critic")
    with pytest.raises(FileNotFoundError, match="is not a checkpoint"):
        convert_checkpoint(tmp_path / "model", tmp_path / "c3")
    assert export_main([str(tmp_path / "model"), str(tmp_path / "c3")]) == 1  # a message, no traceback
    assert not (tmp_path / "c2").exists() and not (tmp_path / "c3").exists()

    # the export never replaces or writes into the checkpoint it reads (it used to, with exit 0)
    ckpts = tmp_path / "run" / "checkpoints"
    step = ckpts / "step_000002"
    for ckpt, out, relation in ((step, step, "is"), (step, step / "engines" / "actor", "lies inside"),
                                (step / "engines" / "actor", step, "contains"), (ckpts, ckpts, "is")):
        with pytest.raises(ValueError, match=f"OUT_DIR=.* {relation} the checkpoint .*outside"):
            convert_checkpoint(ckpt, out)
        assert export_main([str(ckpt), str(out)]) == 1
    older = ckpts / "step_000001"  # another checkpoint of the run: refused by its kind
    older.mkdir()
    for entry in step.iterdir():
        if entry.name in (".verl_trainer_output", "trainer_state.pt"):
            (older / entry.name).write_bytes(entry.read_bytes())
    with pytest.raises(FileExistsError, match="'checkpoint' directory verl-trainer wrote"):
        convert_checkpoint(step, older)
    assert export_main([str(step), str(older)]) == 1
    assert (older / "trainer_state.pt").read_bytes() == (step / "trainer_state.pt").read_bytes()
    assert all(torch.equal(_tensors(hf)[k], exported[k]) for k in exported)  # the checkpoint is intact
