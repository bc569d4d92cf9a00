#!/usr/bin/env bash
# Device check for a CUDA machine with no network; finishes in well under 8 minutes.
#   1. kernel tests, GPU ones included (compiled Triton kernels in fp32/bf16/fp16 against
#      dense SDPA and the torch reference; flash-attn's when it is installed);
#   2. every other test marked gpu;
#   3. kernel timing against dense torch SDPA on the same shapes: a table, printed last.
# Uses the machine's python3 (PYTHON=... to override), which must hold torch with CUDA,
# triton and pytest. Files land in $OUT (or /tmp/stencil-gpu-check). Exit status: non-zero
# if any step failed; every step runs regardless.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${OUT:-/tmp/stencil-gpu-check}
mkdir -p "$RESULTS"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
failed=()

echo "== device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'gpu', torch.cuda.is_available())" || exit 1

echo "== 1. kernel tests (GPU tests included)"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rs tests/kernels/test_kernels_triton.py \
    tests/kernels/test_kernels_flash.py tests/kernels/test_kernels_torch.py 2>&1 | tee "$RESULTS/kernel_tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("kernel tests")

echo "== 2. other gpu tests"
# Only the files that mark a test gpu: collecting the rest would import the server's packages
# (litestar, msgspec, jsonschema, ...), which a bare CUDA machine lacks.
others=$(grep -l "mark.gpu" tests/test_*.py | grep -v -e test_kernels_triton.py \
    -e test_kernels_flash.py -e test_kernels_torch.py || true)
if [ -n "$others" ]; then
    timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m gpu $others 2>&1 | tee "$RESULTS/gpu_tests.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("gpu tests")
else
    echo "no other file marks a test gpu" | tee "$RESULTS/gpu_tests.txt"
fi

echo "== 3. kernel timing"
timeout 240 "$PY" -m stencil.benchmarks.kernel_timing --json "$RESULTS/kernel_timing.json" \
    2>&1 | tee "$RESULTS/kernel_timing.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("kernel timing")

status=0
if [ "${#failed[@]}" -gt 0 ]; then
    echo "== FAILED: ${failed[*]}"
    status=1
else
    echo "== gpu check passed"
fi
sed -n '/median ms/,$p' "$RESULTS/kernel_timing.txt"
exit "$status"
