#!/usr/bin/env bash
# Every GPU check in one run, for a lent CUDA machine (run from the repository root):
#   1. every `gpu`-marked test (CUDA-graph replay, decode kernels in a graph, the server on CUDA),
#   2. the Triton kernel and model tests (Gated DeltaNet and Mamba2: Qwen3-Next, NemotronH), which
#      run on CUDA when it is present,
#   3. the HTTP server tests with the shared server on CUDA (HYBRID_SERVE_TEST_DEVICE=cuda),
#   4. the FP8 checks: the block GEMM and FP8 experts on CUDA (bf16, a CUDA graph), FP8 kept
#      resident by the default CUDA load (tiny preset: its numbers, logits and tokens beside its
#      bf16 twin), and the memory plan of the 80B-A3B FP8 on one H200 (gpu_scale --dry-run),
#   5. the comparison test against flash-linear-attention (skips without fla-core),
#   6. benchmarks/kernels.py (kernels vs fla when importable; decode eager vs CUDA-graph replay),
#   7. benchmarks/gpu_scale.py (real shapes with dummy weights beside the HBM roofline: qwen3.5-2b,
#      qwen3.5-35b-a3b, nemotron-3-nano-30b-a3b, the 80B-A3B in bf16 (16 layers) and whole in FP8;
#      skipped when HYBRID_SERVE_SKIP_GPU_SCALE is set).
# 1-4 run side by side (small models, one GPU); 5-7 run alone, 6 and 7 so their timings are theirs.
# Logs and the benchmark's JSON go to $OUT (default /tmp/gpu-check). Wheels in .whl/ (packages
# the machine lacks, e.g. fastapi/uvicorn/openai) are installed to /tmp/site first. fla-core (for
# the comparisons with flash-linear-attention; never installed on the CPU machines) goes to its own
# /tmp/site-fla, on the path only for those comparisons: where fla is importable, transformers'
# Qwen3-Next sends the reference model's CPU tensors to fla's Triton kernels, which fail.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD"
pipt() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$@"; }
wheels=$(compgen -G ".whl/*.whl" | grep -v "/fla_core-" || true)
fla_wheels=$(compgen -G ".whl/fla_core-*.whl" || true)
[ -n "$wheels" ] && pipt /tmp/site $wheels && export PYTHONPATH="/tmp/site:$PWD"
FLA_PATH="$PYTHONPATH"
[ -n "$fla_wheels" ] && pipt /tmp/site-fla $fla_wheels && FLA_PATH="/tmp/site-fla:$PYTHONPATH"
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

T=${GPU_CHECK_TIMEOUT:-240}
PYTEST="python3 -m pytest -q -p no:cacheprovider"
timeout "$T" $PYTEST -m gpu tests >"$OUT/gpu_marked.log" 2>&1 &
p1=$!
timeout "$T" $PYTEST tests/kernels/test_triton_kernels.py tests/models/test_triton_model.py \
    tests/kernels/test_mamba2_triton.py tests/models/test_nemotron_h_triton.py \
    >"$OUT/triton.log" 2>&1 &
p2=$!
HYBRID_SERVE_TEST_DEVICE=cuda timeout "$T" $PYTEST tests/server/test_openai.py \
    tests/server/test_native.py >"$OUT/server_cuda.log" 2>&1 &
p3=$!
{ timeout "$T" $PYTEST tests/kernels/test_fp8_kernels.py tests/models/test_fp8_resident.py \
    tests/models/test_fp8.py tests/models/test_fp8_bailing_hybrid.py -rs && timeout "$T" python3 -m benchmarks.gpu_scale --dry-run \
    --out "$OUT/fp8_plan"; } >"$OUT/fp8.log" 2>&1 &
p4=$!
rc=0
for p in $p1 $p2 $p3 $p4; do wait $p || rc=1; done
PYTHONPATH="$FLA_PATH" timeout "$T" $PYTEST tests/kernels/test_triton_kernels.py \
    -k flash_linear_attention -rs >"$OUT/fla.log" 2>&1 || rc=1
for f in gpu_marked triton server_cuda fp8 fla; do
    echo "== $f"
    grep -E "passed|failed|error|Error|FAILED" "$OUT/$f.log" | tail -15
done
grep -A 5 "Memory plan" "$OUT/fp8.log"
PYTHONPATH="$FLA_PATH" timeout "${GPU_BENCH_TIMEOUT:-150}" python3 -m benchmarks.kernels --json-out "$OUT/kernels.json" \
    >"$OUT/kernels.log" 2>&1 || rc=1
echo "== kernels"
tail -40 "$OUT/kernels.log"
if [ -z "${HYBRID_SERVE_SKIP_GPU_SCALE:-}" ] && \
    python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    timeout "${GPU_SCALE_TIMEOUT:-600}" python3 -m benchmarks.gpu_scale --out "$OUT" \
        >"$OUT/gpu_scale.log" 2>&1 || rc=1
    echo "== gpu_scale"
    tail -30 "$OUT/gpu_scale.log"
fi
exit $rc
