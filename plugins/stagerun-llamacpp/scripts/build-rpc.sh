#!/usr/bin/env bash
# Build llama.cpp's RPC split, once, for `stagerun bench serve --compare-rpc`:
#   .cache/llama.cpp/rpc/bin/llama-server      the same vendored llama.cpp as build.sh's, with RPC
#   .cache/llama.cpp/rpc/bin/ggml-rpc-server   one per stage of the split
# Not part of `make test` (about 8 minutes on 2 cores). A second run finds both and returns.
# Usage: build-rpc.sh [PIP COMMAND...]   (default pip: fetches the llama-cpp-python sdist)
set -euo pipefail
if [ $# -gt 0 ]; then PIP=("$@"); else PIP=(pip); fi
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
CACHE="$ROOT/.cache"
VERSION=0.3.36
# shellcheck source=flags.sh
source "$(dirname "$0")/flags.sh"
FLAGS="$FLAGS -DGGML_RPC=ON"
OUT="$CACHE/llama.cpp/rpc"
mkdir -p "$OUT" "$CACHE/sdist"
if [ "$(cat "$OUT/flags" 2>/dev/null)" != "$FLAGS" ]; then
    rm -rf "$OUT/bin"
    echo "$FLAGS" >"$OUT/flags"
fi
if [ -x "$OUT/bin/llama-server" ] && [ -x "$OUT/bin/ggml-rpc-server" ]; then
    echo "$OUT/bin"
    exit 0
fi
echo "building llama-server and ggml-rpc-server with RPC from llama-cpp-python $VERSION's" \
    "vendored llama.cpp (about 8 minutes)..." >&2
if ! ls "$CACHE"/sdist/llama_cpp_python-$VERSION.tar.gz >/dev/null 2>&1; then
    "${PIP[@]}" download -q --no-deps --no-binary :all: -d "$CACHE/sdist" "llama-cpp-python==$VERSION"
fi
SRC="$OUT/src"
rm -rf "$SRC" "$OUT/build" && mkdir -p "$SRC"
tar -xzf "$CACHE"/sdist/llama_cpp_python-$VERSION.tar.gz -C "$SRC" --strip-components=1
LOG="$OUT/build.log"
# shellcheck disable=SC2086
if ! { cmake -S "$SRC/vendor/llama.cpp" -B "$OUT/build" \
        -DCMAKE_BUILD_TYPE=Release $FLAGS -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DBUILD_SHARED_LIBS=OFF \
    && cmake --build "$OUT/build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
        --target llama-server ggml-rpc-server; } >"$LOG" 2>&1; then
    tail -40 "$LOG" >&2
    echo "building llama.cpp with RPC failed; the whole log is $LOG" >&2
    exit 1
fi
mkdir -p "$OUT/bin"
cp "$OUT/build/bin/llama-server" "$OUT/build/bin/ggml-rpc-server" "$OUT/bin/"
rm -rf "$SRC" "$OUT/build"
echo "$OUT/bin"
