#!/usr/bin/env bash
# Build what the llama.cpp plugin needs, once, into the working tree's .cache/ (git-ignored):
#   .cache/wheels/llama_cpp_python-0.3.36-*.whl   llama-cpp-python, GGML_NATIVE=OFF
#   .cache/llama.cpp/bin/llama-server               from the sdist's vendored llama.cpp, UI off
#   .cache/llama.cpp/bin/ggml-rpc-server            llama.cpp's RPC split (`bench serve --compare-rpc`)
# llama.cpp is compiled once for all three (shared libraries, RPC on, about 7 minutes on 2
# cores): the wheel is built without its own compile and the libraries are put into it, and
# the servers find the same libraries beside them. A second run finds them and returns.
# Why a compile at all: no wheel on PyPI ships llama-cpp-python's libraries prebuilt, and the
# plugin needs llama.cpp's C API (its per-layer hook), which the prebuilt llama.cpp wheels
# (xllamacpp) do not expose.
# Usage: build.sh [PIP COMMAND...]   (default pip; e.g. .venv/bin/python -m pip)
set -euo pipefail
if [ $# -gt 0 ]; then PIP=("$@"); else PIP=(pip); fi
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
CACHE="$ROOT/.cache"
VERSION=0.3.36
LIBS="libggml-base.so libggml-cpu.so libggml-rpc.so libggml.so libllama.so libmtmd.so"
# The flags that work on these CPUs. Not GGML_NATIVE (its AMX code crashes on these CPUs):
# AVX2 always, AVX-512 where the CPU has it (a build with it dies of SIGILL on an AVX2-only
# CPU, AMD Zen 3 say). RPC on, for llama.cpp's own split.
FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
if grep -qw avx512f /proc/cpuinfo; then FLAGS="$FLAGS -DGGML_AVX512=ON"; fi
if grep -qw avx512_vnni /proc/cpuinfo; then FLAGS="$FLAGS -DGGML_AVX512_VNNI=ON"; fi
FLAGS="$FLAGS -DGGML_RPC=ON"
mkdir -p "$CACHE/wheels" "$CACHE/sdist" "$CACHE/llama.cpp"
# What was built for other flags (another CPU) is built again.
if [ "$(cat "$CACHE/llama.cpp/flags" 2>/dev/null)" != "$FLAGS" ]; then
    rm -rf "$CACHE"/wheels/llama_cpp_python-$VERSION-*.whl "$CACHE/llama.cpp/bin"
    echo "$FLAGS" >"$CACHE/llama.cpp/flags"
fi
SERVER="$CACHE/llama.cpp/bin/llama-server"
RPC_SERVER="$CACHE/llama.cpp/bin/ggml-rpc-server"
if ls "$CACHE"/wheels/llama_cpp_python-$VERSION-*.whl >/dev/null 2>&1 && [ -x "$SERVER" ] \
        && [ -x "$RPC_SERVER" ]; then
    echo "$SERVER"
    exit 0
fi

if ! ls "$CACHE"/sdist/llama_cpp_python-$VERSION.tar.gz >/dev/null 2>&1; then
    "${PIP[@]}" download -q --no-deps --no-binary :all: -d "$CACHE/sdist" "llama-cpp-python==$VERSION"
fi
SDIST="$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz"
WORK="$CACHE/llama.cpp/work"
rm -rf "$WORK" && mkdir -p "$WORK/src"
tar -xzf "$SDIST" -C "$WORK/src" --strip-components=1

echo "building llama.cpp $VERSION's vendored sources: libraries and servers (about 7 minutes on 2 cores)..." >&2
LOG="$CACHE/llama.cpp/build.log"
# shellcheck disable=SC2086
if ! { cmake -S "$WORK/src/vendor/llama.cpp" -B "$WORK/build" \
        -DCMAKE_BUILD_TYPE=Release $FLAGS -DBUILD_SHARED_LIBS=ON \
        -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON \
    && cmake --build "$WORK/build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
        --target llama mtmd llama-server ggml-rpc-server; } >"$LOG" 2>&1; then
    tail -40 "$LOG" >&2
    echo "building llama.cpp failed; the whole log is $LOG" >&2
    exit 1
fi
# copy_built NAME FOLDER: the file the build made under NAME, into FOLDER (links followed)
copy_built() {
    local found
    found=$(find "$WORK/build" -name "$1" | head -1)
    if [ -z "$found" ]; then
        echo "the build made no $1; the log is $LOG" >&2
        exit 1
    fi
    cp -L "$found" "$2/$1"
}
mkdir -p "$WORK/lib"
for lib in $LIBS; do
    # each under its file name and its soname (what the others ask the loader for)
    copy_built "$lib" "$WORK/lib"
    soname=$(objdump -p "$WORK/lib/$lib" | awk '/SONAME/ {print $2}')
    if [ -n "$soname" ] && [ "$soname" != "$lib" ]; then copy_built "$soname" "$WORK/lib"; fi
done

echo "building the llama-cpp-python $VERSION wheel around those libraries..." >&2
rm -rf "$WORK/wheel" && mkdir -p "$WORK/wheel"
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" \
    "${PIP[@]}" wheel -q --no-cache-dir --no-deps -w "$WORK/wheel" "$SDIST"
python3 - "$WORK/wheel" "$WORK/lib" "$CACHE/wheels" <<'EOF'
"""Put the libraries into the wheel under llama_cpp/lib/, and their lines into its RECORD."""
import base64, hashlib, pathlib, sys, zipfile

wheel_dir, lib_dir, out_dir = map(pathlib.Path, sys.argv[1:])
(source,) = wheel_dir.glob("llama_cpp_python-*.whl")
target = out_dir / source.name
with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zout:
    record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
    lines = zin.read(record_name).decode().splitlines()
    for item in zin.infolist():
        if item.filename != record_name:
            zout.writestr(item, zin.read(item.filename))
    for lib in sorted(lib_dir.iterdir()):
        data = lib.read_bytes()
        name = f"llama_cpp/lib/{lib.name}"
        info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
        info.external_attr = 0o755 << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{name},sha256={digest},{len(data)}")
    zout.writestr(record_name, "\n".join(lines) + "\n")
print(target)
EOF

mkdir -p "$CACHE/llama.cpp/bin"
cp "$WORK/lib"/* "$CACHE/llama.cpp/bin/"
copy_built llama-server "$CACHE/llama.cpp/bin"
copy_built ggml-rpc-server "$CACHE/llama.cpp/bin"
# and the servers' own libraries (llama-server's implementation is one), found through $ORIGIN
for _ in 1 2 3 4; do  # what they need, then what that needs
    for lib in $(ldd "$SERVER" "$RPC_SERVER" | awk '/not found/ {print $1}' | sort -u); do
        copy_built "$lib" "$CACHE/llama.cpp/bin"
    done
done
if ldd "$SERVER" "$RPC_SERVER" | grep -q "not found" || ! "$SERVER" --version >/dev/null 2>&1; then
    echo "the built servers do not run: ldd $SERVER $RPC_SERVER" >&2
    exit 1
fi
rm -rf "$WORK"
echo "$SERVER"
