# The llama.cpp build flags that work on these CPUs, shared by build.sh and build-rpc.sh.
# Not GGML_NATIVE (its AMX code crashes on these CPUs): AVX2 always, AVX-512 where the CPU has
# it (a build with it dies of SIGILL on an AVX2-only CPU, AMD Zen 3 say).
FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
if grep -qw avx512f /proc/cpuinfo; then FLAGS="$FLAGS -DGGML_AVX512=ON"; fi
if grep -qw avx512_vnni /proc/cpuinfo; then FLAGS="$FLAGS -DGGML_AVX512_VNNI=ON"; fi
