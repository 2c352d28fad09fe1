#!/usr/bin/env bash
# GPU checks for a machine with one CUDA device (the device tool's H200), in well under 8 minutes:
#   1. the GPU-marked tests (tests/gpu: varlen attention in bf16 on CUDA, fsdp2 and DeepSpeed engine steps
#      over NCCL with bf16 mixed precision against fp32, a Trainer(accelerator="gpu") fit);
#   2. bench/step_throughput.py with NCCL and bf16 on a ~150M-parameter Llama: tokens/s of dynamic
#      micro-batching + packing against padded micro-batches, and MFU against the measured bf16 peak.
#
#   bash bench/gpu_check.sh            # uses python3 (or $PYTHON); prints MFU at the end
#
# Needs torch with CUDA, transformers, lightning, torchmetrics, tensordict, omegaconf, rich (deepspeed and
# flash-attn are optional: their tests skip). On a bare machine with none of the extra packages and no
# network, carry wheels in .whl/ (see /work/.library/device/README.md) and this script installs them into
# /tmp/site first. The project is run from a copy in which callbacks/ sits at verl_trainer/callbacks (what
# setup.py's package_dir does for an installed copy), so nothing is built or installed.
set -euo pipefail
SRC="$(cd "$(dirname "$0")/.." && pwd)"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
if [ -d "$SRC/.whl" ] && ls "$SRC"/.whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$SRC"/.whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" - <<'PYEOF'
import importlib, sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch")
missing = [m for m in ("transformers", "lightning", "torchmetrics", "tensordict", "omegaconf", "rich")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing Python packages {missing}; carry their wheels in .whl/ (see the header)")
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name()}, "
      f"bf16 {torch.cuda.is_bf16_supported()}, nccl {torch.distributed.is_nccl_available()}")
PYEOF
WORK="$(mktemp -d)/verl-trainer"
mkdir -p "$WORK"
(cd "$SRC" && tar --exclude=.git --exclude=.venv --exclude=.whl --exclude=outputs -cf - .) | (cd "$WORK" && tar -xf -)
cp -r "$WORK/callbacks" "$WORK/verl_trainer/callbacks"
cd "$WORK"
export PYTHONPATH="$WORK${PYTHONPATH:+:$PYTHONPATH}"
echo "== GPU-marked tests"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu
echo "== step throughput, nccl + bf16"
timeout 240 "$PY" bench/step_throughput.py --device cuda --dtype bf16 --hidden 1024 --layers 12 \
  --vocab 32768 --samples 256 --budget 16384 --repeats 3
