# Sourced at the start of every GPU-machine run: carried wheels and the repo on PYTHONPATH.
# The GPU image has torch, transformers, safetensors, tokenizers, aiohttp, prometheus-client, but not pyzmq,
# fastapi, starlette, uvicorn, pydantic (+ pydantic-core, annotated-types, typing-inspection, typing-extensions),
# opentelemetry-api or ijson (the server's large request bodies; ijson==3.6.0 takes --platform manylinux_2_17_x86_64):
# download their cp312 manylinux wheels into .whl/ (git-ignored) with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl NAME==VER
# PD runs through sglang-router (benchmark/experiments/pd_bench.sh) also need sglang-router==0.3.2 (one abi3 wheel, 31 MB:
# add it only for those runs, a call's tree must stay under 64 MiB), orjson and setproctitle. `PYSPY=1` serving
# runs (benchmark/experiments/overlap_ab.sh) need py-spy's wheel (py_spy-0.4.3, 3 MB) there too.
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PWD:/tmp/site" || exit 1
else
  export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
