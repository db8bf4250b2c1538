"""I/O engines: the same bytes on disk from both.

* :class:`PosixEngine` — ``os.pwritev`` / ``os.preadv`` from the store's worker threads. A piece
  may be a list of tensors written/read back to back (vectored I/O straight from and into the
  caller's memory: the LMCache plugin moves chunks this way without a conversion copy). O_DIRECT
  (bypassing the page cache) when the file offset and size are 4096-aligned and the file system
  accepts it: in place when every buffer is aligned, through an aligned bounce buffer otherwise;
  the page cache when the offset or size is unaligned (or on tmpfs).
  Works without a GPU: CI and CPU machines use it. CUDA buffers are staged through host memory.
* :class:`KvikioEngine` — ``kvikio.CuFile`` ``pwrite``/``pread`` futures, one per
  ``KVIKIO_TASK_SIZE`` piece, on kvikio's thread pool; device buffers go to the file directly
  (GPUDirect Storage when the machine has it, kvikio's POSIX compat mode otherwise). A failed call
  returns only once every piece it issued is done, and raises what the POSIX engine raises
  (``FileNotFoundError``, ``EOFError``, ``OSError`` with the errno), not kvikio's ``RuntimeError``.
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
    if pin:
        # torch's pinned allocator rounds every request up to a power of two and keeps the block:
        # nbytes + ALIGN would pin twice a power-of-two size (64 MiB for a 32 MiB buffer). Its
        # blocks (cudaHostAlloc) are page aligned: the exact size first, the skew only if not
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if t.data_ptr() % ALIGN == 0:
            return t
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skew = (-raw.data_ptr()) % ALIGN
    return raw[skew : skew + nbytes]


def _host_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU uint8 tensor (no copy)."""
    mv = t.numpy().data  # (the array's memoryview)
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
        try:  # (the descriptor is closed whatever fails after it was opened: mmap, a bad `data`)
            if fd is None:
                fd = os.open(path, os.O_WRONLY)
                mv = memoryview(data)
            else:
                b = getattr(self._tls, "hdr", None)
                if b is None or len(b) < len(data):
                    b = self._tls.hdr = mmap.mmap(-1, max(len(data), ALIGN))  # page aligned
                mv = memoryview(b)[: len(data)]
                mv[:] = data
            self._pwrite_all(fd, mv, 0)
            if fsync:
                os.fdatasync(fd)
        finally:
            if fd is not None:
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


# errnos recognised in kvikio's messages (each ends with strerror(errno): KVIKIO_SYSCALL_CHECK's
# std::system_error, "POSIX error on pwrite: <strerror>", cuFile's "<strerror>"). Not EPERM:
# kvikio reports EBADF as "POSIX error: Operation not permitted".
_KVIKIO_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.ENOENT, errno.EACCES, errno.EROFS,
                  errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG, errno.EMFILE, errno.ENFILE, errno.EIO)


