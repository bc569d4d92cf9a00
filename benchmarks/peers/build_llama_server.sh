#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sources vendored in the llama-cpp-python sdist.
#
#   benchmarks/peers/build_llama_server.sh            # prints the binary's path on its last line
#   benchmarks/peers/build_llama_server.sh --options  # prints the ISA options it would use, builds nothing
#   benchmarks/peers/build_llama_server.sh --test-backend-ops  # also builds llama.cpp's kernel benchmark
#                                                     # (`stencil bench rows`); prints its path
#
# It builds llama-quantize beside it (same bin/ folder): the reference quantizer that turns an
# F16/F32 GGUF into k-quants for the GGUF benchmarks (`python -m stencil.benchmarks.gguf_models`).
#
# Nothing of llama.cpp enters the repository: the sdist is fetched with pip (PyPI, the only
# registry this machine reaches), unpacked and built under $PEERS_DIR (default
# ~/.cache/stencil/peers). A finished build is reused: run it again and it only prints the path.
#
# Which instruction sets: by default GGML_NATIVE=OFF with the x86 options this CPU's
# /proc/cpuinfo flags allow (AVX, AVX2, FMA, F16C, BMI2, AVX512, AVX512-VBMI, AVX512-VNNI,
# AVX512-BF16, AVX-VNNI) and **AMX off**. Why not native: llama.cpp 0.3.36 built with
# GGML_NATIVE=ON on an AMX Xeon segfaults in ggml_backend_amx_mul_mat at its warm-up decode, on
# every model (FACTS.md), so a native build cannot be benchmarked there; on a CPU without AMX the
# explicit flags give the same kernels as a native build. LLAMA_BUILD=native builds the native
# configuration instead (LLAMA_BUILD=explicit is the default). Each configuration has its own
# build folder (build-VERSION-native / build-VERSION-<flags digest>), and writes BUILD_INFO
# beside the binary: the configuration and the cmake options, which `stencil bench peers` puts in
# its report. About 8-12 minutes on 2 idle cores.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PEERS_DIR="${PEERS_DIR:-${STENCIL_CACHE_DIR:-$HOME/.cache/stencil}/peers}"
JOBS="${JOBS:-$(nproc)}"
MODE="${LLAMA_BUILD:-explicit}"
SRC="$PEERS_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
read -r -a PIP_CMD <<< "${PIP:-pip}"  # e.g. PIP="python -m pip"

# The ggml x86 options this CPU's flags allow (cpuinfo flag -> cmake option).
cpu_options() {
    local flags
    flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    local pair flag opt
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 avx512vbmi:AVX512_VBMI \
                avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
        flag="${pair%%:*}"
        opt="${pair##*:}"
        if [[ "$flags" == *" $flag "* ]]; then echo "-DGGML_$opt=ON"; else echo "-DGGML_$opt=OFF"; fi
    done
    echo "-DGGML_AMX_TILE=OFF"
    echo "-DGGML_AMX_INT8=OFF"
    echo "-DGGML_AMX_BF16=OFF"
}

case "$MODE" in
    native)
        ISA_OPTIONS=(-DGGML_NATIVE=ON)
        TAG=native ;;
    explicit)
        mapfile -t ISA_OPTIONS < <(echo "-DGGML_NATIVE=OFF"; cpu_options)
        TAG="$(printf '%s\n' "${ISA_OPTIONS[@]}" | sha1sum | cut -c1-10)" ;;
    *)
        echo "LLAMA_BUILD must be 'explicit' or 'native', not '$MODE'" >&2
        exit 2 ;;
esac
if [[ "${1:-}" == "--options" ]]; then
    printf '%s\n' "${ISA_OPTIONS[@]}"
    exit 0
fi
BUILD="$PEERS_DIR/build-$VERSION-$TAG"
BIN="$BUILD/bin/llama-server"
TARGETS=(llama-server llama-quantize)
if [[ "${1:-}" == "--test-backend-ops" ]]; then
    TARGETS+=(test-backend-ops)
    BIN="$BUILD/bin/test-backend-ops"
fi

if [[ -x "$BIN" && -x "$BUILD/bin/llama-quantize" && -f "$BUILD/bin/BUILD_INFO" ]]; then
    echo "$BIN"
    exit 0
fi
mkdir -p "$PEERS_DIR"
SDIST="$PEERS_DIR/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    echo "[peers] fetching the llama-cpp-python $VERSION sdist" >&2
    "${PIP_CMD[@]}" download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$PEERS_DIR" >&2
fi
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    tar xzf "$SDIST" -C "$PEERS_DIR"
fi
echo "[peers] building llama-server ($MODE: ${ISA_OPTIONS[*]}; $JOBS jobs) in $BUILD" >&2
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF "${ISA_OPTIONS[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >&2
cmake --build "$BUILD" --target "${TARGETS[@]}" -j "$JOBS" >&2
test -x "$BIN" && test -x "$BUILD/bin/llama-server" && test -x "$BUILD/bin/llama-quantize"
{
    echo "llama-cpp-python $VERSION"
    echo "build $MODE"
    printf '%s\n' "${ISA_OPTIONS[@]}"
} > "$BUILD/bin/BUILD_INFO"
echo "$BIN"
