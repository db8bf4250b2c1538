"""Loader and launchers of the CUDA C++ backend (csrc/, a C ABI loaded with ctypes).

The library is found, in order: ``KVKERNELS_CUDA_LIB`` (a path: then only it), the copy shipped in the package
(``KVKERNELS_BUILD_CUDA=1 pip install .``), the cache directory (``KVKERNELS_CACHE_DIR``). When
none exists and CUDA plus nvcc are present, it is built just in time into the cache directory
(a message says so; ~3 s), in a folder keyed by a hash of the sources, one file per toolchain
(nvcc, CUTLASS) in it. ``KVKERNELS_CUDA_LIB``, when set, is the only library tried. Everything is lazy and
cached; :func:`available` never raises.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from . import config

log = logging.getLogger("kvkernels")
LIB = "libkvkernels_cuda.so"
_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
# csrc/bindings/capi.cu kvk_abi_version(): 2 added the fp8 / shuffle entry points, 3 the SM90 bulk
# copy, 4 kvk_probe (the runtime it links can run here)
ABI_VERSION = 4


def _csrc_dir(here: str | None = None) -> str | None:
    """The csrc/ sources: ``kvkernels/csrc`` of an installed package, else the checkout's
    ``csrc/`` beside ``pyproject.toml`` (an installed package once looked at ``../csrc`` first:
    ``site-packages/csrc/build.py`` of another project would have been run)."""
    here = here or os.path.dirname(os.path.abspath(__file__))
    up = os.path.dirname(here)
    cands = [os.path.join(here, "csrc")]
    if os.path.isfile(os.path.join(up, "pyproject.toml")):
        cands.append(os.path.join(up, "csrc"))
    for d in cands:
        if os.path.isfile(os.path.join(d, "build.py")):
            return os.path.abspath(d)
    return None


def _incomplete(path: str) -> str | None:
    """Why ``path`` is not a whole ELF shared library (None: it is). A truncated library (a
    build's rename on disk before its data, then a crash; a disk that filled) passes dlopen,
    which maps it, and the process dies of SIGBUS when it touches the missing pages: measured
    with a cached build cut to 1-3.4 of its 3.5 MB. The tables at the end of the file say how
    long it must be."""
    import struct

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return f"not a 64-bit little-endian ELF file ({size} bytes)"
    phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
    need = max(phoff + phnum * phentsize, shoff + max(shnum, 1 if shoff else 0) * shentsize)
    if size < need:
        return f"truncated: {size} bytes, its ELF tables end at {need}"
    return None


@functools.lru_cache(maxsize=None)
def _build_module():
    """csrc/build.py as a module, or None where the sources are not shipped."""
    src = _csrc_dir()
    if src is None:
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvk_csrc_build", os.path.join(src, "build.py"))
    assert spec is not None and spec.loader is not None  # (a .py file path always has a source loader)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _jit_dir() -> str | None:
    """Just-in-time builds go to a folder named after the C-ABI version and a hash of the sources
    (csrc/build.py ``source_key``): a build of older sources is never picked up. In it, one file
    per toolchain (``jit_lib_name``): a process with nvcc loads or builds its own, one without
    loads the newest. None without the sources."""
    mod = _build_module()
    if mod is None:
        return None
    return os.path.join(config.cache_dir(), f"cuda-abi{ABI_VERSION}-{mod.source_key()}")


def _jit_library(mod, jit: str) -> str | None:
    """The just-in-time build to load from ``jit``: with nvcc, this toolchain's own file (None:
    build it); without, the newest build there (any toolchain: this process cannot build)."""
    if mod.nvcc() is not None:
        own = os.path.join(jit, mod.jit_lib_name())
        return own if os.path.isfile(own) else None
    import glob

    builds = glob.glob(os.path.join(jit, "libkvkernels_cuda.*.so"))
    return max(builds, key=os.path.getmtime) if builds else None


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ctypes.CDLL | None, str]:
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    env = config.env_str("KVKERNELS_CUDA_LIB", "").strip()  # blank: unset, as every variable
    if env:  # asked for by path: that library or none (never silently another one)
        if not os.path.isfile(env):
            return None, f"`KVKERNELS_CUDA_LIB`: {env!r} is not a file"
        # absolute: dlopen looks a name without a slash up on LD_LIBRARY_PATH, not in the cwd
        # where isfile found it (another libkvkernels_cuda.so there was loaded instead)
        path: str | None = os.path.abspath(env)
    else:
        shipped = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lib", LIB)
        path = shipped if os.path.isfile(shipped) else None
        jit = _jit_dir()
        if path is None and jit is not None:
            path = _jit_library(_build_module(), jit)
            bad = _incomplete(path) if path is not None else None
            if bad is not None and _build_module().nvcc() is not None:  # this toolchain's own: built anew
                log.warning("kvkernels: the cached CUDA backend %s is %s; building it again", path, bad)
                path = None
    if path is None:
        mod = _build_module()
        if mod is None:
            return None, "the library is not built and csrc/ is not available to build it"
        if mod.nvcc() is None:
            return None, "the library is not built and nvcc is not available"
        log.warning("kvkernels: building the CUDA backend into %s (first use with this toolchain)", _jit_dir())
        try:
            path = mod.build(_jit_dir(), lib_name=mod.jit_lib_name())
        except Exception as exc:
            return None, f"build failed: {exc}"
    bad = _incomplete(path)
    if bad is not None:
        return None, f"{path}: {bad} (delete it, or rebuild with python csrc/build.py)"
    try:
        lib = ctypes.CDLL(path)
        version = lib.kvk_abi_version()
    except OSError as exc:
        return None, f"cannot load {path}: {exc}"
    except AttributeError:
        return None, f"{path}: not a kvkernels CUDA library (no kvk_abi_version)"
    if version != ABI_VERSION:
        return None, (f"{path}: ABI version {version}, expected {ABI_VERSION} "
                      "(a stale build: delete it or rebuild with python csrc/build.py)")
    _declare(lib)
    if lib.kvk_probe() != 0:  # e.g. built with a newer toolkit than the driver supports
        return None, f"{path}: its CUDA runtime cannot run here: {lib.kvk_last_error().decode()}"
    return lib, path


def _declare(lib) -> None:
    """ctypes signatures of the C ABI (csrc/bindings/capi.cu)."""
    lib.kvk_last_error.restype = ctypes.c_char_p
    lib.kvk_probe.restype = _int
    lib.kvk_probe.argtypes = []
    lib.kvk_paged_copy.restype = _int
    lib.kvk_paged_copy.argtypes = [_int, _ptr, _ptr, _int, _ptr, _ptr] + [_i64] * 14 + [_int, ctypes.c_size_t]
    lib.kvk_bulk_copy.restype = _int
    lib.kvk_bulk_copy.argtypes = [_int, _ptr, _ptr, _int, _ptr, _ptr] + [_i64] * 13 + [_int, ctypes.c_size_t]
    lib.kvk_features.restype = _int
    for fn in (lib.kvk_quant_gather, lib.kvk_dequant_scatter):
        fn.restype = _int
        fn.argtypes = [_ptr, _ptr, _int, _ptr, _ptr] + [_i64] * 14 + [_int] * 3 + [_i64, _int, ctypes.c_size_t]
    lib.kvk_shuffle_copy.restype = _int
    lib.kvk_shuffle_copy.argtypes = [_int, _ptr, _ptr, _int, _ptr, _ptr] + [_i64] * 12 + [_int, _i64, _int,
                                                                                          ctypes.c_size_t]


def available() -> bool:
    return _load()[0] is not None


def reason() -> str:
    """Why the backend is unavailable (or the library path when it is)."""
    return _load()[1]


def bulk_supported() -> bool:
    """The loaded library has the SM90 bulk-copy path (built with the CUTLASS headers)."""
    lib, _ = _load()
    return lib is not None and bool(lib.kvk_features() & 1)


def _staging_on_device(layout, staging: torch.Tensor) -> bool:
    # bulk copies need device memory on a compute capability >= 9.0 GPU (not pinned host via UVA)
    return staging.is_cuda and torch.cuda.get_device_capability(layout.device) >= (9, 0)


def _use_bulk(layout, staging: torch.Tensor) -> bool:
    """``KVKERNELS_CUDA_BULK=1`` and the case fits the bulk path (docs/csrc.md)."""
    return (config.cuda_bulk() and layout.is_contiguous_chunk() and layout.access_width(staging.data_ptr()) == 16
            and bulk_supported() and _staging_on_device(layout, staging))


def _paged_plan(to_staging: bool, layout, fmt, staging: torch.Tensor, max_ctas: int) -> tuple:
    """The launch arguments that do not change from call to call (everything but the ids, the
    error counter and the stream), kept per layout keyed by values (on every layer's path)."""
    ptr = staging.data_ptr()
    bulk_env = config.cuda_bulk()
    key = ("paged", to_staging, fmt, ptr, staging.is_cuda, max_ctas, bulk_env)
    plan = layout.memo_get("cuda_launch", key)
    if plan is None:
        tab = layout.pointer_table_for(fmt.layers)
        sb, sn, sh = layout.byte_strides
        dev = layout.device.index if layout.device.index is not None else torch.cuda.current_device()
        shape = (fmt.num_blocks, layout.num_blocks, fmt.num_kv, fmt.num_regions, layout.num_heads,
                 layout.block_size * layout.num_heads, layout.row_nbytes, sb, sn, sh, fmt.region_nbytes,
                 fmt.entry_nbytes)
        bulk = _use_bulk(layout, staging)  # reads the switch itself (bulk_env keys the plan)
        tail = (max_ctas, dev) if bulk else (layout.access_width(ptr), max_ctas, dev)
        plan = layout.memo_put("cuda_launch", key, (bulk, tab.data_ptr(), ptr, shape, tail))
    return plan


def _raw_stream(device: torch.device) -> int:
    """The handle of the current stream on ``device``: ``torch._C._cuda_getCurrentRawStream``, the
    call Triton's launcher makes, not ``torch.cuda.current_stream(device)``, whose device-index
    resolution cost more than the launch itself on the pipeline's path (cProfile on the H100,
    2026-11-23: 192 launches, 192 ``current_stream`` calls, the largest share after the launch)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return get(idx) if get is not None else torch.cuda.current_stream(idx).cuda_stream


def _paged_copy(to_staging: bool, layout, block_ids: torch.Tensor, fmt, staging: torch.Tensor, err: torch.Tensor,
                max_ctas: int) -> None:
    lib, _ = _load()
    if lib is None:
        raise RuntimeError(f"`backend`: 'cuda' is not available: {reason()}")
    if fmt.num_blocks == 0 or fmt.num_regions == 0:
        return
    bulk, tab, ptr, shape, tail = _paged_plan(to_staging, layout, fmt, staging, max_ctas)
    stream = _raw_stream(layout.device)
    fn = lib.kvk_bulk_copy if bulk else lib.kvk_paged_copy
    rc = fn(int(to_staging), tab, block_ids.data_ptr(), int(block_ids.dtype == torch.int64), ptr, err.data_ptr(),
            *shape, *tail, stream)
    if rc != 0:
        raise RuntimeError(f"kvkernels CUDA backend: {lib.kvk_last_error().decode(errors='replace')}")


def gather_cuda(layout, block_ids, fmt, out, err, max_ctas: int = 0):
    """Same contract as ``triton_ops.gather_triton``."""
    _paged_copy(True, layout, block_ids, fmt, out, err, max_ctas)
    if fmt.num_blocks and fmt.payload_nbytes < fmt.region_nbytes:
        out[: fmt.nbytes].view(fmt.num_regions, fmt.region_nbytes)[:, fmt.payload_nbytes :].zero_()
    return out


def scatter_cuda(staging, layout, block_ids, fmt, err, max_ctas: int = 0) -> None:
    """Same contract as ``triton_ops.scatter_triton``."""
    _paged_copy(False, layout, block_ids, fmt, staging, err, max_ctas)


# ------------------------------------------------------------------- fp8 and byte-plane shuffle
_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _vec16(layout, staging_ptr: int) -> int:
    """1 when 16-byte accesses are legal on both sides (every base address, byte stride and row,
    the staging address, and head_dim): the kernels' vectorized variant."""
    return int(layout.access_width(staging_ptr) == 16 and layout.head_dim % 16 == 0)


def _launch_args(layout, block_ids, fmt, staging):
    lib, _ = _load()
    if lib is None:
        raise RuntimeError(f"`backend`: 'cuda' is not available: {reason()}")
    tab = layout.pointer_table_for(fmt.layers)
    sb, sn, sh = layout.byte_strides
    dev = layout.device.index if layout.device.index is not None else torch.cuda.current_device()
    stream = _raw_stream(layout.device)
    head = [tab.data_ptr(), block_ids.data_ptr(), int(block_ids.dtype == torch.int64), staging.data_ptr()]
    shape = [fmt.num_blocks, layout.num_blocks, fmt.num_kv, fmt.num_regions, layout.num_heads, layout.block_size,
             layout.head_dim, sb, sn, sh]
    return lib, tab, head, shape, dev, stream


def _raise(lib, rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"kvkernels CUDA backend: {lib.kvk_last_error().decode(errors='replace')}")


def _fp8(gather: bool, layout, block_ids, fmt, staging, err, max_ctas: int) -> None:
    if fmt.num_blocks == 0 or fmt.num_regions == 0:
        return
    lib, _tab, head, shape, dev, stream = _launch_args(layout, block_ids, fmt, staging)
    fn = lib.kvk_quant_gather if gather else lib.kvk_dequant_scatter
    rc = fn(*head, err.data_ptr(), *shape, fmt.region_nbytes, fmt.q_entry_nbytes, fmt.num_kv * fmt.q_entry_nbytes,
            fmt.scale_entry_nbytes, _KINDS[layout.dtype], int(fmt.granularity == "block"),
            _vec16(layout, staging.data_ptr()), max_ctas, dev, stream)
    _raise(lib, rc)


def quant_gather_cuda(layout, block_ids, fmt, out, err, max_ctas: int = 0):
    """Same contract as ``triton_ops.quant_gather.quant_gather_triton``."""
    _fp8(True, layout, block_ids, fmt, out, err, max_ctas)
    if fmt.num_blocks and fmt.num_regions:
        regions = out[: fmt.nbytes].view(fmt.num_regions, fmt.region_nbytes)
        for a, b in fmt.gaps():
            regions[:, a:b].zero_()
    return out


def dequant_scatter_cuda(staging, layout, block_ids, fmt, err, max_ctas: int = 0) -> None:
    """Same contract as ``triton_ops.dequant_scatter.dequant_scatter_triton``."""
    _fp8(False, layout, block_ids, fmt, staging, err, max_ctas)


def _shuffle(to_staging: bool, layout, block_ids, fmt, staging, err, max_ctas: int) -> None:
    if fmt.num_blocks == 0 or fmt.num_regions == 0:
        return
    lib, _tab, head, shape, dev, stream = _launch_args(layout, block_ids, fmt, staging)
    rc = lib.kvk_shuffle_copy(int(to_staging), *head, err.data_ptr(), *shape, fmt.region_nbytes, fmt.entry_nbytes,
                              _vec16(layout, staging.data_ptr()), max_ctas, dev, stream)
    _raise(lib, rc)


def shuffle_gather_cuda(layout, block_ids, fmt, out, err, max_ctas: int = 0):
    """Same contract as ``triton_ops.shuffle_gather.shuffle_gather_triton``."""
    _shuffle(True, layout, block_ids, fmt, out, err, max_ctas)
    if fmt.num_blocks and fmt.payload_nbytes < fmt.region_nbytes:
        out[: fmt.nbytes].view(fmt.num_regions, fmt.region_nbytes)[:, fmt.payload_nbytes :].zero_()
    return out


def unshuffle_scatter_cuda(staging, layout, block_ids, fmt, err, max_ctas: int = 0) -> None:
    """Same contract as ``triton_ops.unshuffle_scatter.unshuffle_scatter_triton``."""
    _shuffle(False, layout, block_ids, fmt, staging, err, max_ctas)