class KvikioEngine:
    """kvikio CuFile engine (GPU machines); see the module docstring.

    Two properties of kvikio (26.10) shape :meth:`_run`:

    * every failure is a ``RuntimeError`` (C++ exceptions through Cython's ``except +``): a
      missing file, EOF ("POSIX error on pread: EOF"; a read never returns a short count in compat
      mode) and ENOSPC / EFBIG alike. The store's recovery dispatches on the POSIX engine's types
      (``FileNotFoundError`` / ``EOFError``: an entry replaced, removed or truncated while read;
      ``OSError`` ENOSPC / EFBIG: a full disk), so :meth:`_posix_error` translates them.
    * a ``pread``/``pwrite`` of more than ``task_size`` bytes is several tasks on kvikio's pool
      whose future raises as soon as one task fails while the others still run; every task uses
      the ``CuFile``'s handle and the caller's buffer when it runs, and ``close()`` does not wait
      for them. A call that stopped at the first failure and closed the file left tasks reading a
      closed (or freed) handle, and writing into a destination the caller was told had failed.
    """

    name = "kvikio"

    def __init__(self):
        import kvikio  # noqa: F401  (fails here if kvikio is missing)
        import kvikio.defaults

        self._kvikio = kvikio
        self._posix = PosixEngine()
        try:  # the piece size of _run: kvikio's task size (KVIKIO_TASK_SIZE, default 4 MiB), rounded
            # down to whole 4 KiB pages so that every piece after the first starts on one (GDS)
            self._task = max(ALIGN, int(kvikio.defaults.get("task_size")) // ALIGN * ALIGN)
        except Exception:  # pragma: no cover - a kvikio without defaults.get("task_size")
            self._task = 4 << 20

    def write_header(self, path: str, data: bytes, *, fsync: bool = True) -> None:
        """The header is small host memory: written by the POSIX engine's O_DIRECT path."""
        self._posix.write_header(path, data, fsync=fsync)

    @staticmethod
    def _buf(t: torch.Tensor):
        if t.device.type == "cuda":
            return t  # __cuda_array_interface__ (uint8 has one)
        return t.numpy()

    def _run(self, f, pieces: list[tuple[int, Piece]], *, write: bool) -> None:
        """Issue every segment of ``pieces`` on ``f``, then wait for *all* of them; raise the
        first failure only then (the caller closes ``f`` and may reuse the buffers after this).

        Each segment is cut into pieces of ``self._task`` bytes, each issued with
        ``task_size`` = its size, so every future is exactly one kvikio task (the same number of
        tasks kvikio's own split would make) and waiting on all futures waits on all tasks.
        Zero-length segments issue nothing (a task with nothing to move, and an empty CUDA
        tensor's data pointer is null: kvikio would take it for host memory).
        """
        op = f.pwrite if write else f.pread
        futs, first = [], None
        try:
            for off, t in _flatten(pieces):
                n = t.numel()
                for p in range(0, n, self._task):  # nothing for n == 0
                    k = min(self._task, n - p)
                    futs.append((op(self._buf(t[p : p + k]), k, off + p, k), k))
        except BaseException as exc:  # an issue failed (a small device read runs inside pread): stop
            first = exc               # issuing, but still wait for what was issued
        for fu, k in futs:
            try:
                got = fu.get()
            except BaseException as exc:
                first = first or exc
                continue
            if got != k and first is None:  # cuFile (GDS) may return a short count
                first = (OSError(errno.EIO, f"short write: {got} of {k} bytes") if write
                         else EOFError(f"short read: {got} of {k} bytes"))
        if first is not None:
            raise first

    @staticmethod
    def _posix_error(exc: BaseException, path: str, pieces, *, write: bool) -> BaseException:
        """The exception the POSIX engine would raise for kvikio's ``RuntimeError`` ``exc``:
        ``OSError`` with the errno its message names (``OSError(ENOENT, ...)`` is a
        ``FileNotFoundError``); on a read, ``EOFError`` when it hit the end of the file or the
        file is now shorter than the read; ``FileNotFoundError`` when the file is gone;
        ``OSError(EIO)`` otherwise. Other exception types are returned unchanged."""
        if not isinstance(exc, RuntimeError):
            return exc
        text = str(exc)
        msg = f"kvikio: {text}"
        # longest message first: "Too many open files" (EMFILE) is the start of ENFILE's
        for e in sorted(_KVIKIO_ERRNOS, key=lambda e: -len(os.strerror(e))):
            if f": {os.strerror(e)}" in text:
                return OSError(e, msg, path)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return FileNotFoundError(errno.ENOENT, msg, path)
        except OSError:
            size = None
        if not write:
            end = max((o + t.numel() for o, t in _flatten(pieces)), default=0)
            if text.endswith(": EOF") or (size is not None and size < end):
                return EOFError(f"unexpected end of file: {path} holds {size} bytes, {end} read ({text})")
        return OSError(errno.EIO, msg, path)

    def write_file(self, path: str, pieces: list[tuple[int, Piece]], *, fsync: bool = True) -> None:
        try:
            f = self._kvikio.CuFile(path, "w")
            try:
                self._run(f, pieces, write=True)
            finally:
                f.close()  # every task is done (_run waited): nothing uses the handle any more
        except RuntimeError as exc:
            raise self._posix_error(exc, path, pieces, write=True) from exc
        if fsync:  # kvikio does not fsync
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def read_into(self, path: str, pieces: list[tuple[int, Piece]]) -> None:
        try:
            f = self._kvikio.CuFile(path, "r")
            try:
                self._run(f, pieces, write=False)
            finally:
                f.close()
        except RuntimeError as exc:
            raise self._posix_error(exc, path, pieces, write=False) from exc


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
            from kvkernels._wheels import hint

            raise RuntimeError(f"`engine`: 'kvikio' is not importable: {st['reason']} ({hint('kvikio')})")
        return KvikioEngine()
    if torch.cuda.is_available() and kvikio_status()["importable"]:
        return KvikioEngine()
    return PosixEngine()
