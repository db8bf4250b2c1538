"""The few CUDA runtime calls of the pipeline's per-layer path, called directly (ctypes).

Why: issuing one layer through torch's Python API (``Event.record``, ``Stream.wait_event``, a
stream context and a sliced ``Tensor.copy_`` per DMA) cost 190-640 us of host time per layer on
the H100 host (2026-11-23), where issue 4 asks for <= 50 us; each of these is one runtime call of
~1 us underneath. :class:`LayerPipeline` uses this module with ``stream_api="cudart"``
(``KVKERNELS_PIPELINE_STREAM_API``); torch's API stays the default until the GPU benchmark shows
the difference (``docs/pipeline.md``).

The library is the CUDA runtime torch itself loaded (opened by its soname ``libcudart.so.<torch's
CUDA major>`` with ``RTLD_NOLOAD``, else the one of that major found in ``/proc/self/maps``), so
streams and events are torch's own handles (``Stream.cuda_stream``, ``Event.cuda_event``) in the same runtime
instance. Every call's status is checked; a failure raises ``RuntimeError`` with the runtime's
message.
"""

from __future__ import annotations

import ctypes
import functools
import os

__all__ = ["Runtime", "load", "reason"]

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: sources read in stream order


class _MemLocation(ctypes.Structure):  # struct cudaMemLocation (driver_types.h)
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``struct cudaMemcpyAttributes`` (driver_types.h, CUDA >= 12.8): the one attribute every
    copy of the pipeline's batches uses (sources read in stream order, no location hints)."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


class Runtime:
    """Checked wrappers of ``cudaEventRecord``, ``cudaStreamWaitEvent``, ``cudaMemcpyAsync`` and
    ``cudaMemcpyBatchAsync`` (where the runtime has it: :attr:`batch_reason` says why not) over a loaded runtime library (``lib``: a ``ctypes.CDLL`` or anything with those attributes)."""

    def __init__(self, lib, path: str = "?"):
        self.lib, self.path = lib, path
        lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaEventRecord.restype = ctypes.c_int
        lib.cudaStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        lib.cudaStreamWaitEvent.restype = ctypes.c_int
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetLastError.argtypes = []
        lib.cudaGetLastError.restype = ctypes.c_int
        self._record, self._wait, self._memcpy = lib.cudaEventRecord, lib.cudaStreamWaitEvent, lib.cudaMemcpyAsync
        self.version = self._runtime_version()
        self.driver_version = self._runtime_version("cudaDriverGetVersion")
        self._batch, self.batch_reason = self._bind_batch()

    def _runtime_version(self, name: str = "cudaRuntimeGetVersion") -> int:
        """``cudaRuntimeGetVersion`` (or ``cudaDriverGetVersion``) as e.g. 13000; 0 if unknown."""
        fn = getattr(self.lib, name, None)
        if fn is None:
            return 0
        fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
        fn.restype = ctypes.c_int
        v = ctypes.c_int(0)
        return v.value if fn(ctypes.byref(v)) == 0 else 0

    def _bind_batch(self):
        """``cudaMemcpyBatchAsync`` with the signature of this runtime's version: CUDA 12.8/12.9
        take a ``size_t *failIdx`` before the stream, CUDA 13 dropped it. ``(callable, "")`` or
        ``(None, why not)``."""
        fn = getattr(self.lib, "cudaMemcpyBatchAsync", None)
        if fn is None or self.version < 12080:
            return None, f"cudaMemcpyBatchAsync needs CUDA >= 12.8 (this runtime: {self.version or 'unknown'})"
        if 0 < self.driver_version < 12080:  # a newer runtime on an older driver (minor-version compatibility)
            return None, f"cudaMemcpyBatchAsync needs a driver for CUDA >= 12.8 (this driver: {self.driver_version})"
        p = ctypes.c_void_p
        self._attr = MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
        self._attr_idx = ctypes.c_size_t(0)
        self._fail_idx = ctypes.c_size_t(0)
        # pointer objects made once (on every layer's path)
        self._attr_p, self._attr_idx_p = ctypes.pointer(self._attr), ctypes.pointer(self._attr_idx)
        self._fail_idx_p = ctypes.pointer(self._fail_idx)
        if self.version >= 13000:
            fn.argtypes = [p, p, p, ctypes.c_size_t, ctypes.POINTER(MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t),
                           ctypes.c_size_t, p]
        else:
            fn.argtypes = [p, p, p, ctypes.c_size_t, ctypes.POINTER(MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t),
                           ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), p]
        fn.restype = ctypes.c_int
        return fn, ""

    def clear_error(self) -> None:
        """A failed runtime call also sets the thread's last error: cleared, or the next unrelated
        torch kernel launch (which reads it) would report that failure as its own."""
        self.lib.cudaGetLastError()

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            self.clear_error()
            msg = self.lib.cudaGetErrorString(rc)
            raise RuntimeError(f"kvkernels pipeline: {what} failed: {msg.decode(errors='replace') if msg else rc}")

    def record(self, event: int, stream: int) -> None:
        """``cudaEventRecord(event, stream)`` (handles as ints)."""
        if not event:
            raise RuntimeError("kvkernels pipeline: an event without a CUDA handle (record it once first)")
        self._check(self._record(event, stream), "cudaEventRecord")

    def wait(self, stream: int, event: int) -> None:
        """``cudaStreamWaitEvent(stream, event, 0)``: a stream wait, not a host wait."""
        if not event:
            raise RuntimeError("kvkernels pipeline: an event without a CUDA handle (record it once first)")
        self._check(self._wait(stream, event, 0), "cudaStreamWaitEvent")

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """``cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream)``: asynchronous for
        pinned host <-> device (the pipeline's pool and slots)."""
        self._check(self._memcpy(dst, src, nbytes, _MEMCPY_DEFAULT, stream), "cudaMemcpyAsync")


    def memcpy_batch(self, dsts: int, srcs: int, sizes: int, count: int, stream: int) -> None:
        """``cudaMemcpyBatchAsync`` of ``count`` copies on ``stream`` (not the legacy default
        stream: the runtime rejects it): ``dsts``, ``srcs`` and ``sizes`` are addresses of host
        arrays of ``count`` 64-bit values (pointers, pointers, byte counts), read during the call.
        One attribute for all copies: sources read in stream order (after the work queued before
        it). Copy-engine DMA only: no SM runs it."""
        if self._batch is None:
            raise RuntimeError(f"kvkernels pipeline: {self.batch_reason}")
        if count <= 0:
            return
        if self.version >= 13000:
            rc = self._batch(dsts, srcs, sizes, count, self._attr_p, self._attr_idx_p, 1, stream)
        else:
            rc = self._batch(dsts, srcs, sizes, count, self._attr_p, self._attr_idx_p, 1, self._fail_idx_p, stream)
        self._check(rc, f"cudaMemcpyBatchAsync of {count} copies")


