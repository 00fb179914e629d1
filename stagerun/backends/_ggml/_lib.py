"""The ggml C library, loaded from the ``libggml-python`` wheel through cffi in ABI mode.

The wheel ships ggml's shared libraries and headers, no Python API. cffi's ABI mode calls
them from a declaration of the functions used (`CDEF`, written from the wheel's own
``ggml.h``, ``ggml-alloc.h``, ``ggml-backend.h`` and ``ggml-cpu.h``) without compiling
anything, and checks nothing by itself: so `load` refuses a library of another version, or
whose ``struct ggml_tensor`` is not the one declared here, before anything is called.

The build in the wheel needs AVX2, FMA and F16C on x86 (it has no fallback and would die of
an illegal instruction); `unavailable` says why ggml cannot run here, or None.

``STAGERUN_GGML_LIBRARY`` (`LIBRARY_ENV`) names another build's ``libggml.so`` instead: one
compiled for this CPU (llama.cpp's, with AVX-512 and llamafile's kernels, computes a step
5-11% faster here than the wheel's; docs/deployment.md). It must be a release whose API, as
far as `CDEF` declares it, is the wheel's (`COMPATIBLE_VERSIONS`), and a build with
llamafile's kernels is refused for what those kernels would compute differently at one row
and at several (`check_row_kernels`).
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import platform
from typing import Any, Final

__all__ = [
    "COMPATIBLE_VERSIONS",
    "GGML_VERSION",
    "LIBRARY_ENV",
    "GgmlUnavailableError",
    "check_row_kernels",
    "load",
    "openmp",
    "unavailable",
]

GGML_VERSION: Final = "0.20.2"
"""The ggml release the declarations below were written from (``libggml-python`` 0.20.2.*)."""

COMPATIBLE_VERSIONS: Final = frozenset({GGML_VERSION, "0.25.3"})
"""The releases `LIBRARY_ENV` may name: 0.25.3 (llama.cpp's build in ``make test``) declares
every function and struct of `CDEF` as 0.20.2 does (its headers compared, 2026-12-06)."""

LIBRARY_ENV: Final = "STAGERUN_GGML_LIBRARY"
"""The environment variable naming a ggml build's ``libggml.so`` to load instead of the
wheel's; its folder must hold ``libggml-base.so.0`` and ``libggml-cpu.so.0`` beside it."""

TENSOR_SIZE: Final = 336  # sizeof(struct ggml_tensor) in 0.20.2
TENSOR_OVERHEAD: Final = 368  # ggml_tensor_overhead(): the tensor and its object header

# Types as ggml numbers them (enum ggml_type).
F32, F16, I32, I64, BF16 = 0, 1, 26, 27, 30
ROPE_NORMAL, ROPE_NEOX = 0, 2

CDEF: Final = """
typedef uint16_t ggml_fp16_t;
struct ggml_context;
struct ggml_cgraph;
struct ggml_backend_buffer;
struct ggml_backend_buffer_type;
struct ggml_backend;
struct ggml_gallocr;
typedef struct ggml_backend_buffer * ggml_backend_buffer_t;
typedef struct ggml_backend_buffer_type * ggml_backend_buffer_type_t;
typedef struct ggml_backend * ggml_backend_t;
typedef struct ggml_gallocr * ggml_gallocr_t;
typedef bool (*ggml_abort_callback)(void * data);

struct ggml_init_params {
    size_t mem_size;
    void * mem_buffer;
    bool   no_alloc;
};

struct ggml_tensor {
    int type;
    struct ggml_backend_buffer * buffer;
    int64_t ne[4];
    size_t  nb[4];
    int op;
    int32_t op_params[16];
    int32_t flags;
    struct ggml_tensor * src[10];
    struct ggml_tensor * view_src;
    size_t view_offs;
    void * data;
    char name[64];
    void * extra;
    char padding[8];
};

const char * ggml_version(void);
const char * ggml_commit(void);
const char * ggml_type_name(int type);
size_t ggml_type_size(int type);
int64_t ggml_blck_size(int type);
size_t ggml_row_size(int type, int64_t ne);
size_t ggml_nbytes(const struct ggml_tensor * tensor);
size_t ggml_tensor_overhead(void);
size_t ggml_graph_overhead_custom(size_t size, bool grads);

struct ggml_context * ggml_init(struct ggml_init_params params);
void ggml_free(struct ggml_context * ctx);

struct ggml_tensor * ggml_new_tensor_1d(struct ggml_context * ctx, int type, int64_t ne0);
struct ggml_tensor * ggml_new_tensor_2d(
    struct ggml_context * ctx, int type, int64_t ne0, int64_t ne1);
struct ggml_tensor * ggml_new_tensor_3d(
    struct ggml_context * ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2);
struct ggml_tensor * ggml_new_tensor_4d(
    struct ggml_context * ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
void ggml_set_input(struct ggml_tensor * tensor);
void ggml_set_output(struct ggml_tensor * tensor);

struct ggml_tensor * ggml_add(
    struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_mul(
    struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_scale(struct ggml_context * ctx, struct ggml_tensor * a, float s);
struct ggml_tensor * ggml_tanh(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_swiglu(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_geglu(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_swiglu_split(
    struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_geglu_split(
    struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_rms_norm(struct ggml_context * ctx, struct ggml_tensor * a, float eps);
struct ggml_tensor * ggml_mul_mat(
    struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_set_rows(
    struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b,
    struct ggml_tensor * c);
struct ggml_tensor * ggml_cont_2d(
    struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1);
struct ggml_tensor * ggml_cont_3d(
    struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2);
struct ggml_tensor * ggml_concat(
    struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b, int dim);
struct ggml_tensor * ggml_reshape_2d(
    struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1);
struct ggml_tensor * ggml_reshape_3d(
    struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2);
struct ggml_tensor * ggml_view_2d(
    struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
    size_t nb1, size_t offset);
struct ggml_tensor * ggml_view_3d(
    struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2,
    size_t nb1, size_t nb2, size_t offset);
struct ggml_tensor * ggml_view_4d(
    struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2,
    int64_t ne3, size_t nb1, size_t nb2, size_t nb3, size_t offset);
struct ggml_tensor * ggml_permute(
    struct ggml_context * ctx, struct ggml_tensor * a, int axis0, int axis1, int axis2,
    int axis3);
struct ggml_tensor * ggml_transpose(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_get_rows(
    struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_soft_max_ext(
    struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * mask, float scale,
    float max_bias);
struct ggml_tensor * ggml_flash_attn_ext(
    struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
    struct ggml_tensor * v, struct ggml_tensor * mask, float scale, float max_bias,
    float logit_softcap);
struct ggml_tensor * ggml_rope_ext(
    struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b,
    struct ggml_tensor * c, int n_dims, int mode, int n_ctx_orig, float freq_base,
    float freq_scale, float ext_factor, float attn_factor, float beta_fast, float beta_slow);

struct ggml_cgraph * ggml_new_graph_custom(struct ggml_context * ctx, size_t size, bool grads);
void ggml_build_forward_expand(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
int ggml_graph_n_nodes(struct ggml_cgraph * cgraph);

ggml_backend_buffer_t ggml_backend_cpu_buffer_from_ptr(void * ptr, size_t size);
ggml_backend_buffer_type_t ggml_backend_cpu_buffer_type(void);
void ggml_backend_buffer_free(ggml_backend_buffer_t buffer);
int ggml_backend_tensor_alloc(
    ggml_backend_buffer_t buffer, struct ggml_tensor * tensor, void * addr);
void ggml_backend_tensor_set(
    struct ggml_tensor * tensor, const void * data, size_t offset, size_t size);
void ggml_backend_tensor_get(
    const struct ggml_tensor * tensor, void * data, size_t offset, size_t size);
void ggml_backend_free(ggml_backend_t backend);
int ggml_backend_graph_compute(ggml_backend_t backend, struct ggml_cgraph * cgraph);

ggml_gallocr_t ggml_gallocr_new(ggml_backend_buffer_type_t buft);
void ggml_gallocr_free(ggml_gallocr_t galloc);
bool ggml_gallocr_alloc_graph(ggml_gallocr_t galloc, struct ggml_cgraph * graph);
size_t ggml_gallocr_get_buffer_size(ggml_gallocr_t galloc, int buffer_id);

ggml_backend_t ggml_backend_cpu_init(void);
void ggml_backend_cpu_set_use_ref(ggml_backend_t backend_cpu, bool use_ref);
void ggml_backend_cpu_set_n_threads(ggml_backend_t backend_cpu, int n_threads);
struct ggml_threadpool_params {
    bool     cpumask[512];
    int      n_threads;
    int      prio;
    uint32_t poll;
    bool     strict_cpu;
    bool     paused;
};
struct ggml_threadpool;
struct ggml_threadpool_params ggml_threadpool_params_default(int n_threads);
struct ggml_threadpool * ggml_threadpool_new(struct ggml_threadpool_params * params);
void ggml_threadpool_free(struct ggml_threadpool * threadpool);
void ggml_backend_cpu_set_threadpool(ggml_backend_t backend_cpu, struct ggml_threadpool * pool);
void ggml_backend_cpu_set_abort_callback(
    ggml_backend_t backend_cpu, ggml_abort_callback abort_callback, void * abort_callback_data);
size_t strlen(const char * s);
int ggml_cpu_has_avx2(void);
int ggml_cpu_has_fma(void);
int ggml_cpu_has_f16c(void);
int ggml_cpu_has_llamafile(void);

size_t ggml_quantize_chunk(
    int type, const float * src, void * dst, int64_t start, int64_t nrows, int64_t n_per_row,
    const float * imatrix);
"""

_X86_FLAGS: Final = ("avx2", "fma", "f16c")


class GgmlUnavailableError(RuntimeError):
    """ggml cannot run here; the message says why (and the backend is not offered)."""


def _cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


@functools.cache
def unavailable() -> str | None:
    """Why the ggml backend cannot run on this machine, or None when it can."""
    try:
        load()
    except GgmlUnavailableError as exc:
        return str(exc)
    return None


@functools.cache
def load() -> tuple[Any, Any]:
    """``(ffi, lib)``: the ggml library, its version and struct layout checked.

    Raises:
        GgmlUnavailableError: the wheel or cffi is missing, this is not a Linux x86-64 CPU
            with AVX2, FMA and F16C, or the library is not ggml `GGML_VERSION` (one of
            `COMPATIBLE_VERSIONS` for a build `LIBRARY_ENV` names).
    """
    if os.environ.get("STAGERUN_NO_GGML"):
        raise GgmlUnavailableError("STAGERUN_NO_GGML is set")
    machine = platform.machine().lower()
    if platform.system() != "Linux" or machine not in ("x86_64", "amd64"):
        raise GgmlUnavailableError(
            f"the ggml backend is built for Linux x86-64, not {platform.system()} {machine}"
        )
    flags = _cpu_flags()
    missing = [f for f in _X86_FLAGS if f not in flags]
    if missing:
        raise GgmlUnavailableError(
            f"this CPU lacks {', '.join(m.upper() for m in missing)}, which the prebuilt ggml needs"
        )
    own = os.environ.get(LIBRARY_ENV)
    where = _own_folder(own) if own else _wheel_folder()
    try:
        import cffi
    except ImportError:
        raise GgmlUnavailableError("cffi is not installed (pip install cffi)") from None
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    try:
        path = _private_copy(where)
        lib = ffi.dlopen(str(path), ffi.RTLD_NOW | ffi.RTLD_LOCAL | ffi.RTLD_DEEPBIND)
    except OSError as exc:
        raise GgmlUnavailableError(f"the ggml libraries in {where} do not load: {exc}") from None
    _bind_every_name(lib, where)
    version = ffi.string(lib.ggml_version()).decode()
    if own and version not in COMPATIBLE_VERSIONS:
        raise GgmlUnavailableError(
            f"{LIBRARY_ENV} names ggml {version}; stagerun declares the API of ggml "
            f"{', '.join(sorted(COMPATIBLE_VERSIONS))}"
        )
    if not own and version != GGML_VERSION:
        raise GgmlUnavailableError(
            f"libggml-python holds ggml {version}; stagerun declares ggml {GGML_VERSION}'s API "
            f"(pip install 'libggml-python=={GGML_VERSION}.*')"
        )
    layout = (ffi.sizeof("struct ggml_tensor"), lib.ggml_tensor_overhead())
    if layout != (TENSOR_SIZE, TENSOR_OVERHEAD):
        raise GgmlUnavailableError(
            f"ggml's struct ggml_tensor is not the declared one (size, overhead {layout}, "
            f"expected {(TENSOR_SIZE, TENSOR_OVERHEAD)})"
        )
    if not (lib.ggml_cpu_has_avx2() and lib.ggml_cpu_has_fma() and lib.ggml_cpu_has_f16c()):
        raise GgmlUnavailableError("the ggml CPU library was built without AVX2, FMA or F16C")
    _OPENMP[id(lib)] = b"libgomp.so" in (path.parent / _private(_SONAMES[2])).read_bytes()
    if _OPENMP[id(lib)]:
        logging.getLogger(__name__).warning(
            "%s=%s is a ggml built with OpenMP, whose threads spin against the other stages "
            "of a host: fine for one stage per host, slower for several (docs/models.md); "
            "cmake -DGGML_OPENMP=OFF builds one without",
            LIBRARY_ENV,
            own,
        )
    return ffi, lib


_OPENMP: dict[int, bool] = {}


def openmp(lib: Any) -> bool:
    """Whether ``lib`` (from `load`) runs a graph's threads as an OpenMP team (`_omp`)."""
    return _OPENMP[id(lib)]


def check_row_kernels(lib: Any, matrices: dict[str, int], *, flash: bool) -> None:
    """Refuse what ``lib`` would compute differently for a row alone and among others.

    A build with llamafile's kernels multiplies by a matrix of two rows and more with them,
    and by one row with ggml's own: for 8-bit blocks (Q8_0, Q4_0, Q5_0 weights) both sum
    alike, bitwise, but not for float weights (F32, F16, BF16), nor for attention scores
    without flash attention (a float16 cache times the queries): there a decode step would
    differ from the same row in a prefill, and batched from solo.

    Args:
        lib: the loaded library (`load`).
        matrices: the type (enum ggml_type) of each weight matrix the stage multiplies by.
        flash: whether the stage attends with flash attention.

    Raises:
        ValueError: ``lib`` has llamafile's kernels, and a matrix is of a float type or
            ``flash`` is off.
    """
    if not lib.ggml_cpu_has_llamafile():
        return
    floats = sorted(name for name, kind in matrices.items() if kind in (F32, F16, BF16))
    if floats:
        what = f"float weights ({', '.join(floats[:3])}{', ...' if len(floats) > 3 else ''})"
    elif not flash:
        what = "attention without flash attention"
    else:
        return
    raise ValueError(
        f"the ggml build {LIBRARY_ENV} names multiplies with llamafile's kernels, whose sums "
        f"for {what} depend on how many rows are computed together (batched and chunked rows "
        f"would not be bitwise the same); unset {LIBRARY_ENV} to use the wheel's ggml"
    )


def _wheel_folder() -> pathlib.Path:
    try:
        import libggml
    except ImportError as exc:
        raise GgmlUnavailableError(
            f"{exc.name} is not installed (pip install 'libggml-python=={GGML_VERSION}.*' cffi)"
        ) from None
    return pathlib.Path(libggml.__file__).parent / "lib64"


def _own_folder(named: str) -> pathlib.Path:
    """The folder of the build `LIBRARY_ENV` names, once it holds the three libraries."""
    path = pathlib.Path(named).expanduser()
    lacking = [s.decode() for s in _SONAMES if not (path.parent / s.decode()).exists()]
    if not path.name.startswith("libggml.so") or not path.exists() or lacking:
        raise GgmlUnavailableError(
            f"{LIBRARY_ENV}={named} is not a shared ggml build's libggml.so beside "
            f"{' and '.join(s.decode() for s in _SONAMES[1:])}"
            + (f" (no {', '.join(lacking)})" if lacking else "")
        )
    return path.parent


def _bind_every_name(lib: Any, where: pathlib.Path) -> None:
    """Look up every name of the cdef in the library now, once.

    cffi binds a dlopen()ed library's names lazily, under a lock of the FFI's own that is not
    reentrant, and binding one creates weak references, which can start a garbage collection,
    which can run a finalizer that frees ggml memory through another name not bound yet: that
    thread then waits for the lock it holds, forever. A stage's compute thread hung so, in the
    middle of a graph's `close`, with a KV cache's finalizer (`_kv._free_buffers`) below it.
    Bound here, a name is a plain attribute afterwards and takes no lock.
    """
    for name in dir(lib):
        try:
            getattr(lib, name)
        except AttributeError as exc:  # declared, but not in the library
            raise GgmlUnavailableError(f"the ggml library in {where} lacks {name}: {exc}") from None


# The sonames of the libraries a ggml build needs (the wheel's, all of them); stagerun's
# private copies carry ``libggmS`` instead of ``libggml`` (the same length, so that the ELF
# string tables can be patched in place).
_SONAMES: Final = (b"libggml.so.0", b"libggml-base.so.0", b"libggml-cpu.so.0")


def _private_copy(where: pathlib.Path) -> pathlib.Path:
    """The build's libraries copied under sonames of their own: the main one's path.

    Packages that ship ggml name its libraries alike (llama-cpp-python's ``libggml-base.so.0``
    is another ggml under the same soname), and the dynamic linker reuses a loaded library
    whose soname matches, whatever the flags: so two ggmls in one process would get one.
    The copies (2.5 MB for the wheel's, in ``$STAGERUN_CACHE/ggml``, made once) name
    themselves and each other ``libggmS...``; loaded with RTLD_DEEPBIND they also bind ggml's
    symbols among themselves, not to another ggml already loaded globally. A build's other
    ggml libraries beside them (llama.cpp's ``libggml-rpc.so.0``, which its ``libggml.so.0``
    links) are copied alike.
    """
    import hashlib

    others = sorted(p.name.encode() for p in where.glob("libggml-*.so.0"))
    sonames = list(dict.fromkeys([*_SONAMES, *others]))
    sources = {soname: (where / soname.decode()).resolve() for soname in sonames}
    digest = hashlib.sha256()
    for path in sources.values():
        digest.update(path.read_bytes())
    root = pathlib.Path(os.environ.get("STAGERUN_CACHE") or "~/.cache/stagerun").expanduser()
    folder = root / "ggml" / digest.hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    for soname, path in sources.items():
        target = folder / _private(soname)
        if target.exists():
            continue
        data = path.read_bytes()
        for old in sonames:
            data = data.replace(old + b"\0", _private(old).encode() + b"\0")
        partial = target.with_name(f".{target.name}.{os.getpid()}")
        partial.write_bytes(data)
        partial.rename(target)  # atomic: a stage starting beside never sees half a file
    # loaded first, the base then the others: the main one's links then find them by soname,
    # whether or not the build looks beside itself for its libraries (RUNPATH $ORIGIN)
    import ctypes

    for soname in [_SONAMES[1], *(s for s in sonames if s not in _SONAMES[:2])]:
        copy = str(folder / _private(soname))
        _LOADED[copy] = _LOADED.get(copy) or ctypes.CDLL(copy, _LOCAL)
    return folder / _private(_SONAMES[0])


_LOADED: dict[str, Any] = {}  # the libraries the main ones link, by path (`_private_copy`)
_LOCAL: Final = os.RTLD_NOW | os.RTLD_LOCAL | os.RTLD_DEEPBIND


def _private(soname: bytes) -> str:
    """The name of a library's private copy: ``libggml-cpu.so.0`` -> ``libggmS-cpu.so.0``."""
    return "libggmS" + soname.decode().removeprefix("libggml")
