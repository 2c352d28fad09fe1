"""``callbacks/`` is installed as ``verl_trainer.callbacks`` in editable and in normal installs."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = "import verl_trainer, verl_trainer.callbacks as c; print(c.__file__); print(c.Callback.__module__)"


def _is_editable_install() -> bool:
    # every installed distribution named verl-trainer (a stray build/*.egg-info in the source tree has
    # no direct_url.json and is not an install)
    for dist in metadata.distributions(name="verl-trainer"):
        text = dist.read_text("direct_url.json")
        if text and json.loads(text).get("dir_info", {}).get("editable", False):
            return True
    return False


def test_editable_install_maps_callbacks(tmp_path):
    if not _is_editable_install():
        pytest.skip("verl-trainer is not installed in editable mode in this environment")
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout.split()
    assert Path(out[0]).resolve() == REPO / "callbacks" / "__init__.py"
    assert out[1] == "verl_trainer.callbacks.base"


def test_wheel_install_maps_callbacks(tmp_path):
    wheel_dir, site, src = tmp_path / "wheel", tmp_path / "site", tmp_path / "src"
    # build from a copy: an in-tree build would leave build/ and *.egg-info in the checkout
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info",
                                                             "__pycache__", "outputs", "wandb"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheel_dir), str(src)], check=True, capture_output=True)
    (wheel,) = wheel_dir.glob("verl_trainer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "verl_trainer/callbacks/__init__.py" in names
    assert "verl_trainer/callbacks/base.py" in names
    assert not any(n.startswith(("tests/", "callbacks/", "bench/")) for n in names)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, capture_output=True)
    # -S: site-packages' .pth files (the editable finder) are not run; the dependencies stay importable
    # from site-packages, listed after the wheel's install target.
    path = os.pathsep.join([str(site), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    out = subprocess.run([sys.executable, "-S", "-c", PROBE], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": path, "HOME": str(tmp_path)}, check=True).stdout.split()
    assert Path(out[0]).resolve() == (site / "verl_trainer" / "callbacks" / "__init__.py").resolve()
    assert out[1] == "verl_trainer.callbacks.base"
