"""Parquet needs pyarrow, which the bare wheel lacks (the ``data`` extra has it): without it, reading or
writing a parquet file fails naming the extra (issue 47 item 9). pyarrow is installed in the test venv, so
its absence is simulated by making ``import pyarrow`` fail (``sys.modules[name] = None``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipes.test_recipes import make_recipe_assets
from verl_trainer.data.prompts import read_rows, save_rows, to_verl_row

pytest.importorskip("pyarrow")
ROOT = Path(__file__).resolve().parents[2]
EXTRA = r"needs pyarrow, which is not installed: pip install 'verl-trainer\[data\]'"


def _rows(n: int) -> list[dict]:
    return [to_verl_row(f"{i}+1=", str(i + 1), "toy", extra_info={"index": i}) for i in range(n)]


def _without_pyarrow(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)


def test_parquet_without_pyarrow_names_the_data_extra(tmp_path, monkeypatch):
    path = save_rows(_rows(2), tmp_path / "train.parquet")  # with pyarrow
    _without_pyarrow(monkeypatch)
    with pytest.raises(ImportError, match=f"reading '{path}' {EXTRA}"):
        read_rows(path)
    with pytest.raises(ImportError, match=f"writing '{tmp_path / 'out.parquet'}' {EXTRA}"):
        save_rows(_rows(1), tmp_path / "out.parquet")
    save_rows(_rows(1), tmp_path / "out.jsonl")  # jsonl needs nothing more
    assert len(read_rows(tmp_path / "out.jsonl")) == 1


RUN_WITHOUT_PYARROW = """
import sys
sys.modules["pyarrow"] = sys.modules["pyarrow.parquet"] = None  # as in a bare `pip install verl-trainer`
from verl_trainer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_recipe_on_parquet_without_pyarrow_prints_the_extra(tmp_path):
    assets = make_recipe_assets(tmp_path / "assets")
    data = save_rows(_rows(8), tmp_path / "train.parquet")
    proc = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_PYARROW, "grpo", f"model.path={assets / 'model'}",
         f"data.train_files={data}", "data.val_files=null", "warm_start.enable=false",
         f"trainer.default_root_dir={tmp_path / 'run'}", "trainer.logger=[csv]"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"verl-trainer grpo: error: reading '{data}' needs pyarrow"), proc.stderr
    assert "pip install 'verl-trainer[data]'" in proc.stderr
