"""Every tunable is a ``KVKERNELS_*`` environment variable; docs/config.md lists all of them with
their defaults. Every variable with a value rule has its getter here (:func:`env_problems` checks
them all, for the CLI); a few are read where they are used: ``KVKERNELS_CUDA_LIB``
(``kvkernels/_cuda.py``), ``KVKERNELS_CUTLASS_INCLUDE`` (``csrc/build.py``), ``KVKERNELS_BUILD_CUDA``
(``setup.py``, at install) and ``KVKERNELS_BENCH_DIR`` (the benchmarks).

Values are read when asked for (not cached at import), so tests and servers may set them at any
time before the call that uses them. A malformed value raises ``ValueError`` naming the variable.
"""

from __future__ import annotations

import os

__all__ = ["env_int", "env_str", "env_bool", "backend", "max_ctas", "validate_default", "cache_dir", "cuda_bulk", "io_threads",
           "pipeline_stream_api", "pipeline_copy_mode", "fp8_fma_div", "io_inflight_bytes", "nvcomp_allocator",
           "env_problems"]


def env_str(name: str, default: str) -> str:
    """The variable's value; unset, empty or blank means ``default`` (as for every variable)."""
    raw = os.environ.get(name)
    return default if raw is None or raw.strip() == "" else raw


def env_int(name: str, default: int, *, lo: int | None = None, hi: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        val = int(raw, 10)  # "08" is eight
    except ValueError:
        try:
            val = int(raw, 0)  # 0x10, 0o17, 0b1
        except ValueError:
            raise ValueError(f"`{name}`: expected an integer, got {raw!r}") from None
    if lo is not None and val < lo:
        raise ValueError(f"`{name}`: expected an integer >= {lo}, got {val}")
    if hi is not None and val > hi:
        raise ValueError(f"`{name}`: expected an integer <= {hi}, got {val}")
    return val


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"`{name}`: expected 0/1/true/false, got {raw!r}")


def backend() -> str:
    """``KVKERNELS_BACKEND``: default backend when a call passes ``backend="auto"`` (default auto)."""
    val = env_str("KVKERNELS_BACKEND", "auto").strip().lower()
    if val not in ("auto", "triton", "cuda", "torch"):
        raise ValueError(f"`KVKERNELS_BACKEND`: expected auto|triton|cuda|torch, got {val!r}")
    return val


MAX_CTAS_LIMIT = 2**31 - 1  # a CUDA grid's x limit: a larger cap means "no cap" (it wrapped in the C ABI)


def max_ctas() -> int:
    """``KVKERNELS_MAX_CTAS``: default cap on the copy kernels' grid (0 = one program per chunk)."""
    return env_int("KVKERNELS_MAX_CTAS", 0, lo=0, hi=MAX_CTAS_LIMIT)


def validate_default() -> bool:
    """``KVKERNELS_VALIDATE``: default of ``validate=`` (1). 0 skips the host-side id range check."""
    return env_bool("KVKERNELS_VALIDATE", True)