def _loaded_cudart(maps: str = "/proc/self/maps", major: str | None = None) -> str | None:
    """Path of a CUDA runtime library mapped into this process, or None; with ``major``, one of
    that major version (``libcudart.so.<major>``) is preferred: the CUDA backend's library may
    have mapped another toolkit's runtime beside torch's."""
    found: list[str] = []
    try:
        with open(maps) as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if os.path.basename(path).startswith("libcudart.so") and path not in found:
                    found.append(path)
    except OSError:
        return None
    if major:
        for path in found:
            if os.path.basename(path).startswith(f"libcudart.so.{major}"):
                return path
    return found[0] if found else None


def _open_torch_cudart(major: str | None):
    """``(CDLL, path)`` of the runtime torch loaded, by its soname with ``RTLD_NOLOAD`` (returns
    only a library already in the process), or None."""
    if not major:
        return None
    name = f"libcudart.so.{major}"
    try:
        return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_NOW), name
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def _load() -> tuple[Runtime | None, str]:
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA device"
    torch.cuda.init()  # torch loads its runtime here at the latest
    major = (torch.version.cuda or "").split(".")[0] or None
    opened = _open_torch_cudart(major)
    if opened is None:
        path = _loaded_cudart(major=major)
        if path is None:
            return None, "torch's CUDA runtime library (libcudart.so) is not mapped in this process"
        try:
            opened = ctypes.CDLL(path), path
        except OSError as exc:
            return None, f"cannot use {path}: {exc}"
    try:
        return Runtime(*opened), opened[1]
    except AttributeError as exc:
        return None, f"cannot use {opened[1]}: {exc}"


def load() -> Runtime | None:
    """The runtime wrapper, or None (see :func:`reason`)."""
    return _load()[0]


def reason() -> str:
    """Why :func:`load` returns None (or the library's path)."""
    return _load()[1]
