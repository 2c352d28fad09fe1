#!/usr/bin/env bash
# CI extras stage for Ray Train and the optional loggers (.ci/run, alone after both lanes): adds the `ray` extra's packages
# (pyproject.toml: ray[train]==2.60.0, a 79 MB wheel, 240 MB installed, ~30 s), the `mlflow` extra's
# (mlflow-skinny with sqlalchemy and alembic for its SQLite store, ~110 MB installed) and the `tensorboard` extra's (~56 MB) to the venv (default .venv, made by
# scripts/setup_venv.sh) and runs the tests marked `ray`, `mlflow` or `tensorboard`. Only the missing packages are installed (no upgrade, no reinstall of verl-trainer),
# so the venv's other tests keep working. Each test starts its own two-node Ray
# cluster bound to 127.0.0.1 and ends only that cluster's processes.
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV=${VENV:-.venv} WANDB_MODE=offline
[ -x "$VENV/bin/python" ] || bash scripts/setup_venv.sh
extras_req=$("$VENV/bin/python" -c 'import tomllib; extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; print(*extras["ray"], *extras["mlflow"], *extras["tensorboard"])')
"$VENV/bin/python" -m pip install -q $extras_req
"$VENV/bin/python" -c "import ray.train, mlflow, tensorboard; print('ray', ray.__version__, '| mlflow', mlflow.__version__)"
files=$(grep -rlE "pytest.mark.(ray|mlflow|tensorboard)" tests --include="test_*.py" | sort)
if [ -z "$files" ]; then
  echo "ci_ray: no test file carries the ray, mlflow or tensorboard marker" >&2
  exit 1
fi
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 -m "ray or mlflow or tensorboard" $files
