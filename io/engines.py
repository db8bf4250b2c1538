"""I/O engines: the same bytes on disk from both.

* :class:`PosixEngine` — ``os.pwritev`` / ``os.preadv`` from the store's worker threads. A piece
  may be a list of tensors written/read back to back (vectored I/O straight from and into the
  caller's memory: the LMCache plugin moves chunks this way without a conversion copy). O_DIRECT
  (bypassing the page cache) when the file offset and size are 4096-aligned and the file system
  accepts it: in place when every buffer is aligned, through an aligned bounce buffer otherwise;
  the page cache when the offset or size is unaligned (or on tmpfs).
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
from typing import Sequence, Union

import torch

__all__ = ["PosixEngine", "KvikioEngine", "make_engine", "kvikio_status", "ALIGN", "aligned_empty"]

ALIGN = 4096
# O_DIRECT bounce buffer for unaligned caller memory, per worker thread. 8 MiB: large enough that
# the disk sees big requests, small enough to stay in cache for the memcpy.
BOUNCE = 8 << 20
# buffers per pwritev/preadv call (Linux IOV_MAX)
try:
    IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))
except (ValueError, OSError, AttributeError):  # pragma: no cover - non-Linux
    IOV_MAX = 1024


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A 1-D uint8 CPU tensor whose data starts on a 4096-byte boundary (O_DIRECT / GDS ready)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skew = (-raw.data_ptr()) % ALIGN
    return raw[skew : skew + nbytes]


def _host_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU uint8 tensor (no copy)."""
    mv = memoryview(t.numpy())
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _aligned(*vals: int) -> bool:
    return all(v % ALIGN == 0 for v in vals)


# What an engine writes at one file offset: a 1-D uint8 tensor, or a list of them back to back.
Piece = Union[torch.Tensor, Sequence[torch.Tensor]]


def _segments(data: Piece) -> list[torch.Tensor]:
    return [data] if isinstance(data, torch.Tensor) else list(data)


