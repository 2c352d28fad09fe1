#!/usr/bin/env bash
# CI stage of a backend on its own library: `bash scripts/ci_backend.sh NAME` (NAME: torchtitan, megatron)
# builds .venv-NAME with the extra NAME (scripts/setup_venv.sh) and runs every test marked NAME — the
# backend's own tests, its invariance cases against the fsdp2 reference, its recipe runs — in that venv.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: scripts/ci_backend.sh NAME (torchtitan or megatron)}
export VENV=${VENV:-.venv-$name} WANDB_MODE=offline
start=$SECONDS
if [ "${VENV_READY:-0}" != 1 ]; then  # VENV_READY=1: .ci/run built it beside the lanes
  EXTRAS=$name bash scripts/setup_venv.sh
  echo "ci_backend: $VENV set up in $((SECONDS - start)) s, $(du -sm "$VENV" | cut -f1) MB"
fi
# Only the files that can carry the marker are collected (10 s of CPU; all of tests/: 16 s): a
# `pytest.mark.NAME` in the file, or marks made from a case's strategy (`getattr(pytest.mark, ...)`).
files=$(grep -rlE "pytest\.mark\.$name\b|getattr\(pytest\.mark," tests --include="test_*.py" | sort)
if [ -z "$files" ]; then
  echo "ci_backend: no test file carries the $name marker" >&2
  exit 1
fi
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=20 -m "$name" $files
