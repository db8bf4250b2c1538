"""A CPU model of kvikio 26.10's Python ``CuFile`` API, for testing ``KvikioEngine`` without a GPU
or kvikio (CI). Modelled on kvikio 26.10's sources (rapidsai/kvikio: ``python/kvikio/cufile.py``,
``_lib/file_handle.pyx``, ``_lib/future.pyx``, ``cpp/src/file_handle.cpp``,
``cpp/include/kvikio/detail/{parallel_operation,posix_io}.hpp``, ``cpp/src/file_utils.cpp``), host
memory only, in the way that matters to the engine:

* every failure is a ``RuntimeError`` (kvikio's C++ exceptions through Cython's ``except +``):
  an open that fails ("Unable to open file. ...: <strerror>", a ``std::system_error``), EOF on a
  read ("POSIX error on pread: EOF": ``posix_host_io`` never returns a short count), and any errno
  of ``pread``/``pwrite`` ("POSIX error on pwrite: <strerror>"; EBADF reads "POSIX error:
  Operation not permitted");
* ``pread``/``pwrite(buf, size=None, file_offset=0, task_size=None)`` split the request as
  ``parallel_io`` does: one task when ``task_size >= size`` (or the size is at most a page),
  otherwise ``task_size`` tasks plus a last task that does its own I/O and then ``get()``s the
  others *in order* — so the returned future raises as soon as one task failed while later
  tasks still run;
* each task reads the handle's descriptor when it runs (``this->_file_direct_off.fd()``), and
  ``close()`` closes the descriptors without waiting for the tasks (a task that runs after it
  gets EBADF here; in C++ a freed handle's garbage);
* ``task_size`` falsy means ``kvikio.defaults.get("task_size")`` (``file_handle.pyx``).

:func:`install` puts the model in ``sys.modules`` as ``kvikio`` / ``kvikio.defaults``; its
:class:`FakeState` counts the tasks still queued or running (``pending``), the tasks that ran on a
closed handle (``late``) and every issued request (``calls``); ``delay`` and ``fail`` hooks widen
races and inject errnos at the syscall.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

PAGE = 4096


def _failure(msg: str) -> RuntimeError:
    # kvikio::detail::kvikio_fail: "KvikIO failure at: <file>:<line>: <msg>"
    return RuntimeError(f"KvikIO failure at: /kvikio/cpp/include/kvikio/detail/posix_io.hpp:90: {msg}")


class FakeState:
    """The model's knobs and counters (one per :func:`install`)."""

    def __init__(self, *, nthreads: int = 4, task_size: int = 4 << 20):
        self.pool = ThreadPoolExecutor(nthreads, thread_name_prefix="fake-kvikio")
        self.task_size = task_size
        self.lock = threading.Lock()
        self.pending = 0  # tasks submitted and not finished
        self.late = 0  # tasks that found their handle closed
        self.calls: list[tuple[str, int, int, int]] = []  # (op, file_offset, size, task_size) per pread/pwrite
        # hooks: seconds a task sleeps before its I/O, and an errno its syscall fails with (None: none)
        self.delay: Callable[[str, int, int], float] = lambda op, off, n: 0.0
        self.fail: Callable[[str, int, int], Optional[int]] = lambda op, off, n: None

    def idle(self, timeout: float = 10.0) -> bool:
        """Wait until no task is queued or running."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.pending == 0:
                return True
            time.sleep(0.01)
        return self.pending == 0

    def submit(self, fn):
        with self.lock:
            self.pending += 1

        def run():
            try:
                return fn()
            finally:
                with self.lock:
                    self.pending -= 1

        return self.pool.submit(run)


class IOFuture:
    """``kvikio.cufile.IOFuture``: ``get()`` blocks and returns the bytes done, or raises."""

    def __init__(self, fut):
        self._fut = fut

    def get(self) -> int:
        return self._fut.result()

    def done(self) -> bool:
        return self._fut.done()


def _host_view(buf, size):
    """``parse_buffer_argument(buf, size, True)`` for host arrays (device memory is not modelled)."""
    if not hasattr(buf, "__array_interface__"):
        raise TypeError("fake kvikio: only host arrays (numpy) are modelled")
    mv = memoryview(buf).cast("B")
    if size is None:
        size = len(mv)
    elif size > len(mv):
        raise ValueError("Size is greater than the size of the buffer")
    return mv, size


def make_module(state: FakeState) -> tuple[types.ModuleType, types.ModuleType]:
    """Fresh ``kvikio`` and ``kvikio.defaults`` modules bound to ``state``."""

    class CuFile:
        """``kvikio.CuFile(file, flags="r")``."""

        def __init__(self, file, flags: str = "r"):
            fl = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC}[flags[0]]
            try:
                self._fd = os.open(os.fspath(file), fl | os.O_CLOEXEC, 0o644)
            except OSError as e:  # KVIKIO_SYSCALL_CHECK -> GenericSystemError (std::system_error)
                raise RuntimeError("Unable to open file. Linux system/library function call error at: "
                                   f"/kvikio/cpp/src/file_utils.cpp:160: {os.strerror(e.errno)}") from None

        def close(self) -> None:  # FileHandle::close(): closes the fds, does not wait for tasks
            fd, self._fd = self._fd, -1
            if fd != -1:
                os.close(fd)

        @property
        def closed(self) -> bool:
            return self._fd == -1

        def fileno(self) -> int:
            return self._fd

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

        def _io(self, op: str, mv: memoryview, size: int, file_offset: int) -> int:
            """One task: posix_host_io<PartialIO::NO> on the fd the handle holds *now*."""
            time.sleep(state.delay(op, file_offset, size))
            done = 0
            while done < size:
                fd = self._fd
                if fd == -1:
                    with state.lock:
                        state.late += 1
                    raise _failure("POSIX error: Operation not permitted")  # EBADF
                try:
                    err = state.fail(op, file_offset + done, size - done)
                    if err is not None:
                        raise OSError(err, os.strerror(err))
                    if op == "pread":
                        n = os.preadv(fd, [mv[done:size]], file_offset + done)
                    else:
                        n = os.pwritev(fd, [mv[done:size]], file_offset + done)
                except OSError as e:
                    if e.errno == errno.EBADF:
                        raise _failure("POSIX error: Operation not permitted") from None
                    raise _failure(f"POSIX error on {op}: {os.strerror(e.errno)}") from None
                if op == "pread" and n == 0:
                    raise _failure("POSIX error on pread: EOF")
                done += n
            return size

        def _parallel(self, op: str, buf, size, file_offset: int, task_size) -> IOFuture:
            mv, size = _host_view(buf, size)
            task_size = task_size if task_size else state.task_size  # file_handle.pyx
            if task_size <= 0:
                raise ValueError("`task_size` must be positive")  # std::invalid_argument
            state.calls.append((op, file_offset, size, task_size))
            if task_size >= size or PAGE >= size:  # parallel_io's single-task guard
                return IOFuture(state.submit(lambda: self._io(op, mv, size, file_offset)))
            tasks, pos = [], 0
            while size - pos > task_size:
                tasks.append(state.submit(lambda p=pos: self._io(op, mv[p:], task_size, file_offset + p)))
                pos += task_size

            def last(p=pos):  # its own I/O, then the others in order: raises at the first failure
                ret = self._io(op, mv[p:], size - p, file_offset + p)
                for t in tasks:
                    ret += t.result()
                return ret

            return IOFuture(state.submit(last))

        def pread(self, buf, size=None, file_offset: int = 0, task_size=None) -> IOFuture:
            return self._parallel("pread", buf, size, file_offset, task_size)

        def pwrite(self, buf, size=None, file_offset: int = 0, task_size=None) -> IOFuture:
            return self._parallel("pwrite", buf, size, file_offset, task_size)

    kvikio = types.ModuleType("kvikio")
    kvikio.__version__ = "26.10.00+fake"
    kvikio.CuFile = CuFile
    kvikio.IOFuture = IOFuture
    kvikio._fake = state

    defaults = types.ModuleType("kvikio.defaults")

    def get(name: str):
        return {"task_size": state.task_size, "compat_mode": "ON", "num_threads": state.pool._max_workers}[name]

    defaults.get = get
    kvikio.defaults = defaults
    return kvikio, defaults


def install(monkeypatch=None, **kw) -> FakeState:
    """Make ``import kvikio`` give the model (through ``monkeypatch`` when given, undone after the
    test; for good otherwise, e.g. in a child process). Returns its :class:`FakeState`."""
    state = FakeState(**kw)
    kvikio, defaults = make_module(state)
    for name, mod in (("kvikio", kvikio), ("kvikio.defaults", defaults)):
        if monkeypatch is not None:
            monkeypatch.setitem(sys.modules, name, mod)
        else:
            sys.modules[name] = mod
    return state


def force_engine(name: str, monkeypatch=None):
    """Every ``KVStore`` built afterwards uses the engine ``name`` whatever its ``engine=``:
    ``posix``, ``kvikio`` (the real one: needs a GPU and kvikio) or ``fake-kvikio`` (installs the
    model). Returns the model's :class:`FakeState` for ``fake-kvikio``, else None."""
    from kvkernels.io import engines
    from kvkernels.io import store as store_mod

    state = None
    if name == "fake-kvikio":
        state = install(monkeypatch)
        make = engines.KvikioEngine
    elif name == "kvikio":
        make = lambda: engines.make_engine("kvikio")  # noqa: E731  (checks CUDA and kvikio)
    elif name == "posix":
        make = engines.PosixEngine
    else:
        raise ValueError(name)
    if monkeypatch is not None:
        monkeypatch.setattr(store_mod, "make_engine", lambda engine: make())
    else:
        store_mod.make_engine = lambda engine: make()
    return state