def cache_dir() -> str:
    """``KVKERNELS_CACHE_DIR``: where compiled artefacts are cached (default ~/.cache/kvkernels)."""
    return env_str("KVKERNELS_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "kvkernels"))


def pipeline_stream_api() -> str:
    """``KVKERNELS_PIPELINE_STREAM_API``: how :class:`kvkernels.pipeline.LayerPipeline` on a GPU
    issues its per-layer event records, stream waits and DMAs: ``torch`` (default, torch's Python
    API) or ``cudart`` (the CUDA runtime called directly: less host time per layer; not yet
    measured on a GPU, docs/pipeline.md)."""
    val = env_str("KVKERNELS_PIPELINE_STREAM_API", "torch").strip().lower()
    if val not in ("torch", "cudart"):
        raise ValueError(f"`KVKERNELS_PIPELINE_STREAM_API`: expected torch|cudart, got {val!r}")
    return val


def pipeline_copy_mode() -> str:
    """``KVKERNELS_PIPELINE_COPY_MODE``: how :class:`kvkernels.pipeline.LayerPipeline` moves a
    layer's blocks: ``gather`` (default: a capped-SM gather into a device slot, then one large
    DMA; restore the reverse) or ``dma`` (one ``cudaMemcpyBatchAsync`` per layer straight between
    the cache's blocks and the host pool: no SM at all; needs contiguous chunks and host block
    ids). Not yet measured on a GPU (docs/pipeline.md)."""
    val = env_str("KVKERNELS_PIPELINE_COPY_MODE", "gather").strip().lower()
    if val not in ("gather", "dma"):
        raise ValueError(f"`KVKERNELS_PIPELINE_COPY_MODE`: expected gather|dma, got {val!r}")
    return val


def cuda_bulk() -> bool:
    """``KVKERNELS_CUDA_BULK``: the CUDA backend copies contiguous chunks with SM90 bulk copies
    (``cp.async.bulk``) instead of 16-byte loads/stores (default 0: on the H100, 2026-11-23, it
    moved 86-96 % of the copy peak with every SM against 96-99 % for the 16-byte kernels; it wins
    only under an SM cap with large chunks, docs/PERF_NOTES.md)."""
    return env_bool("KVKERNELS_CUDA_BULK", False)


def fp8_fma_div() -> bool:
    """``KVKERNELS_FP8_FMA_DIV``: the Triton FP8 quantizing gather on a GPU computes ``x / s`` from
    one reciprocal per row and an FMA correction per element (the same bytes) instead of
    ``div.rn.f32`` per element. Default 1: on the H100 (2026-11-23) the GPU tests passed with it
    (bit-for-bit against torch's ``x / s``) and it ran 2.9-3.7x faster (bench/fp8_tuning.py, no
    byte differing); 0 restores the division (the interpreter always divides)."""
    return env_bool("KVKERNELS_FP8_FMA_DIV", True)


def io_threads() -> int:
    """``KVKERNELS_IO_THREADS``: SSD store worker threads = its queue depth (default 4)."""
    return env_int("KVKERNELS_IO_THREADS", 4, lo=1)


def io_inflight_bytes() -> int:
    """``KVKERNELS_IO_INFLIGHT_BYTES``: bound on bytes of queued store puts (default 1 GiB)."""
    return env_int("KVKERNELS_IO_INFLIGHT_BYTES", 1 << 30, lo=1)


NVCOMP_ALLOCATORS = ("nvcomp", "torch")


def nvcomp_allocator() -> str:
    """``KVKERNELS_NVCOMP_ALLOCATOR``: nvCOMP's scratch allocator, ``nvcomp`` (default) or ``torch``
    (read by ``kvkernels/compress.py`` when nvCOMP runs)."""
    val = env_str("KVKERNELS_NVCOMP_ALLOCATOR", "nvcomp").strip().lower()
    if val not in NVCOMP_ALLOCATORS:
        raise ValueError(f"`KVKERNELS_NVCOMP_ALLOCATOR`: expected one of {NVCOMP_ALLOCATORS}, got {val!r}")
    return val


# every variable with a value rule (the path variables have none: a wrong path shows where it is used)
_CHECKED = (backend, max_ctas, validate_default, pipeline_stream_api, pipeline_copy_mode, cuda_bulk, fp8_fma_div,
            io_threads, io_inflight_bytes, nvcomp_allocator)


def env_problems() -> list[str]:
    """The message of every ``KVKERNELS_*`` variable whose value is malformed (empty: all fine).
    The library reads each one only where it is used (a CPU run never reads the GPU-only ones);
    the CLI checks them all before it starts, so a typo stops a benchmark at once instead of after
    its first measurements, or never if that bench does not read the variable."""
    out = []
    for get in _CHECKED:
        try:
            get()
        except ValueError as exc:
            out.append(str(exc))
    return out
