#!/usr/bin/env bash
# PyTorch for the set-up (the Makefile's `install`), before moeserve itself, so that pip never picks a build on its
# own. On a machine without an NVIDIA GPU: the CPU build, from PyTorch's own CPU wheel index (PyPI's torch is the
# CUDA build, several GB of CUDA packages a CPU machine never uses); where that index cannot be reached (offline,
# a proxy), pip's configured index and local wheels, said plainly. With a GPU: the default build.
#   usage: scripts/install_torch.sh PYTHON 'torch==2.13.0'    (an empty spec keeps the torch the venv has)
#   TORCH_CPU_INDEX overrides the CPU index's address.
set -euo pipefail
py="$1"
spec="${2:-}"
cpu_index="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

if [ -z "$spec" ]; then
  echo "install_torch: TORCH is empty: keeping the torch the environment has"
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 || compgen -G '/dev/nvidia[0-9]*' >/dev/null; then
  echo "install_torch: an NVIDIA GPU is present: $spec, the default (CUDA) build"
  exec "$py" -m pip install -q "$spec"
fi
if "$py" - "$cpu_index" <<'PY'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
except Exception:
    sys.exit(1)
PY
then
  echo "install_torch: no NVIDIA GPU: $spec, the CPU build from $cpu_index"
  exec "$py" -m pip install -q --index-url "$cpu_index" "$spec"
fi
echo "install_torch: no NVIDIA GPU, and PyTorch's CPU wheel index ($cpu_index) cannot be reached: installing" \
     "$spec from pip's configured index and local wheels instead. Where that is PyPI it is the CUDA build" \
     "(several GB); set TORCH_CPU_INDEX to a mirror of the CPU index, or TORCH= to keep a torch already installed."
exec "$py" -m pip install -q "$spec"
