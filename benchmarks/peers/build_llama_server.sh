#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sources vendored in the llama-cpp-python sdist.
#
#   benchmarks/peers/build_llama_server.sh            # prints the binary's path on its last line
#
# It builds llama-quantize beside it (same bin/ folder): the reference quantizer that turns an
# F16/F32 GGUF into k-quants for the GGUF benchmarks (`python -m benchmarks.gguf_models`).
#
# Nothing of llama.cpp enters the repository: the sdist is fetched with pip (PyPI, the only
# registry this machine reaches), unpacked and built under $PEERS_DIR (default
# ~/.cache/stencil/peers). A finished build is reused: run it again and it only prints the path.
# GGML_NATIVE=ON compiles for this CPU (AVX512 where it has it), as a user building
# llama.cpp for their own machine would; curl, OpenSSL, the web UI, tests and examples are off
# (the benchmark talks plain HTTP on loopback and needs none of them). About 5 minutes on 2
# idle cores.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PEERS_DIR="${PEERS_DIR:-${STENCIL_CACHE_DIR:-$HOME/.cache/stencil}/peers}"
JOBS="${JOBS:-$(nproc)}"
SRC="$PEERS_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$PEERS_DIR/build-$VERSION"
BIN="$BUILD/bin/llama-server"
read -r -a PIP_CMD <<< "${PIP:-pip}"  # e.g. PIP="python -m pip"

if [[ -x "$BIN" && -x "$BUILD/bin/llama-quantize" ]]; then
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
echo "[peers] building llama-server ($JOBS jobs) in $BUILD" >&2
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >&2
cmake --build "$BUILD" --target llama-server llama-quantize -j "$JOBS" >&2
test -x "$BIN" && test -x "$BUILD/bin/llama-quantize"
echo "$BIN"
