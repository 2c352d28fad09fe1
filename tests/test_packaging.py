"""What a pip install holds: ``callbacks/``, ``recipes/``, ``configs/`` inside the package, and the command.

``callbacks/`` is ``verl_trainer.callbacks`` in editable and normal installs; a wheel installed into a
fresh venv (its dependencies taken from this venv through a ``.pth`` path, ``--no-deps`` keeps it fast)
runs ``verl-trainer grpo ...`` and ``python -m verl_trainer.recipes.grpo`` from a directory with no
clone in sight (issue 29 item 9).
"""

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

from tests.trainer.common import read_csv_metrics

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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built once for this module."""
    base = tmp_path_factory.mktemp("wheel")
    wheel_dir, src = base / "wheel", base / "src"
    # build from a copy: an in-tree build would leave build/ and *.egg-info in the checkout
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info",
                                                             "__pycache__", "outputs", "wandb"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheel_dir), str(src)], check=True, capture_output=True)
    (built,) = wheel_dir.glob("verl_trainer-*.whl")
    return built


@pytest.fixture(scope="module")
def pip_venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed as a user's ``pip install`` does (not editable); its
    dependencies come from this venv's site-packages through a ``.pth`` path (whose own ``.pth`` files, the
    editable finder among them, are not run). Returns the venv's ``bin`` directory."""
    venv = tmp_path_factory.mktemp("pip_venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip()
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(site, "verl_trainer_test_deps.pth").write_text("\n".join(deps) + "\n")
    return venv / "bin"


def _run(args: list, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_wheel_install_maps_callbacks(wheel, tmp_path):
    site = tmp_path / "site"
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


def test_wheel_ships_the_recipes_their_configs_and_the_command(wheel, pip_venv, tmp_path):
    names = set(zipfile.ZipFile(wheel).namelist())
    for recipe in ("common", "sft", "ppo", "grpo", "dr_grpo"):
        assert f"verl_trainer/recipes/{recipe}.py" in names
    for config in sorted((REPO / "configs").glob("*.yaml")):
        assert f"verl_trainer/recipes/configs/{config.name}" in names
    entry_points = zipfile.ZipFile(wheel).read("verl_trainer-0.1.0.dist-info/entry_points.txt").decode()
    assert "verl-trainer = verl_trainer.cli:main" in entry_points

    probe = "import verl_trainer.recipes.grpo as g; print(g.__file__)"
    where = _run([pip_venv / "python", "-c", probe], tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(pip_venv.parent), where  # the installed copy, no clone
    helped = _run([pip_venv / "verl-trainer", "--help"], tmp_path)
    assert helped.returncode == 0 and "recipes: sft, ppo, grpo, dr_grpo" in helped.stdout
    shipped = ", ".join(sorted(p.stem for p in (REPO / "configs").glob("*.yaml")))
    assert f"configs shipped with the package (--config NAME): {shipped}" in helped.stdout
    typo = _run([pip_venv / "verl-trainer", "grpp"], tmp_path)
    assert typo.returncode == 2 and "unknown command 'grpp'; did you mean grpo?" in typo.stderr
    # the README's --config path, typed where there is no configs/ directory: the shipped DAPO config
    dapo = _run([pip_venv / "verl-trainer", "grpo", "--config", "configs/dapo.yaml", "--print-config",
                 "trainer.max_steps=3"], tmp_path)
    assert dapo.returncode == 0, dapo.stderr
    assert "using the config shipped with verl-trainer" in dapo.stdout
    assert "dynamic_sampling: true" in dapo.stdout and "max_steps: 3" in dapo.stdout
    module = _run([pip_venv / "python", "-m", "verl_trainer.recipes.dr_grpo", "--print-config"], tmp_path)
    assert module.returncode == 0 and "loss_agg_mode: seq-mean-token-sum-norm" in module.stdout, module.stderr
    missing = _run([pip_venv / "verl-trainer", "sft", "--config", "mine/sft.yaml"], tmp_path)
    assert missing.returncode == 2 and "config file 'mine/sft.yaml' does not exist" in missing.stderr
    assert not any(tmp_path.iterdir())  # nothing was written by --help, --print-config or the refusals


@pytest.mark.slow
def test_pip_installed_command_runs_the_grpo_recipe_at_two_ranks(pip_venv, tmp_path):
    """``verl-trainer grpo`` as a pip user runs it, in an empty directory: it makes the demo's tiny model and
    task, warm-starts, trains 2 GRPO steps at 2 ranks (the launcher re-runs the command for rank 1),
    validates and exports, as ``python recipes/grpo.py`` does in a clone."""
    proc = _run([pip_venv / "verl-trainer", "grpo", "trainer.devices=2", "trainer.max_steps=2",
                 "trainer.val_check_interval=null", "trainer.logger=[csv]", "data.train_batch_size=4",
                 "algorithm.rollout.n=2", "algorithm.rollout.max_new_tokens=3",
                 "algorithm.actor.ppo_mini_batch_size=2",
                 "algorithm.actor.engine.micro_batch_size_per_gpu=2", "warm_start.max_steps=1",
                 "warm_start.batch_size=4", "task.arithmetic.num_train=64", "task.arithmetic.num_val=4"],
                tmp_path, timeout=420)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "made a tiny qwen2 model at outputs/models/tiny" in proc.stdout
    assert "SFT warm start: 1 steps" in proc.stdout and "after training" in proc.stdout
    metrics = read_csv_metrics(tmp_path / "outputs" / "grpo")
    assert {1, 2} <= set(metrics) and "reward/mean" in metrics[2], sorted(metrics)
    assert (tmp_path / "outputs" / "grpo" / "hf" / "config.json").exists()
