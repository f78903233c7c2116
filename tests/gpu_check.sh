#!/usr/bin/env bash
# Every GPU check in one run, for a lent CUDA machine (run from the repository root):
#   1. every `gpu`-marked test (CUDA-graph replay, decode kernels in a graph, the server on CUDA),
#   2. the Triton kernel and model tests, which run on CUDA when it is present,
#   3. the HTTP server tests with the shared server on CUDA (HYBRID_SERVE_TEST_DEVICE=cuda),
#   4. benchmarks/kernels.py (kernels vs fla when importable; decode eager vs CUDA-graph replay).
# 1-3 run side by side (small models, one GPU); 4 runs alone so its timings are its own.
# Logs and the benchmark's JSON go to $OUT (default /tmp/gpu-check). Wheels in .whl/ (packages
# the machine lacks, e.g. fastapi/uvicorn/openai, and fla-core for the comparisons with
# flash-linear-attention; never installed on the CPU machines) are installed to /tmp/site first.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD"
fi
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

T=${GPU_CHECK_TIMEOUT:-240}
PYTEST="python3 -m pytest -q -p no:cacheprovider"
timeout "$T" $PYTEST -m gpu tests >"$OUT/gpu_marked.log" 2>&1 &
p1=$!
timeout "$T" $PYTEST tests/kernels/test_triton_kernels.py tests/models/test_triton_model.py \
    >"$OUT/triton.log" 2>&1 &
p2=$!
HYBRID_SERVE_TEST_DEVICE=cuda timeout "$T" $PYTEST tests/server/test_openai.py \
    tests/server/test_native.py >"$OUT/server_cuda.log" 2>&1 &
p3=$!
rc=0
for p in $p1 $p2 $p3; do wait $p || rc=1; done
for f in gpu_marked triton server_cuda; do
    echo "== $f"
    grep -E "passed|failed|error|Error|FAILED" "$OUT/$f.log" | tail -15
done
timeout "${GPU_BENCH_TIMEOUT:-150}" python3 -m benchmarks.kernels --json-out "$OUT/kernels.json" \
    >"$OUT/kernels.log" 2>&1 || rc=1
echo "== kernels"
tail -40 "$OUT/kernels.log"
exit $rc