def _flatten(pieces: list[tuple[int, Piece]]) -> list[tuple[int, torch.Tensor]]:
    """``(offset, tensor)`` per segment: the segments of a piece follow each other in the file."""
    out = []
    for off, data in pieces:
        for t in _segments(data):
            out.append((off, t))
            off += t.numel()
    return out


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
    def _rw_all(fd: int, mvs: list[memoryview], offset: int, *, write: bool) -> None:
        """``pwritev``/``preadv`` all of ``mvs`` (consecutive in the file) at ``offset``.

        Partial transfers resume where they stopped; at most ``IOV_MAX`` buffers per call.
        """
        mvs = [m for m in mvs if len(m)]
        while mvs:
            batch = mvs[:IOV_MAX]
            n = (os.pwritev if write else os.preadv)(fd, batch, offset)
            if n <= 0:
                if write:
                    raise OSError(errno.EIO, "short write")
                raise EOFError(f"unexpected end of file at offset {offset}")
            offset += n
            while n and mvs:  # drop what was transferred; cut into the first partial buffer
                if n >= len(mvs[0]):
                    n -= len(mvs.pop(0))
                else:
                    mvs[0] = mvs[0][n:]
                    n = 0

    @classmethod
    def _pwrite_all(cls, fd: int, mv: memoryview, offset: int) -> None:
        cls._rw_all(fd, [mv], offset, write=True)

    @classmethod
    def _pread_all(cls, fd: int, mv: memoryview, offset: int) -> None:
        cls._rw_all(fd, [mv], offset, write=False)

    def _direct(self, fd: int, segs: list[tuple[memoryview, int]], off: int, *, write: bool) -> None:
        """O_DIRECT transfer of the segments ``(view, address)`` (consecutive in the file) at ``off``.

        When every segment's address and length are 4096-aligned, one vectored call moves them
        in place (no copy); otherwise their bytes go through the aligned bounce buffer in
        ``BOUNCE``-sized pieces (the total and ``off`` must be aligned).
        """
        if all(a % ALIGN == 0 and len(m) % ALIGN == 0 for m, a in segs):
            self._rw_all(fd, [m for m, _ in segs], off, write=write)
            return
        bounce = self._bounce()
        total = sum(len(m) for m, _ in segs)
        k, pos = 0, 0  # current segment and the position inside it
        for p in range(0, total, BOUNCE):
            n = min(BOUNCE, total - p)
            if not write:
                self._pread_all(fd, bounce[:n], off + p)
            filled = 0
            while filled < n:
                m = segs[k][0]
                take = min(len(m) - pos, n - filled)
                if write:
                    bounce[filled : filled + take] = m[pos : pos + take]
                else:
                    m[pos : pos + take] = bounce[filled : filled + take]
                filled += take
                pos += take
                if pos == len(m):
                    k, pos = k + 1, 0
            if write:
                self._pwrite_all(fd, bounce[:n], off + p)

    # -- API used by the store
    def write_file(self, path: str, pieces: list[tuple[int, Piece]], *, fsync: bool = True) -> None:
        """Create ``path`` and write each ``(file_offset, data)``; fsync before closing.

        ``data``: a 1-D uint8 tensor, or a list of them written back to back (a vectored write:
        ``pwritev`` straight from the tensors, no gathering copy when they are aligned).
        """
        fds = {False: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)}  # O_EXCL: never overwrite
        try:
            host = [(off, [t if t.device.type == "cpu" else t.cpu() for t in _segments(data)]) for off, data in pieces]
            self._move(path, os.O_WRONLY, host, fds, write=True)
            if fsync:
                os.fsync(fds[False])
        finally:
            for f in fds.values():
                if f is not None:
                    os.close(f)

    def read_into(self, path: str, pieces: list[tuple[int, Piece]]) -> None:
        """Read each ``(file_offset, data)``: ``len(data)`` bytes at the offset into ``data``.

        ``data``: a 1-D uint8 tensor or a list of them filled back to back (a vectored read:
        ``preadv`` straight into the tensors, no scattering copy when they are aligned).
        """
        fds: dict = {}
        try:
            host, back = [], []  # CUDA memory: read into aligned (pinned) host memory, then copy
            for off, data in pieces:
                segs = _segments(data)
                if any(t.device.type != "cpu" for t in segs):
                    tmp = aligned_empty(sum(t.numel() for t in segs), pin=torch.cuda.is_available())
                    host.append((off, [tmp]))
                    back.append((tmp, segs))
                else:
                    host.append((off, segs))
            self._move(path, os.O_RDONLY, host, fds, write=False)
            for tmp, segs in back:
                p = 0
                for t in segs:
                    t.copy_(tmp[p : p + t.numel()])
                    p += t.numel()
        finally:
            for f in fds.values():
                if f is not None:
                    os.close(f)

    def _move(self, path: str, flags: int, pieces, fds: dict, *, write: bool) -> None:
        """The body of :meth:`write_file` / :meth:`read_into`: each piece (host tensors, back to
        back at a file offset) goes O_DIRECT when its offset and size are 4096-aligned and the file
        system allows it, through the page cache otherwise. ``fds`` caches the descriptors
        (``True``: O_DIRECT, ``False``: buffered), opened on first use; the caller closes them."""
        for off, segs in pieces:
            mvs = [(_host_view(t), t.data_ptr()) for t in segs]
            total = sum(len(m) for m, _ in mvs)
            dfd = None
            if _aligned(off, total):
                if True not in fds:
                    fds[True] = self._open_direct(path, flags)
                dfd = fds[True]
            if dfd is not None:
                self._direct(dfd, mvs, off, write=write)
            else:
                if False not in fds:
                    fds[False] = os.open(path, flags)
                self._rw_all(fds[False], [m for m, _ in mvs], off, write=write)

    def write_header(self, path: str, data: bytes, *, fsync: bool = True) -> None:
        """Write ``data`` (a multiple of 4096 bytes) at offset 0 of the existing ``path``, then
        ``fdatasync`` it (data and the size/allocation metadata needed to read it back).

        O_DIRECT from an aligned copy when the file system allows it: the entry never has a
        dirty page-cache page beside its O_DIRECT body, so the sync has no extra page to flush.
        """
        fd = self._open_direct(path, os.O_WRONLY) if len(data) % ALIGN == 0 else None
        if fd is None:
            fd = os.open(path, os.O_WRONLY)
            mv = memoryview(data)
        else:
            b = getattr(self._tls, "hdr", None)
            if b is None or len(b) < len(data):
                b = self._tls.hdr = mmap.mmap(-1, max(len(data), ALIGN))  # page aligned
            mv = memoryview(b)[: len(data)]
            mv[:] = data
        try:
            self._pwrite_all(fd, mv, 0)
            if fsync:
                os.fdatasync(fd)
        finally:
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
        self._posix = PosixEngine()

    def write_header(self, path: str, data: bytes, *, fsync: bool = True) -> None:
        """The header is small host memory: written by the POSIX engine's O_DIRECT path."""
        self._posix.write_header(path, data, fsync=fsync)

    @staticmethod
    def _buf(t: torch.Tensor):
        if t.device.type == "cuda":
            return t  # __cuda_array_interface__ (uint8 has one)
        return t.numpy()

    def write_file(self, path: str, pieces: list[tuple[int, Piece]], *, fsync: bool = True) -> None:
        f = self._kvikio.CuFile(path, "w")
        try:
            futs = [f.pwrite(self._buf(t), t.numel(), o) for o, t in _flatten(pieces)]
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

    def read_into(self, path: str, pieces: list[tuple[int, Piece]]) -> None:
        f = self._kvikio.CuFile(path, "r")
        try:
            futs = [(f.pread(self._buf(t), t.numel(), o), t.numel()) for o, t in _flatten(pieces)]
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
            raise RuntimeError(f"`engine`: 'kvikio' is not importable: {st['reason']} (pip install kvikio-cu13, or '.[gpu]' from a kvkernels checkout)")
        return KvikioEngine()
    if torch.cuda.is_available() and kvikio_status()["importable"]:
        return KvikioEngine()
    return PosixEngine()
