"""``callbacks/`` is installed as ``verl_trainer.callbacks`` in editable and in normal installs."""

import json
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = "import verl_trainer, verl_trainer.callbacks as c; print(c.__file__); print(c.Callback.__module__)"


def _is_editable_install() -> bool:
    try:
        dist = metadata.distribution("verl-trainer")
    except metadata.PackageNotFoundError:
        return False
    text = dist.read_text("direct_url.json")
    return bool(text) and json.loads(text).get("dir_info", {}).get("editable", False)


def test_editable_install_maps_callbacks(tmp_path):
    if not _is_editable_install():
        pytest.skip("verl-trainer is not installed in editable mode in this environment")
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout.split()
    assert Path(out[0]).resolve() == REPO / "callbacks" / "__init__.py"
    assert out[1] == "verl_trainer.callbacks.base"


def test_wheel_install_maps_callbacks(tmp_path):
    wheel_dir, site = tmp_path / "wheel", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheel_dir), str(REPO)], check=True, capture_output=True)
    (wheel,) = wheel_dir.glob("verl_trainer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "verl_trainer/callbacks/__init__.py" in names
    assert "verl_trainer/callbacks/base.py" in names
    assert not any(n.startswith(("tests/", "callbacks/", "bench/")) for n in names)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, capture_output=True)
    # -S: no site-packages, so neither the editable finder nor the source tree can answer the import.
    out = subprocess.run([sys.executable, "-S", "-c", PROBE], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site)}, check=True).stdout.split()
    assert Path(out[0]).resolve() == (site / "verl_trainer" / "callbacks" / "__init__.py").resolve()
    assert out[1] == "verl_trainer.callbacks.base"
