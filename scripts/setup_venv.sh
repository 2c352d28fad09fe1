#!/usr/bin/env bash
# Create .venv with everything verl-trainer needs on a CPU machine, without a CUDA build of torch.
# torch==2.13.0 (CPU build) is installed first, from this machine's local disk, so that every later
# requirement on torch is already satisfied. deepspeed ships an sdist whose build imports torch, so it
# is built without build isolation (an isolated build would download a CUDA torch to build it).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip "setuptools>=77" wheel
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q --no-build-isolation -e ".[test,deepspeed,plot,data]"
"$VENV/bin/python" -c "import torch, verl_trainer; print('verl-trainer', verl_trainer.__version__, '| torch', torch.__version__)"
