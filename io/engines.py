"""I/O engines: the same bytes on disk from both.

* :class:`PosixEngine` — ``os.pwrite`` / ``os.preadv`` from the store's worker threads. O_DIRECT
  (bypassing the page cache) when the buffer address, file offset and size are all 4096-aligned
  and the file system accepts it; the page cache otherwise (tmpfs, unaligned torch buffers).
  Works without a GPU: CI and CPU machines use it. CUDA buffers are staged through host memory.
* :class:`KvikioEngine` — ``kvikio.CuFile`` ``pwrite``/``pread`` futures, which split each
  request into ``KVIKIO_TASK_SIZE`` pieces on kvikio's thread pool; device buffers go to the file
  directly (GPUDirect Storage when the machine has it, kvikio's POSIX compat mode otherwise).
  Needs a CUDA driver: without one every kvikio read/write fails (field notes), so ``auto``
  picks it only when CUDA is available.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

import torch

__all__ = ["PosixEngine", "KvikioEngine", "make_engine", "kvikio_status", "ALIGN", "aligned_empty"]

ALIGN = 4096
# O_DIRECT bounce buffer for unaligned caller memory, per worker thread. 8 MiB: large enough that
# the disk sees big requests, small enough to stay in cache for the memcpy.
BOUNCE = 8 << 20


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A 1-D uint8 CPU tensor whose data starts on a 4096-byte boundary (O_DIRECT / GDS ready)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skew = (-raw.data_ptr()) % ALIGN
    return raw[skew : skew + nbytes]


def _host_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU uint8 tensor (no copy)."""
    return memoryview(t.numpy()).cast("B")


def _aligned(*vals: int) -> bool:
    return all(v % ALIGN == 0 for v in vals)


class PosixEngine:
    """POSIX file I/O; see the module docstring. ``direct``: try O_DIRECT when aligned."""

    name = "posix"

    def __init__(self, *, direct: bool = True):
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._direct_ok: dict[str, bool] = {}  # per directory: does the FS accept O_DIRECT?
        self._tls = threading.local()

    def _bounce(self) -> memoryview:
        b = getattr(self._tls, "buf", None)
        if b is None:
            b = self._tls.buf = mmap.mmap(-1, BOUNCE)  # page aligned
        return memoryview(b)

    # -- helpers
    def _open_direct(self, path: str, flags: int) -> int | None:
        d = os.path.dirname(path)
        if not self.direct or self._direct_ok.get(d) is False:
            return None
        try:
            fd = os.open(path, flags | os.O_DIRECT)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                self._direct_ok[d] = False
                return None
            raise
        self._direct_ok[d] = True
        return fd

    @staticmethod
    def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
        done = 0
        while done < len(mv):
            n = os.pwrite(fd, mv[done:], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            done += n

    @staticmethod
    def _pread_all(fd: int, mv: memoryview, offset: int) -> None:
        done = 0
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], offset + done)
            if n <= 0:
                raise EOFError(f"unexpected end of file at offset {offset + done}")
            done += n

    def _direct(self, fd: int, mv: memoryview, off: int, addr: int, *, write: bool) -> None:
        """O_DIRECT transfer of ``mv`` at ``off``; unaligned memory goes through the bounce buffer."""
        if addr % ALIGN == 0:
            (self._pwrite_all if write else self._pread_all)(fd, mv, off)
            return
        bounce = self._bounce()
        for p in range(0, len(mv), BOUNCE):
            n = min(BOUNCE, len(mv) - p)
            if write:
                bounce[:n] = mv[p : p + n]
                self._pwrite_all(fd, bounce[:n], off + p)
            else:
                self._pread_all(fd, bounce[:n], off + p)
                mv[p : p + n] = bounce[:n]

    # -- API used by the store
    def write_file(self, path: str, pieces: list[tuple[int, torch.Tensor]], *, fsync: bool = True) -> None:
        """Create ``path`` and write each ``(file_offset, uint8 tensor)``; fsync before closing."""
        host = [(off, t if t.device.type == "cpu" else t.cpu()) for off, t in pieces]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        dfd = None
        try:
            for off, t in host:
                mv = _host_view(t)
                if _aligned(off, len(mv)) and dfd is None:
                    dfd = self._open_direct(path, os.O_WRONLY)
                if dfd is not None and _aligned(off, len(mv)):
                    self._direct(dfd, mv, off, t.data_ptr(), write=True)
                else:
                    self._pwrite_all(fd, mv, off)
            if fsync:
                os.fsync(fd)
        finally:
            if dfd is not None:
                os.close(dfd)
            os.close(fd)

    def read_into(self, path: str, pieces: list[tuple[int, torch.Tensor]]) -> None:
        """Read ``len(t)`` bytes at each ``file_offset`` into each uint8 tensor."""
        fd = os.open(path, os.O_RDONLY)
        dfd = None
        try:
            for off, t in pieces:
                if t.device.type != "cpu":  # CUDA memory: read into aligned pinned memory, then copy
                    host = aligned_empty(t.numel(), pin=torch.cuda.is_available())
                    self.read_into(path, [(off, host)])
                    t.copy_(host)
                    continue
                mv = _host_view(t)
                if _aligned(off, len(mv)) and dfd is None:
                    dfd = self._open_direct(path, os.O_RDONLY)
                if dfd is not None and _aligned(off, len(mv)):
                    self._direct(dfd, mv, off, t.data_ptr(), write=False)
                else:
                    self._pread_all(fd, mv, off)
        finally:
            if dfd is not None:
                os.close(dfd)
            os.close(fd)


