#!/usr/bin/env bash
# CI stage for Ray Train (.ci/run, lane 1): adds the `ray` extra's packages (pyproject.toml: ray[train]==2.60.0,
# a 79 MB wheel, 240 MB installed, ~30 s) to the venv (default .venv, made by scripts/setup_venv.sh) and runs
# the tests marked `ray`. Only the missing packages are installed (no upgrade, no reinstall of verl-trainer),
# so the other lane's tests in the same venv keep working meanwhile. Each test starts its own two-node Ray
# cluster bound to 127.0.0.1 and ends only that cluster's processes.
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV=${VENV:-.venv} WANDB_MODE=offline
[ -x "$VENV/bin/python" ] || bash scripts/setup_venv.sh
ray_req=$("$VENV/bin/python" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["ray"])')
"$VENV/bin/python" -m pip install -q $ray_req
"$VENV/bin/python" -c "import ray.train; print('ray', ray.__version__)"
files=$(grep -rl "pytest.mark.ray" tests --include="test_*.py" | sort)
if [ -z "$files" ]; then
  echo "ci_ray: no test file carries the ray marker" >&2
  exit 1
fi
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m ray $files
