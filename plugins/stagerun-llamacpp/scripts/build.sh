#!/usr/bin/env bash
# Build what the llama.cpp plugin needs, once, into the working tree's .cache/ (git-ignored):
#   .cache/wheels/llama_cpp_python-0.3.36-*.whl   llama-cpp-python, GGML_NATIVE=OFF
#   .cache/llama.cpp/bin/llama-server               from the sdist's vendored llama.cpp, UI off
# A second run finds both and returns at once.
# Usage: build.sh [PIP COMMAND...]   (default pip; e.g. .venv/bin/python -m pip)
set -euo pipefail
if [ $# -gt 0 ]; then PIP=("$@"); else PIP=(pip); fi
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
CACHE="$ROOT/.cache"
VERSION=0.3.36
# shellcheck source=flags.sh
source "$(dirname "$0")/flags.sh"
mkdir -p "$CACHE/wheels" "$CACHE/sdist" "$CACHE/llama.cpp"
# What was built for other flags (another CPU) is built again.
if [ "$(cat "$CACHE/llama.cpp/flags" 2>/dev/null)" != "$FLAGS" ]; then
    rm -f "$CACHE"/wheels/llama_cpp_python-$VERSION-*.whl "$CACHE/llama.cpp/bin/llama-server"
    echo "$FLAGS" >"$CACHE/llama.cpp/flags"
fi

if ! ls "$CACHE"/wheels/llama_cpp_python-$VERSION-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $VERSION (about 5 minutes on 2 cores)..." >&2
    CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
        "${PIP[@]}" wheel -q --no-cache-dir --no-deps -w "$CACHE/wheels" "llama-cpp-python==$VERSION"
fi

SERVER="$CACHE/llama.cpp/bin/llama-server"
if [ ! -x "$SERVER" ]; then
    echo "building llama-server from llama-cpp-python $VERSION's vendored llama.cpp (about 5 minutes)..." >&2
    if ! ls "$CACHE"/sdist/llama_cpp_python-$VERSION.tar.gz >/dev/null 2>&1; then
        "${PIP[@]}" download -q --no-deps --no-binary :all: -d "$CACHE/sdist" "llama-cpp-python==$VERSION"
    fi
    rm -rf "$CACHE/llama.cpp/src" && mkdir -p "$CACHE/llama.cpp/src"
    tar -xzf "$CACHE"/sdist/llama_cpp_python-$VERSION.tar.gz -C "$CACHE/llama.cpp/src" --strip-components=1
    LOG="$CACHE/llama.cpp/build.log"
    # shellcheck disable=SC2086
    if ! { cmake -S "$CACHE/llama.cpp/src/vendor/llama.cpp" -B "$CACHE/llama.cpp/build" \
            -DCMAKE_BUILD_TYPE=Release $FLAGS -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
            -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            -DBUILD_SHARED_LIBS=OFF \
        && cmake --build "$CACHE/llama.cpp/build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
            --target llama-server; } >"$LOG" 2>&1; then
        tail -40 "$LOG" >&2
        echo "building llama-server failed; the whole log is $LOG" >&2
        exit 1
    fi
    mkdir -p "$CACHE/llama.cpp/bin"
    cp "$CACHE/llama.cpp/build/bin/llama-server" "$SERVER"
    rm -rf "$CACHE/llama.cpp/src" "$CACHE/llama.cpp/build"
fi
echo "$SERVER"