def kvikio_status() -> dict:
    """kvikio importability, compat mode and whether GPUDirect Storage is active (no I/O done)."""
    try:
        import kvikio
        import kvikio.defaults
    except Exception as exc:
        return {"importable": False, "reason": f"{type(exc).__name__}: {exc}"}
    d: dict = {"importable": True, "version": getattr(kvikio, "__version__", None)}
    try:
        d["compat_mode"] = str(kvikio.defaults.get("compat_mode"))
    except Exception as exc:  # pragma: no cover - depends on the kvikio version
        d["compat_mode"] = f"unknown ({type(exc).__name__})"
    try:  # reading the cuFile driver's properties opens the driver: only with CUDA present
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA driver")
        import kvikio.cufile_driver

        d["gds_available"] = bool(kvikio.cufile_driver.properties.is_gds_available)
    except Exception as exc:
        d["gds_available"] = False
        d["gds_reason"] = f"{type(exc).__name__}: {exc}"
    return d


class KvikioEngine:
    """kvikio CuFile engine (GPU machines); see the module docstring."""

    name = "kvikio"

    def __init__(self):
        import kvikio  # noqa: F401  (fails here if kvikio is missing)

        self._kvikio = kvikio

    @staticmethod
    def _buf(t: torch.Tensor):
        if t.device.type == "cuda":
            return t  # __cuda_array_interface__ (uint8 has one)
        return t.numpy()

    def write_file(self, path: str, pieces: list[tuple[int, torch.Tensor]], *, fsync: bool = True) -> None:
        f = self._kvikio.CuFile(path, "w")
        try:
            futs = [f.pwrite(self._buf(t), t.numel(), off) for off, t in pieces]
            for fu in futs:
                fu.get()
        finally:
            f.close()
        if fsync:  # kvikio does not fsync
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def read_into(self, path: str, pieces: list[tuple[int, torch.Tensor]]) -> None:
        f = self._kvikio.CuFile(path, "r")
        try:
            futs = [(f.pread(self._buf(t), t.numel(), off), t.numel()) for off, t in pieces]
            for fu, n in futs:
                got = fu.get()
                if got != n:
                    raise EOFError(f"short read: {got} of {n} bytes")
        finally:
            f.close()


def make_engine(engine: str):
    """``auto`` -> kvikio when CUDA is available and kvikio imports, else POSIX."""
    if not isinstance(engine, str) or engine not in ("auto", "posix", "kvikio"):
        raise ValueError(f"`engine`: expected 'auto', 'posix' or 'kvikio', got {engine!r}")
    if engine == "posix":
        return PosixEngine()
    if engine == "kvikio":
        if not torch.cuda.is_available():
            raise RuntimeError("`engine`: 'kvikio' needs a CUDA driver (every kvikio I/O fails without one); use 'posix'")
        st = kvikio_status()
        if not st["importable"]:
            raise RuntimeError(f"`engine`: 'kvikio' is not importable: {st['reason']} (pip install kvkernels[gpu])")
        return KvikioEngine()
    if torch.cuda.is_available() and kvikio_status()["importable"]:
        return KvikioEngine()
    return PosixEngine()
