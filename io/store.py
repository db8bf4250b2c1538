"""``KVStore``: layer-addressable, checksummed, crash-safe KV entries on one or more SSDs.

See docs/store.md for the protocol. In short:

* one file per entry, ``<path>/<digest[:2]>/<digest>.kvk``; the digest hashes the key, so a key
  can never name a path; entries are placed on ``paths[digest % len(paths)]`` (one path per SSD:
  bandwidth adds up);
* a put writes ``<digest>.kvk.tmp.<pid>.<n>``, fsyncs it, renames it over the final name and
  fsyncs the directory: an entry is visible only when complete; on open, temporaries are deleted
  and every header is checked (bad files are skipped and reported in ``stats()["recovery"]``);
* every region carries an xxh3_64 checksum, verified on read: a mismatch raises
  :class:`~kvkernels.io.format.CorruptEntryError` from the get's future and drops the entry
  (renamed ``*.corrupt``) so later lookups miss — wrong bytes are never handed out;
* LRU eviction keeps the files under ``capacity_bytes``; ENOSPC / EFBIG fail the put's future,
  delete the temporary, and leave the store working;
* worker threads take requests from one priority queue: with ``read_priority`` (default) pending
  reads go before pending writes (mixed read/write costs SSDs ~60 % of their bandwidth), writes
  fill the gaps; in-flight put bytes are bounded by ``max_inflight_bytes`` (``put`` blocks: back
  pressure, not unbounded memory).
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import queue
import re
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvkernels import config
from kvkernels._validate import check, check_int, check_memory, check_tensor, describe, fail

from .engines import aligned_empty, make_engine
from .format import KEY_TYPES, CorruptEntryError, EntryMeta, Header, checksum_segments, key_digest

_log = logging.getLogger(__name__)

__all__ = ["KVStore"]

_SUFFIX = ".kvk"
_TMP_NAME = re.compile(r"[0-9a-f]+\.kvk\.tmp\.[0-9]+\.[0-9]+")  # <digest>.kvk.tmp.<pid>.<n>, see _do_put
# Reads of contiguous regions are issued in groups of about this many bytes, so verification of
# one group overlaps the read of the next. 256 MiB: on the CPU host virtio disk 64 MiB groups read
# at a median 1.28 GB/s, 256 MiB at 1.45, one 1 GiB read at 1.56 (4 reps each, noisy disk).
READ_GROUP_BYTES = 256 << 20
# ... but an entry is read in at least READ_GROUP_SPLIT groups (of at least READ_GROUP_MIN bytes),
# so a small entry's checksums are not a serial tail after its read: a cold 32 MiB llama3-8b
# chunk read as one group took 45.0 ms median vs 42.2 ms in 8 MiB groups and 41.2 ms without
# verification (raw O_DIRECT read of the same file: 42.6 ms; 24 reads each, CPU host, 2026-11-22).
READ_GROUP_SPLIT = 4
READ_GROUP_MIN = 4 << 20
# A get that finds its entry replaced by a put of the same key mid-read is retried on the new
# version this many times (then it is a miss).
READ_RETRIES = 3


@dataclass
class _Later:
    """A worker's result that completes later: the request's future follows ``future``."""

    future: Future


def _forward(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        _settle(dst, src.result())


def _settle(dst: Future, res) -> None:
    """Complete ``dst`` with ``res``, or make it follow ``res.future`` when ``res`` is a :class:`_Later`."""
    if isinstance(res, _Later):
        res.future.add_done_callback(lambda f: _forward(f, dst))
    else:
        dst.set_result(res)


class _Replaced(Exception):
    """The file a read used was replaced (a later put's rename of its key) before the read ended:
    its bytes may be the new version's, in part or whole."""


@dataclass
class _Entry:
    path: str
    header: Header
    nbytes: int
    readers: int = 0
    seq: int = 0  # the rename that put this file at `path` (recovery numbers what it finds too)
    doomed: str | None = None  # dropped while being read: "" = unlink, ".corrupt" = rename, when the last reader leaves
    held: int = 0  # its bytes in KVStore._read_held: dropped while read, its file still on disk


@dataclass
class _Room:
    """A put's reservation (:meth:`KVStore._make_room`), given back when it commits or fails."""

    nbytes: int
    digest: bytes
    replaces: _Entry | None  # the indexed version it was credited for (its bytes leave at the commit)


@dataclass
class _Credit:
    """An indexed entry that puts in flight replace (:meth:`KVStore._make_room`): its bytes
    leave when one of them commits, so room checks count them as leaving already."""

    entry: _Entry  # the indexed version being replaced
    reservations: list[int]  # the reservations of the puts in flight replacing it
    value: int = 0  # bytes it counts in KVStore._credit (see KVStore._recredit)


_LOCK_NAME = ".kvkernels.lock"


class _FolderLocks:
    """The lock descriptors one store took (:func:`_lock_roots`); released by :func:`_unlock`."""

    __slots__ = ("fds",)

    def __init__(self) -> None:
        self.fds: list[int] = []


# lock descriptors of this process's open stores -> their owner. An flock belongs to the open file,
# which fork shares, so a forked child closes its copies (a living child kept the folder locked
# after the parent's close); the owner check keeps a store inherited by a child from closing
# descriptors the child opened later under the same numbers. The mutex is held across a fork, so
# a child never inherits it locked, nor a descriptor opened but not yet registered.
_HELD_LOCKS: dict[int, _FolderLocks] = {}
_HELD_LOCKS_MUTEX = threading.Lock()


def _close_locks_in_child() -> None:
    for fd in list(_HELD_LOCKS):
        try:
            os.close(fd)  # the child's copy only: the parent's lock stays (no LOCK_UN here)
        except OSError:
            pass
    _HELD_LOCKS.clear()
    _HELD_LOCKS_MUTEX.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_HELD_LOCKS_MUTEX.acquire, after_in_parent=_HELD_LOCKS_MUTEX.release,
                        after_in_child=_close_locks_in_child)

# stores not closed yet: closed when the interpreter exits, before its thread pools stop (a put
# still queued at exit was lost: its commit could no longer be scheduled)
_OPEN_STORES: "weakref.WeakSet[KVStore]" = weakref.WeakSet()


class _Closable(Protocol):
    """What close_before_stores_at_exit takes: an object with a ``close()``."""

    def close(self) -> object: ...


# objects that write into stores from threads of their own (a LayerPipeline's SSD writer): closed
# at exit before the stores, so their queued writes still find the stores open. -> their process
_STORE_USERS: "weakref.WeakKeyDictionary[_Closable, int]" = weakref.WeakKeyDictionary()


def close_before_stores_at_exit(user: _Closable) -> None:
    """Have ``user.close()`` called when this process's interpreter exits, before the open
    stores close (for objects with queued work that ends in ``KVStore.put``). ``close()`` must
    wait for a close already under way in another thread (not return at once)."""
    _STORE_USERS[user] = os.getpid()


def _close_open_stores() -> None:
    # (BaseException: a Ctrl-C that cuts one close short does not leave the others open)
    for user, pid in list(_STORE_USERS.items()):
        if pid != os.getpid():  # inherited by a forked child: the parent's
            continue
        try:
            user.close()
        except BaseException as exc:  # noqa: BLE001 - exiting: say it, close the others
            _log.warning("kvkernels: closing %r at exit failed: %r", user, exc)
    for store in list(_OPEN_STORES):
        if store._pid != os.getpid():
            continue
        try:
            store.close()
        except BaseException as exc:  # noqa: BLE001 - exiting: say it, close the others
            _log.warning("kvkernels store: closing %s at exit failed: %r", ", ".join(store.paths), exc)


def _remove_file(path: str, rename_to: str | None = None) -> bool:
    """Delete ``path`` (or rename it to ``path + rename_to``); a file already gone is fine. A
    refusal of the file system is logged and False (the caller counts it in ``unlink_errors``)."""
    try:
        if rename_to:
            os.replace(path, path + rename_to)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        _log.warning("kvkernels store: could not %s %s: %s", "rename" if rename_to else "delete", path, exc)
        return False
    return True


def _start_threads(pool: ThreadPoolExecutor, n: int) -> None:
    """Start all ``n`` threads of ``pool`` now (it starts them one per submit that finds none
    idle): a submit that must start one can fail after queueing its work (no thread can start
    at interpreter exit on CPython 3.12.0-3.12.2, or under a thread limit), and a put whose
    commit was queued that way was reported failed and failed again when the commit ran."""
    barrier = threading.Barrier(n + 1)
    try:
        for _ in range(n):  # each finds the earlier ones waiting (not idle) and starts a thread
            pool.submit(barrier.wait)
        barrier.wait(timeout=60)
    except BaseException:
        barrier.abort()  # the threads started go back to the pool
        raise


# threading's exit hooks run before non-daemon threads are joined and in reverse order, so this
# one runs before concurrent.futures' (registered when it was imported above) refuses new work
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_close_open_stores)
else:  # pragma: no cover - CPython < 3.9
    import atexit

    atexit.register(_close_open_stores)

# flock errors that mean "this file system cannot lock" (EBADF: NFS maps flock to POSIX locks,
# which a read-only descriptor cannot take exclusively)
_NO_FLOCK = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF)


def _lock_roots(roots: list[str]) -> _FolderLocks:
    """Take an exclusive, non-blocking ``flock`` on ``<root>/.kvkernels.lock`` for every root.

    A root already locked by another store raises ``RuntimeError`` and releases the ones taken. A
    lock file that cannot be opened for writing (another user's, a read-only mount) is locked
    read-only; a root where neither works, or whose file system has no ``flock`` (ENOSYS /
    ENOLCK / EOPNOTSUPP), is opened without a lock, with a warning. Without ``fcntl`` (not POSIX)
    no lock is taken.
    """
    locks = _FolderLocks()
    try:
        import fcntl  # noqa: PLC0415
    except ImportError:  # pragma: no cover - not on Linux
        return locks
    def in_use(root: str) -> RuntimeError:
        return RuntimeError(f"store folder {root!r} is in use by another KVStore (this process or another): one "
                            f"store per folder; close the other one first, or give each its own folder")

    with _HELD_LOCKS_MUTEX:  # opened, locked and registered with no fork in between
        try:
            for root in roots:
                # the folder itself, too: the lock file alone was lost when a cleanup deleted it
                # (a second store then made a new one and opened), and a lock file created under
                # umask 077 could not be opened by another user's store, which ran unlocked
                try:
                    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
                except OSError:
                    dfd = -1
                if dfd >= 0:
                    locks.fds.append(dfd)
                    try:
                        fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        raise in_use(root) from None
                    except OSError:  # no flock on folders here: the lock file decides alone
                        locks.fds.pop()
                        os.close(dfd)
                path = os.path.join(root, _LOCK_NAME)
                writable = True
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                    try:  # readable by other users' stores whatever the umask (0o644 lost its bits to 077)
                        os.fchmod(fd, 0o644)
                    except OSError:  # another user's file: its mode is theirs
                        pass
                except OSError as exc:
                    if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                        raise
                    writable = False
                    try:
                        fd = os.open(path, os.O_RDONLY)  # flock needs no write access
                    except OSError as exc2:
                        _log.warning("kvkernels store: %s cannot be opened (%s): folder %s is not locked "
                                     "against a second store", path, exc2.strerror or exc2, root)
                        continue
                locks.fds.append(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise in_use(root) from None
                except OSError as exc:
                    if exc.errno not in _NO_FLOCK or (exc.errno == errno.EBADF and writable):
                        raise
                    _log.warning("kvkernels store: %s cannot be locked (%s): folder %s is not locked against "
                                 "a second store", path, exc.strerror or exc, root)
                    locks.fds.pop()
                    os.close(fd)
        except BaseException:
            for fd in locks.fds:
                os.close(fd)
            raise
        for fd in locks.fds:
            _HELD_LOCKS[fd] = locks
    return locks


def _unlock(locks: _FolderLocks) -> None:
    """Close the lock descriptors of :func:`_lock_roots` (the locks go with them); idempotent, and
    a no-op in a forked child for a store it inherited."""
    with _HELD_LOCKS_MUTEX:
        for fd in locks.fds:
            if _HELD_LOCKS.get(fd) is locks:
                del _HELD_LOCKS[fd]
                os.close(fd)
        locks.fds = []


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class KVStore:
    """Store staging buffers (``kvkernels.gather`` output) as layer-addressable files.

    Parameters
    ----------
    paths : str or list of str
        Directories, one per SSD; created if missing.
    capacity_bytes : int, optional
        Upper bound on the bytes of all entry files (LRU eviction). ``None`` = unbounded.
    engine : {"auto", "posix", "kvikio"}
        ``auto``: kvikio when CUDA is available and kvikio imports, else POSIX.
    io_threads : int, optional
        Worker threads = queue depth (``KVKERNELS_IO_THREADS``, default 4).
    max_inflight_bytes : int, optional
        Bound on bytes of puts submitted but not yet written (``KVKERNELS_IO_INFLIGHT_BYTES``,
        default 1 GiB). A single larger put still proceeds alone.
    read_priority : bool
        Pending reads before pending writes (default True).
    verify : bool
        Verify region checksums on read (default True).
    fsync : bool
        fsync files and directories on put (default True; False only for benchmarks of the page
        cache).

    Examples
    --------
    >>> import tempfile, torch, kvkernels
    >>> from kvkernels.io import KVStore, EntryMeta
    >>> lay = kvkernels.PagedLayout.from_vllm([torch.randn(2, 8, 16, 2, 64) for _ in range(2)])
    >>> staging = kvkernels.gather(lay, [3, 1])
    >>> with KVStore(tempfile.mkdtemp()) as store:
    ...     header = store.put("req-1", staging, EntryMeta.for_layout(lay, 2)).result()
    ...     back = store.get("req-1").result()
    >>> bool(torch.equal(back, staging))
    True
    """

    def __init__(self, paths, capacity_bytes: int | None = None, engine: str = "auto", *, io_threads: int | None = None,
                 max_inflight_bytes: int | None = None, read_priority: bool = True, verify: bool = True,
                 fsync: bool = True):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        try:
            paths = [os.fspath(p) for p in paths]
        except TypeError:
            fail("paths", "a directory or a list of directories", type(paths).__name__, TypeError)
        check(len(paths) > 0, "paths", "at least one directory", "none")
        for p in paths:  # "" would be the working directory (abspath), silently
            check(isinstance(p, str) and p.strip() != "", "paths", "non-empty directory paths", repr(p))
        if capacity_bytes is not None:
            check_int(capacity_bytes, "capacity_bytes", lo=1)
        # resolved once: a link switched later (a new server's folder beside a draining one's) does
        # not move this store's files into the other's folder
        self.paths = [os.path.realpath(p) for p in paths]
        # not bool(): verify=None (None is "the default" for the other arguments) turned checksums off
        for name, flag in (("read_priority", read_priority), ("verify", verify), ("fsync", fsync)):
            check(isinstance(flag, bool), name, "True or False", repr(flag), TypeError)
        self.fsync = fsync
        # every other argument before a folder is made: a refused store leaves nothing behind
        self.capacity_bytes = capacity_bytes
        self.engine = make_engine(engine)
        self.io_threads = io_threads if io_threads is not None else config.io_threads()
        check_int(self.io_threads, "io_threads", lo=1)
        if max_inflight_bytes is not None:
            check_int(max_inflight_bytes, "max_inflight_bytes", lo=1)
        self.max_inflight_bytes = (max_inflight_bytes if max_inflight_bytes is not None
                                   else config.io_inflight_bytes())
        seen: dict[tuple[int, int], str] = {}
        created: list[str] = []  # folders this call made, top down: their names need a parent fsync
        try:
            for p in self.paths:
                missing = []
                d = p
                while not os.path.isdir(d) and os.path.dirname(d) != d:
                    missing.append(d)
                    d = os.path.dirname(d)
                if os.path.exists(p) and not os.path.isdir(p):
                    raise NotADirectoryError(errno.ENOTDIR, f"`paths`: {p!r} is not a directory", p)
                created += [m for m in reversed(missing) if m not in created]  # (before: a partial makedirs)
                try:
                    os.makedirs(p, exist_ok=True)
                    st = os.stat(p)
                except OSError as exc:  # the same OSError subclass (by errno), naming the argument
                    raise OSError(exc.errno, f"`paths`: cannot use {p!r} as a store directory: "
                                             f"{exc.strerror or exc}", exc.filename) from exc
                # the same folder twice (or through a link) would make recovery see every file twice and
                # delete it as its own duplicate
                check((st.st_dev, st.st_ino) not in seen, "paths", "distinct directories",
                      f"{p!r} is the same directory as {seen.get((st.st_dev, st.st_ino))!r}")
                seen[(st.st_dev, st.st_ino)] = p
            self._root_ids = {p: ident for ident, p in seen.items()}
        except BaseException:
            # a refused store leaves nothing behind: the folders this call made go again (empty
            # ones only: rmdir; [new, new] made `new` and then refused it)
            for d in reversed(created):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            raise
        if self.fsync:  # a put acknowledged as durable must not lose the folder it lives in
            for d in created:
                _fsync_dir(os.path.dirname(d))
        self.read_priority = read_priority
        self.verify = verify
        self._lock = threading.RLock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU: oldest first
        self._used = 0
        self._reserved = 0  # bytes of puts between their room check and their commit (capacity holds under concurrency)
        # digest -> _Credit: an entry's bytes leave when a put replacing it commits, so no room
        # check counts them (two overwrites in flight evicted an unrelated entry); dropped with
        # the entry, counted once however many puts replace it, and at most the smallest of
        # their reservations (see _recredit)
        self._credits: dict[bytes, _Credit] = {}
        self._credit = 0  # bytes of the entries in _credits
        self._room = threading.Condition(self._lock)  # notified when a reservation is released
        # paths whose unlink a drop deferred until its caller released the lock (evictions,
        # removes: an eviction batch unlinked ~1,400 files under it, 2 s of `contains` waiting):
        # path -> count; a commit renaming into such a path waits for the unlink first (it must
        # not delete the newer file), notified through _unlinked
        self._unlinking: dict[str, int] = {}
        self._unlinked = threading.Condition(self._lock)
        # final paths a commit is renaming into outside the lock (a key with nothing else at its
        # path); other commits into the path wait for it, through _unlinked as well
        self._renaming: set[str] = set()
        # bytes of those files: still on disk, so still counted by room checks (else other puts
        # wrote into room not yet freed: 1.25-1.43x capacity on disk with slow unlinks)
        self._pending_unlink = 0
        # bytes of files whose entries left the index while being read (deleted when the last
        # reader finishes): still on disk, so room checks count them too (else puts overshot the
        # capacity by the entries evicted under a read: 1.33x with one slow get, 2026-11-25)
        self._read_held = 0
        # digests renamed into place but not yet visible (directory fsync pending): a drop of their
        # older version must not unlink or rename the path, which already holds the new file
        self._publishing: dict[bytes, int] = {}
        self._renames: dict[bytes, int] = {}  # digest -> count of renames while some are publishing
        self._file_seq: dict[bytes, int] = {}  # digest -> rename seq of the file now at _path_for(digest)
        self._rename_seq = itertools.count(1)
        self._pins: dict[bytes, int] = {}  # digest -> pin count: pinned entries are never evicted
        # the eviction order: the indexed digests that are not pinned, oldest first. Pinned ones
        # leave it (a put at capacity walked past every pinned entry at the old end of _index:
        # LMCache pins lookup hits, old entries, until their load; 33 ms per put at 200k pinned)
        # and come back at the young end with their last unpin (the load that followed was a use)
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._inflight = 0
        self._inflight_cv = threading.Condition()
        # puts take their in-flight bytes in arrival order (tickets): a put that did not fit
        # waited while smaller later ones kept fitting, 8-16 s beside two busy writers
        self._ticket_next = 0
        self._ticket_serving = 0
        self._tickets_abandoned: set[int] = set()
        self._seq = itertools.count()
        self._tmp_seq = itertools.count()
        self._shards_synced: set[str] = set()  # shard folders whose name this store has made durable
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        # checksums run beside the I/O: one hashing thread per worker
        self._hasher = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="kvk-store-hash")
        # puts end (header, fdatasync, rename, directory fsync) on these threads, off the workers
        self._committer = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="kvk-store-commit")
        self._closed = False
        self._close_done = False  # close() ran to its end (an interrupted one did not)
        self._pid = os.getpid()  # a forked child inherits the store without its workers or lock
        self._submit_lock = threading.Lock()
        self._stats: dict[str, int | float] = {
            k: 0 for k in ("puts", "put_errors", "gets", "hits", "misses", "corrupt", "replaced_reads",
                           "evictions", "bytes_written", "bytes_read", "unlink_errors", "disturbed_reads")}
        self._stats.update(write_s=0.0, read_s=0.0)
        # one store per folder: a second one (this process or another) would delete the first's
        # temporaries in its recovery and, with an index gone stale under the other's overwrites,
        # rename good files to *.corrupt. An advisory lock on <root>/.kvkernels.lock refuses it.
        self._locks = _lock_roots(self.paths)
        try:
            for pool in (self._hasher, self._committer):  # (once the folders are ours: a refused open starts none)
                _start_threads(pool, self.io_threads)
            self.recovery = self._recover()
            self._workers = [threading.Thread(target=self._worker, name=f"kvk-store-{i}", daemon=True)
                             for i in range(self.io_threads)]
            for w in self._workers:
                w.start()
            _OPEN_STORES.add(self)
        except BaseException:
            _unlock(self._locks)
            self._closed = self._close_done = True
            for w in getattr(self, "_workers", []):
                if w.is_alive():
                    self._q.put((9, next(self._seq), None, None))
            self._hasher.shutdown(wait=False)
            self._committer.shutdown(wait=False)
            raise

    # ------------------------------------------------------------------ naming
    def _path_for(self, digest: bytes) -> str:
        root = self.paths[int.from_bytes(digest[:8], "little") % len(self.paths)]
        hexd = digest.hex()
        return os.path.join(root, hexd[:2], hexd + _SUFFIX)

    def _root_replaced(self, path: str) -> str | None:
        """Why the folder holding entry ``path`` is no longer the one this store opened (None: it
        is): renamed or deleted from outside, perhaps made again by another store, which holds its
        own lock. Its files are then not this store's to write or delete."""
        root = os.path.dirname(os.path.dirname(path))
        try:
            st = os.stat(root)
        except OSError as exc:
            return f"store folder {root!r} is gone ({exc.strerror or exc})"
        if (st.st_dev, st.st_ino) != self._root_ids.get(root):
            return f"store folder {root!r} was replaced by another directory since this store opened it"
        return None

    # ------------------------------------------------------------------ recovery
    def _recover(self) -> dict:
        report: dict[str, Any] = {"removed_temporaries": 0, "removed_duplicates": 0, "bad_files": [], "entries": 0,
                                  "corrupt_files": 0, "corrupt_bytes": 0}
        found = []
        for root in self.paths:
            for shard in sorted(os.listdir(root)):
                d = os.path.join(root, shard)
                if not (len(shard) == 2 and os.path.isdir(d)):
                    continue
                for name in os.listdir(d):
                    p = os.path.join(d, name)
                    if _TMP_NAME.fullmatch(name):  # a put's temporary (only ours: others' files stay)
                        try:
                            os.unlink(p)
                            report["removed_temporaries"] += 1
                        except FileNotFoundError:
                            pass
                        except OSError as exc:  # a read-only folder: open anyway (the file is no entry)
                            self._stats["unlink_errors"] += 1
                            report["bad_files"].append((p, f"a put's temporary that could not be deleted: {exc}"))
                            _log.warning("kvkernels store: could not delete the temporary %s: %s", p, exc)
                        continue
                    if name.endswith(_SUFFIX + ".corrupt"):  # renamed aside by a get that found it damaged
                        try:
                            report["corrupt_bytes"] += os.stat(p).st_size
                            report["corrupt_files"] += 1
                        except OSError:
                            pass
                        continue
                    if not name.endswith(_SUFFIX):
                        continue
                    try:
                        st = os.stat(p)
                        with open(p, "rb") as f:
                            head = f.read(4096)
                            need = int.from_bytes(head[12:16], "little") if len(head) >= 16 else 0
                            if 4096 < need <= (1 << 24):
                                head += f.read(need - 4096)
                        h = Header.unpack(head)
                        if h.digest.hex() + _SUFFIX != name:
                            raise CorruptEntryError("file name does not match the key digest in its header")
                        if st.st_size < h.file_nbytes:  # every put pads its last region to the 4 KiB boundary
                            raise CorruptEntryError(f"truncated: size {st.st_size} < {h.file_nbytes} expected")
                        found.append((st.st_mtime_ns, h.digest, _Entry(p, h, st.st_size)))
                    except (OSError, EOFError) as exc:
                        report["bad_files"].append((p, str(exc)))
        for _, digest, ent in sorted(found, key=lambda x: x[0]):
            old = self._index.pop(digest, None)
            if old is not None:  # a copy under another root (the paths changed): the newest wins
                self._used -= old.nbytes
                self._unlink(old.path)
                report["removed_duplicates"] += 1
            self._index[digest] = ent
            self._used += ent.nbytes
        self._lru = OrderedDict.fromkeys(self._index)  # (nothing is pinned yet)
        for digest, ent in self._index.items():
            # a number of its own, as a put's rename gives: with seq 0 (absent from _file_seq) a
            # recovered entry owned its path again once a newer version there was removed, so a
            # get of it that had read the newer file took the bytes for its own
            ent.seq = next(self._rename_seq)
            if ent.path == self._path_for(digest):
                self._file_seq[digest] = ent.seq
        # reopened with a smaller capacity_bytes: back under it now, not at some later put
        while self.capacity_bytes is not None and self._used > self.capacity_bytes:
            self._drop(next(iter(self._index)))  # the oldest (nothing is pinned yet)
            self._stats["evictions"] += 1
        report["entries"] = len(self._index)
        if report["bad_files"]:  # left for inspection, outside capacity_bytes: said, not only counted
            first = report["bad_files"][0]
            _log.warning("kvkernels store: %d file(s) in %s could not be recovered and are left on disk for inspection "
                         "(not counted in capacity_bytes; stats()['recovery']['bad_files']), e.g. %s: %s",
                         len(report["bad_files"]), ", ".join(self.paths), first[0], first[1])
        if report["corrupt_files"]:  # never deleted by the store (evidence of a failing disk): said at open
            _log.warning("kvkernels store: %d damaged entry file(s) (%d bytes) renamed *.corrupt are in %s, "
                         "left for inspection and not counted in capacity_bytes: delete them when done",
                         report["corrupt_files"], report["corrupt_bytes"], ", ".join(self.paths))
        return report

    def _check_process(self) -> None:
        """Refuse use from a forked child (checked before any of the store's locks: one held by a
        parent thread at the fork stays locked in the child). The child has none of the store's
        threads (a request would never complete) and no lock on its folders (another store may
        be writing them: the parent's)."""
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"KVStore of {', '.join(self.paths)} was opened in process {self._pid} and is used in process "
                f"{os.getpid()} (forked): it has no I/O threads or folder lock here; open a store in this process "
                "(on another folder, or once the parent's store is closed)")

    # ------------------------------------------------------------------ workers
    def _submit(self, prio: int, fn) -> Future:
        return self._submit_many(prio, [fn])[0]

    def _submit_many(self, prio: int, fns) -> list[Future]:
        """Queue requests, all or none (a closed store raises). Their futures are already running:
        a request holds reservations (in-flight bytes, a reader of its entry) that only running
        it gives back, so a caller's ``cancel()`` must not skip it. The closed check and the
        enqueue are one step with ``close()``, so nothing is queued behind the workers' stop."""
        futs = []
        for _ in fns:
            fut: Future = Future()
            fut.set_running_or_notify_cancel()
            futs.append(fut)
        with self._submit_lock:
            if self._closed:
                raise RuntimeError("KVStore is closed")
            for fn, fut in zip(fns, futs):
                self._q.put((prio if self.read_priority else 0, next(self._seq), fn, fut))
        return futs

    def _worker(self) -> None:
        while True:
            _, _, fn, fut = self._q.get()
            if fn is None:
                return
            try:
                res = fn()
            except BaseException as exc:  # delivered through the future
                fut.set_exception(exc)
                continue
            _settle(fut, res)  # a _Later: the rest runs elsewhere, this worker takes the next request

    # ------------------------------------------------------------------ put
    def put(self, key, staging, meta: EntryMeta) -> "Future[Header]":
        """Store ``staging`` under ``key``; returns a Future of the written :class:`Header`.

        ``staging``: a 1-D uint8 tensor of at least ``meta.fmt.nbytes`` bytes in the staging
        format (CPU, pinned, or CUDA: CUDA buffers go straight to the file with kvikio and
        through host memory with POSIX), or a list with one item per region holding that
        region's *stored* bytes (compressed / quantized schemes; at most the region size each).
        An item is a 1-D uint8 tensor or a list of them whose concatenation is the region
        (vectored write: e.g. an LMCache chunk's K and V of one layer, written in place with no
        conversion copy; O_DIRECT in place when each piece is 4 KiB aligned in address and
        size). The buffers must stay unchanged until the future completes. Blocks while more
        than ``max_inflight_bytes`` of puts are pending (back pressure).
        """
        self._check_process()
        digest = key_digest(key)
        if not isinstance(meta, EntryMeta):
            fail("meta", "a kvkernels.io.EntryMeta", type(meta).__name__, TypeError)
        meta.validate()
        fmt = meta.fmt
        if isinstance(staging, (list, tuple)):
            check(len(staging) == fmt.num_regions, "staging", f"{fmt.num_regions} region buffers", len(staging))
            pieces = []
            for j, item in enumerate(staging):
                segs = _check_segments(item, f"staging[{j}]")
                size = sum(t.numel() for t in segs)
                if not 0 < size <= fmt.region_nbytes:
                    why = ""
                    if size > fmt.region_nbytes and meta.scheme.startswith("fp8"):
                        why = (f"; FP8 with its scales is larger than the raw bytes at head_dim {meta.head_dim}: "
                               "store this cache raw")
                    fail(f"staging[{j}]", f"1..{fmt.region_nbytes} bytes (the raw region size){why}", size)
                pieces.append(segs)
        else:
            check_tensor(staging, "staging")
            check_memory(staging, "staging")
            check(staging.dtype == torch.uint8, "staging", "dtype torch.uint8", staging.dtype, TypeError)
            check(staging.dim() == 1 and staging.is_contiguous(), "staging", "a contiguous 1-D buffer", describe(staging))
            check(staging.numel() >= fmt.nbytes, "staging", f"at least {fmt.nbytes} bytes", staging.numel())
            check(meta.codec == "none", "meta.codec", "'none' for a single staging buffer (pass per-region buffers)",
                  meta.codec)
            # an FP8 staging's regions are not at the raw format's offsets: a buffer at least the raw
            # size (a reused scratch buffer) was cut there and stored wrong, without an error
            check(not meta.scheme.startswith("fp8"), "staging",
                  f"per-region buffers for scheme {meta.scheme!r} (an FP8 staging's regions are not at the raw "
                  "format's offsets)", "a single buffer")
            pieces = [[staging[: fmt.nbytes]]]
        nbytes = sum(t.numel() for segs in pieces for t in segs)
        self._acquire_inflight(nbytes)
        try:
            return self._submit(1, lambda: self._do_put(digest, pieces, meta, nbytes))
        except BaseException:
            self._release_inflight(nbytes)
            raise

    def _acquire_inflight(self, n: int) -> None:
        """Wait for this put's turn (first come, first served) and for ``n`` bytes of room (a put
        larger than the bound waits for nothing else to be in flight)."""
        with self._inflight_cv:
            t = self._ticket_next
            self._ticket_next += 1
            try:
                while self._ticket_serving != t or (self._inflight > 0 and
                                                    self._inflight + n > self.max_inflight_bytes):
                    self._inflight_cv.wait()
            except BaseException:  # (KeyboardInterrupt in the wait): the turn passes on, never stuck
                self._tickets_abandoned.add(t)
                self._next_ticket()
                raise
            self._inflight += n
            self._ticket_serving += 1
            self._next_ticket()

    def _next_ticket(self) -> None:
        """Skip the turns of waiters that gave up, and wake the others (condition held)."""
        while self._ticket_serving in self._tickets_abandoned:
            self._tickets_abandoned.discard(self._ticket_serving)
            self._ticket_serving += 1
        self._inflight_cv.notify_all()

    def _release_inflight(self, n: int) -> None:
        with self._inflight_cv:
            self._inflight -= n
            self._inflight_cv.notify_all()

    def _do_put(self, digest: bytes, pieces, meta: EntryMeta, nbytes: int):
        """Write the body (in a worker, hashing beside it); the commit finishes on a commit thread."""
        t0 = time.perf_counter()
        tmp = None
        room = None
        try:
            fmt = meta.fmt
            single = len(pieces) == 1 and len(pieces[0]) == 1 and pieces[0][0].numel() == fmt.nbytes
            if single:
                buf = pieces[0][0]
                host = buf if buf.device.type == "cpu" else buf.cpu()
                regions = [[host[j * fmt.region_nbytes : (j + 1) * fmt.region_nbytes]] for j in range(fmt.num_regions)]
            else:
                regions = [[t if t.device.type == "cpu" else t.cpu() for t in segs] for segs in pieces]
            sizes = [sum(t.numel() for t in segs) for segs in regions]
            # the body's place in the file depends only on the sizes: write it while a helper
            # thread hashes the regions (pwrite and xxh3 both run outside the GIL), then the header
            plan = Header.layout_regions(meta, sizes, [0] * len(sizes))
            final = self._path_for(digest)
            d = os.path.dirname(final)
            gone = self._root_replaced(final)  # (one stat per put)
            if gone is not None:  # a put there would write into another store's folder, or make it anew
                raise OSError(errno.ESTALE, f"{gone}: nothing is written; close this store (and open the "
                                            "folder again if it is still to be used)")
            if d not in self._shards_synced or not os.path.isdir(d):  # (removed from outside: made again)
                # the shard folder's own name must be durable before a put into it is: every put
                # into a folder not yet synced (by this store) syncs its parent — not only the put
                # that created it, which another put could overtake, or whose sync could fail
                try:
                    os.mkdir(d)  # the shard only: a root removed from outside is not made again
                except FileExistsError:
                    pass
                if self.fsync:
                    _fsync_dir(os.path.dirname(d))
                self._shards_synced.add(d)
            room = self._make_room(_round4k(plan[-1].offset + plan[-1].stored), exclude=digest)
            tmp = f"{final}.tmp.{os.getpid()}.{next(self._tmp_seq)}"
            sums_f = self._hasher.submit(lambda: [checksum_segments(_views(segs)) for segs in regions])
            if single:
                # raw staging: the regions are contiguous in memory and in the file: one write
                # (kvikio takes the device buffer itself; POSIX the host copy made for checksums)
                src = pieces[0][0] if self.engine.name == "kvikio" else host
                body = [(plan[0].offset, src)]
            elif self.engine.name == "kvikio":
                body = [(r.offset, _pad_segments(p, _zero_pad())) for r, p in zip(plan, pieces)]
            else:
                body = _coalesce([(r.offset, _pad_segments(segs, _zero_pad())) for r, segs in zip(plan, regions)])
            try:
                self.engine.write_file(tmp, body, fsync=False)
            except BaseException:
                if not sums_f.cancel():
                    sums_f.exception()  # wait: the hasher still reads the caller's buffer
                raise
        except BaseException:
            self._put_failed(tmp, nbytes, room)
            raise
        # header, sync, rename and directory sync run on a commit thread: this worker takes the
        # next request while the disk syncs (the file is complete and private until the rename)
        try:
            return _Later(self._committer.submit(self._commit, digest, meta, sizes, sums_f, tmp, final, nbytes,
                                                 room, t0))
        except BaseException:
            sums_f.exception()
            self._put_failed(tmp, nbytes, room)
            raise

    def _commit(self, digest: bytes, meta: EntryMeta, sizes, sums_f: Future, tmp: str, final: str, nbytes: int,
                room: _Room | None, t0: float) -> Header:
        try:
            header = Header(digest, meta, Header.layout_regions(meta, sizes, sums_f.result()), time.time_ns())
            self.engine.write_header(tmp, header.pack(), fsync=self.fsync)
            with self._lock:  # after any deferred unlink of the path, and any rename into it
                while final in self._unlinking or final in self._renaming:
                    self._unlinked.wait()
                # a key with no file, entry or commit of its own (LMCache's: new content keys)
                # renames outside the lock: nothing else refers to `final` meanwhile (drops and
                # readers unlink only a path whose file they own, other commits of the key wait
                # above), and a rename can take milliseconds while the disk syncs other puts
                alone = digest not in self._index and digest not in self._publishing and digest not in self._file_seq
                if alone:
                    self._renaming.add(final)
                else:  # an older version: the rename and its bookkeeping in one step
                    gen, seq = self._renamed(digest, tmp, final)
            if alone:
                renamed = False
                try:
                    os.replace(tmp, final)
                    renamed = True
                finally:  # the mark never outlives this call (commits of the key wait on it)
                    with self._lock:  # one step: a commit of the key waiting above renames after this
                        self._renaming.discard(final)
                        self._unlinked.notify_all()
                        if renamed:
                            gen, seq = self._renamed(digest, None, final)
        except BaseException:
            self._put_failed(tmp, nbytes, room)
            raise
        sync_error = None
        try:
            if self.fsync:  # the rename is durable before the entry becomes visible
                _fsync_dir(os.path.dirname(final))
        except BaseException as exc:  # noqa: BLE001 - reported through the future, after indexing
            sync_error = exc
        with self._lock:
            # the index follows the file at `final`: the last rename wins. A put whose file was
            # replaced by a later rename of the same key does not index its header (two puts that
            # renamed in one order and indexed in the other left a header describing another file)
            if self._renames.get(digest) == gen:
                old = self._index.pop(digest, None)
                if old is not None:
                    self._used -= old.nbytes
                    self._uncredit(digest)
                    self._retire(old, final)
                self._index[digest] = _Entry(final, header, header.file_nbytes, seq=seq)
                if digest not in self._pins:  # (pins of the key carry over to its new version)
                    self._lru[digest] = None
                    self._lru.move_to_end(digest)
                self._used += header.file_nbytes
            self._unpublish(digest)
            self._release_room(room)
            if sync_error is None:
                self._stats["puts"] += 1
                self._stats["bytes_written"] += nbytes
                self._stats["write_s"] += time.perf_counter() - t0
            else:  # the new file is in place and indexed (a get must not call it corrupt), not durable
                self._stats["put_errors"] += 1
        self._release_inflight(nbytes)
        if sync_error is not None:
            raise sync_error
        return header

    def _renamed(self, digest: bytes, tmp: str | None, final: str) -> tuple[int, int]:
        """Rename ``tmp`` to ``final`` (unless None: done already) and number the rename (lock
        held): the file at the key's path is this commit's from now on."""
        if tmp is not None:
            os.replace(tmp, final)
        self._publishing[digest] = self._publishing.get(digest, 0) + 1
        gen = self._renames[digest] = self._renames.get(digest, 0) + 1  # this rename's order
        seq = self._file_seq[digest] = next(self._rename_seq)
        return gen, seq

    def _retire(self, old: "_Entry", new_path: str) -> None:
        """An older version leaves the index (lock held). Its file was replaced by the rename when it
        lived at the same path; at another path (the store's ``paths`` changed) it is deleted, once
        its last reader is done."""
        if old.path == new_path:
            old.doomed = None
        elif old.readers:
            old.doomed = ""
            self._hold_for_readers(old)
        else:
            self._unlink(old.path)

    def _unpublish(self, digest: bytes) -> None:
        n = self._publishing[digest] - 1
        if n:
            self._publishing[digest] = n
        else:
            del self._publishing[digest]
            self._renames.pop(digest, None)  # no rename of this key in flight: nothing to order

    def _put_failed(self, tmp: str | None, nbytes: int, room: _Room | None = None) -> None:
        try:
            # the temporary is this put's alone (no other call knows its name): deleted before
            # the lock is taken, so a storm of failing puts (a full disk) never holds up
            # `contains`, `get` or `pin`; its room is given back after, when its bytes are gone.
            # A refused delete (EROFS after an EIO remounted the file system read-only) is logged
            # and counted, not raised: the put's own error stays the one its future reports, and
            # the next open's recovery deletes the temporary
            removed = True
            try:
                if tmp is not None:
                    removed = _remove_file(tmp)
            finally:
                with self._lock:
                    self._stats["put_errors"] += 1
                    self._stats["unlink_errors"] += not removed
                    self._release_room(room)
        finally:  # in-flight bytes never stay counted (they would block every later put)
            self._release_inflight(nbytes)

    def _make_room(self, need: int, exclude: bytes) -> _Room | None:
        """Evict LRU entries until ``need`` more bytes fit, and reserve them (returned; released
        when the put commits or fails), so concurrent puts cannot overshoot the capacity."""
        if self.capacity_bytes is None:
            return None
        if need > self.capacity_bytes:
            raise ValueError(f"`staging`: entry of {need} bytes exceeds capacity_bytes={self.capacity_bytes}")
        doomed: list[tuple[str, int]] = []  # the victims' files, unlinked once the lock is released
        try:
            return self._make_room_locked(need, exclude, doomed)
        finally:
            self._unlink_deferred(doomed)

    def _make_room_locked(self, need: int, exclude: bytes, doomed: list[tuple[str, int]]) -> _Room | None:
        with self._lock:
            def others_pending() -> int:  # files other calls are deleting (this call's go before its write)
                return self._pending_unlink - sum(n for _, n in doomed)

            # strict: files of entries evicted while being read count (they stay until the reads
            # end) and entries being read are not evicted (that frees nothing now). When that
            # cannot make room, the rule before 2026-11-25: entries being read may be evicted and
            # their files overshoot the capacity until the reads end. Never a wait for a read: a
            # put waiting in the only I/O worker for a read queued behind it would wait for ever
            strict = True

            def fits(freed: int = 0, pending: bool = True) -> bool:
                cur = self._index.get(exclude)
                mine = cur.nbytes if cur is not None and exclude not in self._credits else 0
                assert self.capacity_bytes is not None  # (_make_room returned already without a capacity)
                held = self._used + (others_pending() if pending else 0) + (self._read_held if strict else 0)
                return held + self._reserved - self._credit - mine - freed + need <= self.capacity_bytes

            def wait_for_room() -> None:
                # files of this call's victims first: a commit into one of their paths would wait
                # for them, and this wait for that commit
                self._unlink_deferred(doomed)
                doomed.clear()
                self._room.wait()

            while not fits():
                if others_pending() > 0 and fits(pending=False):
                    wait_for_room()  # deletes under way free enough: evict nothing more
                    continue
                # the oldest evictable entries until they would make room (an entry a put in
                # flight replaces frees nothing more when evicted: its credit counts it already);
                # a walk of the index only as far as needed, at capacity on every put
                victims, freed = [], 0
                for digest in self._lru:
                    if digest == exclude or digest in self._credits:
                        continue
                    ent = self._index[digest]
                    if strict and ent.readers:
                        continue
                    victims.append(digest)
                    freed += ent.nbytes
                    if fits(freed):
                        break
                if fits(freed):
                    for digest in victims:
                        self._drop(digest, defer=doomed)
                        self._stats["evictions"] += 1
                elif strict and (self._read_held or any(self._index[d].readers for d in self._lru)):
                    strict = False  # only reads in progress stand in the way: the old rule
                elif self._reserved or others_pending() > 0:
                    # only puts in flight (one fails, or its entry becomes evictable) or deletes
                    # under way could make room: wait for one, evicting nothing yet
                    wait_for_room()
                else:  # nothing is evicted for a put that cannot fit anyway
                    raise OSError(errno.ENOSPC, f"store full: {self._used} of {self.capacity_bytes} bytes held by "
                                  f"pinned entries ({len(self._pins)} pinned), puts in flight ({self._reserved} B) "
                                  f"or the entry being replaced")
            self._reserved += need
            cur = self._index.get(exclude)
            if cur is not None:
                c = self._credits.get(exclude)
                if c is None:
                    c = self._credits[exclude] = _Credit(cur, [])
                c.reservations.append(need)
                self._recredit(c)
            return _Room(need, exclude, cur)

    def _recredit(self, c: _Credit) -> None:
        """A credit's value (lock held): the replaced entry's size, but never more than the
        smallest put in flight replacing it reserved — a put replacing a large entry with a small
        one must not lend others room that exists only if it commits (it may fail, and the old
        entry's bytes stay)."""
        value = min(c.entry.nbytes, min(c.reservations))
        self._credit += value - c.value
        c.value = value

    def _release_room(self, room: _Room | None) -> None:
        """Give back a put's reservation and its share of the credit (lock held)."""
        if room is None:
            return
        self._reserved -= room.nbytes
        c = self._credits.get(room.digest)
        if c is not None and c.entry is room.replaces:  # (not when that version left the index meanwhile)
            c.reservations.remove(room.nbytes)
            if c.reservations:
                self._recredit(c)
            else:
                del self._credits[room.digest]
                self._credit -= c.value
        self._room.notify_all()

    def _uncredit(self, digest: bytes) -> None:
        """``digest``'s indexed entry leaves the index (lock held): its bytes are no longer counted
        as leaving with a put in flight (they left)."""
        c = self._credits.pop(digest, None)
        if c is not None:
            self._credit -= c.value

    def _drop(self, digest: bytes, rename_to: str | None = None, expect: _Entry | None = None,
              defer: list[tuple[str, int]] | None = None) -> bool:
        """Remove an entry from the index and its file from disk (deferred while it is read).

        ``expect``: drop only if the indexed entry is still this one (a checksum failure seen by
        a reader must not drop a newer version published meanwhile). File operations happen
        under the lock, as publishing does, so a drop never removes a newer version's file;
        with ``defer`` (a list) the unlink is the caller's, once it released the lock
        (:meth:`_unlink_deferred`): the path is held in ``_unlinking`` until then, and a commit
        into it waits.
        """
        with self._lock:
            ent = self._index.get(digest)
            if ent is None or (expect is not None and ent is not expect):
                return False
            del self._index[digest]
            self._pins.pop(digest, None)
            self._lru.pop(digest, None)
            self._used -= ent.nbytes
            self._uncredit(digest)
            if ent.readers:
                ent.doomed = rename_to or ""
                if self._owns_file(digest, ent):
                    self._hold_for_readers(ent)
            elif self._owns_file(digest, ent):
                self._unlink_entry(digest, ent, rename_to, defer)
            return True

    def _hold_for_readers(self, ent: "_Entry") -> None:
        """``ent`` left the index while being read (lock held): its file stays until the last
        reader finishes, and its bytes count against the capacity until then."""
        if not ent.held:
            ent.held = ent.nbytes
            self._read_held += ent.nbytes

    def _owns_file(self, digest: bytes, ent: "_Entry") -> bool:
        """The file at ent.path is still ent's own (no later rename replaced it; lock held)."""
        return ent.path != self._path_for(digest) or self._file_seq.get(digest, 0) == ent.seq

    def _unlink_entry(self, digest: bytes, ent: "_Entry", rename_to: str | None,
                      defer: list[tuple[str, int]] | None = None) -> None:
        if ent.path == self._path_for(digest):
            self._file_seq.pop(digest, None)
        if defer is not None and not rename_to:
            self._unlinking[ent.path] = self._unlinking.get(ent.path, 0) + 1
            self._pending_unlink += ent.nbytes
            defer.append((ent.path, ent.nbytes))
        else:
            self._unlink(ent.path, rename_to)

    def _unlink_deferred(self, doomed: list[tuple[str, int]]) -> None:
        """The unlinks :meth:`_drop` and :meth:`_release_reader` deferred (``(path, bytes)``;
        called after the caller released the lock: file-system time never holds up
        ``contains``, ``get`` or ``pin``); then the paths are free for commits again and their
        bytes for room checks. Errors as
        :meth:`_unlink`'s: logged and counted, never raised. The bookkeeping survives an
        interrupt (a Ctrl-C in its lock's acquire left a path pending for good: commits into it
        and ``close()`` waited for ever); the interrupt is raised after it."""
        if not doomed:
            return
        failed = 0
        try:
            for path, _ in doomed:
                failed += not self._remove_own(path)
        finally:
            left, interrupted = list(doomed), None
            while left:
                try:
                    with self._lock:
                        while left:
                            path, nbytes = left[-1]
                            n = self._unlinking.pop(path) - 1
                            if n:
                                self._unlinking[path] = n
                            self._pending_unlink -= nbytes
                            left.pop()
                        self._stats["unlink_errors"] += failed
                        failed = 0
                        self._unlinked.notify_all()
                        self._room.notify_all()
                except BaseException as exc:  # noqa: BLE001 - re-raised once the paths are released
                    interrupted = exc
            if interrupted is not None:
                raise interrupted

    def _unlink(self, path: str, rename_to: str | None = None) -> None:
        """Delete (or rename aside) a file that has already left the index. Called with the lock
        held from paths that must finish their bookkeeping (a commit, a drop, a reader's release),
        so a refusal of the file system (read-only, permissions) is logged and counted
        (``stats()["unlink_errors"]``), not raised: the index stays true and the store keeps
        working; the file is found again by the next open's recovery."""
        if not self._remove_own(path, rename_to):
            self._stats["unlink_errors"] += 1

    def _remove_own(self, path: str, rename_to: str | None = None) -> bool:
        """:func:`_remove_file`, unless the folder was replaced since the open (the file of that
        name is another store's now): then nothing is touched, a warning, False."""
        gone = self._root_replaced(path)
        if gone is not None:
            _log.warning("kvkernels store: %s: %s left alone", gone, path)
            return False
        return _remove_file(path, rename_to)

    # ------------------------------------------------------------------ get
    def header(self, key) -> Header | None:
        """The stored header of ``key`` (stored sizes, scheme, codec), or None (also once the
        store is closed: its index is stale, the folder may be another store's)."""
        self._check_process()
        digest = key_digest(key)
        with self._lock:
            ent = None if self._closed else self._index.get(digest)
            return ent.header if ent else None

    def get(self, key, out=None, layers=None, *, expect: Header | None = None) -> Future:
        """Read ``key``'s regions for ``layers`` (default: all stored) into ``out``.

        ``out`` is either one buffer or one destination per region:

        * a 1-D uint8 tensor (CPU / pinned with any engine; CUDA: kvikio reads straight into
          it, POSIX stages through host memory), allocated on the CPU when ``None``: region
          ``j`` (the ``j``-th requested layer in ascending order) lands at ``out[j * region_nbytes:]`` — the
          staging format restricted to ``layers``, ready for ``kvkernels.scatter(..., layers=)``;
        * a list with one item per requested layer, in the order of ``layers`` (``out[j]``
          receives ``layers[j]``), each a 1-D uint8 tensor or a list of them
          filled back to back (vectored read straight into the caller's memory, e.g. an LMCache
          chunk's K and V of that layer); an item must hold at least the region's stored bytes.

        For compressed schemes a region holds its stored bytes (``header(key)`` gives their
        sizes). The future gives ``out`` back; it raises ``KeyError`` on a miss and
        ``CorruptEntryError`` when a checksum fails (the entry is then dropped, and the bytes
        already in ``out`` must not be used). A closed store raises ``RuntimeError`` (hit or miss).

        ``expect``: a :class:`Header` from ``header(key)`` (or a put's future): read only that
        version's bytes. When the key holds another version (or none), or that version is
        replaced while it is read, the get is a miss (``KeyError``) instead of reading the newer
        one — unless the newer one holds the same bytes (a put of identical content: same
        description, region sizes and checksums) — so several gets of one entry's layers (a
        streamed restore reads its layers in groups) never combine two versions.
        """
        self._check_process()
        digest = key_digest(key)
        _check_expect(expect)
        if self._closed:  # a miss too: a closed store's index is stale (a hit is refused at submit)
            raise RuntimeError("KVStore is closed")
        with self._lock:
            ent = self._index.get(digest)
            if ent is None or (expect is not None and not _same_content(ent.header, expect)):
                if expect is not None:
                    # the caller's arguments are checked against the version it expects, so a bad
                    # ``layers`` or ``out`` is an error whether or not that version is still there
                    _plan_read(expect, layers, out, allocate=False)
                self._stats["gets"] += 1
                self._stats["misses"] += 1
                fut: Future = Future()
                fut.set_exception(KeyError(key) if ent is None else
                                  KeyError(f"{key!r}: the stored version is not the one expected (replaced)"))
                return fut
            sel, dests, out = _plan_read(ent.header, layers, out)
            ent.readers += 1
            self._index.move_to_end(digest)
            if digest in self._lru:
                self._lru.move_to_end(digest)
        pinned = expect is not None  # retried only on a version of the same content
        try:
            if self.io_threads > 1 and self._q.empty():
                # a lone get (nothing else queued) of a large entry: its groups are read in parallel
                # by several workers (one O_DIRECT stream reads slower than several: dd's QD 1 runs
                # at ~1.0 GB/s on the CPU host's disk where 4 readers reach ~1.6)
                groups = _plan_groups(sel, dests, min(READ_GROUP_SPLIT, self.io_threads))
                if len(groups) > 1 and sum(r.stored for r in sel) >= 2 * READ_GROUP_MIN:
                    return self._fan_out(digest, ent, sel, dests, groups, out, 0, pinned)
            return self._submit(0, lambda: self._do_get(digest, ent, sel, dests, out, 0, pinned))
        except BaseException:  # nothing was queued (a closed store): the reader goes back
            self._release_reader(ent)
            raise

    def _read_failed(self, digest: bytes, ent: _Entry, sel, dests, out, attempt: int, why: str,
                     bad: list[int] | None = None, pinned: bool = False) -> _Later:
        """A read whose bytes failed their checksum, ended early or found no file.

        Either the file is corrupt (or gone), or a put of the same key replaced it while it was
        being read (reads open the entry's path, which the put's rename gives the new version, and
        which a remove of that new version unlinks). A replaced entry is no corruption: when the
        new version is indexed with the same description and region sizes (the caller's
        ``header()`` and destinations still hold) the read is retried on it, up to
        :data:`READ_RETRIES` times; otherwise (other sizes, a version still being published, or
        none indexed any more) the get is a miss (``KeyError``).

        A checksum mismatch on the indexed version (``bad``: the layers) is checked once more
        on bytes the store reads into its own buffer: when those match, the file is sound and
        the caller's destination changed during the read (a buffer shared by two gets, or
        overlapping destinations): the entry is kept and the get fails with ``RuntimeError``.
        """
        if bad and self._reads_intact(digest, ent, [r for r in sel if r.layer in set(bad)]):
            with self._lock:
                self._stats["disturbed_reads"] += 1
            raise RuntimeError(
                f"`out`: the bytes read for layer {bad[0]} of {ent.path} changed in the destination before "
                "they were verified (the stored entry re-reads intact and is kept): was the destination "
                "shared with another read, or written meanwhile? The destination must not be used")
        with self._lock:
            cur = self._index.get(digest)
            replaced = cur is not ent or not self._owns_file(digest, ent)
            if replaced:
                self._stats["replaced_reads"] += 1
                # (cur is ent while the new version is renamed but not yet indexed: nothing to retry on)
                same = (cur is not None and cur is not ent and attempt < READ_RETRIES
                        and cur.header.meta == ent.header.meta
                        and (not pinned or _same_content(cur.header, ent.header)))
                if same:
                    assert cur is not None  # (same only with cur)
                    have = {r.layer: r for r in cur.header.regions}
                    new = [have.get(r.layer) for r in sel]
                    same = all(n is not None and n.stored == r.stored for n, r in zip(new, sel))
                if same:
                    assert cur is not None  # (same only with cur)
                    cur.readers += 1
                    sel = new
                else:
                    cur = None
        if not replaced:
            raise self._corrupt(digest, ent, why)
        if cur is None:
            with self._lock:
                self._stats["gets"] += 1
                self._stats["misses"] += 1
            raise KeyError(f"{ent.path}: replaced or removed while being read ({why})")
        try:
            return _Later(self._submit(0, lambda: self._do_get(digest, cur, sel, dests, out, attempt + 1, pinned)))
        except BaseException:  # the store is closing: give the reader back
            self._release_reader(cur)
            raise

    def _fan_out(self, digest: bytes, ent: _Entry, sel, dests, groups, out, attempt: int = 0,
                 pinned: bool = False) -> Future:
        """One get as parallel group reads (each verifies its own regions); the returned future
        completes when all have, with the same outcomes as :meth:`_do_get`."""
        t0 = time.perf_counter()
        outer: Future = Future()
        outer.set_running_or_notify_cancel()
        with self._lock:
            ent.readers += len(groups) - 1  # one per group read (get() took the first)
        try:  # all groups queued, or none
            subs = self._submit_many(0, [functools.partial(self._read_group, ent, off, segs, js, sel, dests)
                                         for off, segs, js in groups])
        except BaseException:
            for _ in range(len(groups) - 1):  # the caller gives back the first
                self._release_reader(ent)
            raise
        left = [len(subs)]
        lock = threading.Lock()

        def joined(_f) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            try:  # the group reads return their failed layers, as the checks of _do_get do
                _settle(outer, self._finish_get(digest, ent, sel, subs, out, t0, dests, attempt, pinned))
            except BaseException as exc:
                outer.set_exception(exc)

        for f in subs:
            f.add_done_callback(joined)
        return outer

    def _read_group(self, ent: _Entry, off: int, segs, js, sel, dests) -> list[int]:
        """One group of a fanned-out get: read, release the file, verify; the layers that failed."""
        try:
            self.engine.read_into(ent.path, [(off, segs)])
            self._check_not_replaced(ent)
        finally:
            self._release_reader(ent)
        return self._verify(sel, dests, js) if self.verify else []

    def _check_not_replaced(self, ent: _Entry) -> None:
        """With ``verify=False``: raise :class:`_Replaced` when a rename replaced ``ent``'s file
        since it was indexed. Called after a read: a read that opened the path after the rename
        read the new version, which only the checksums (``verify=True``) would catch, exactly. A
        read that opened the path before the rename read ``ent``'s bytes; nothing tells it from
        the other here, so it is retried all the same."""
        if self.verify:
            return
        with self._lock:
            owned = self._owns_file(ent.header.digest, ent)
        if not owned:
            raise _Replaced("replaced during the read")

    def _release_reader(self, ent: _Entry) -> None:
        doomed: list[tuple[str, int]] = []  # an entry dropped while read: its file goes after the lock
        try:
            with self._lock:  # the file is no longer read: a deferred drop may unlink it now
                ent.readers -= 1
                if ent.readers == 0 and ent.held:  # (an unlink deferred below counts them again)
                    self._read_held -= ent.held
                    ent.held = 0
                    self._room.notify_all()
                if ent.readers == 0 and ent.doomed is not None:
                    # unless a newer version of the key lives (or is being published) at the same path
                    digest = ent.header.digest
                    if self._owns_file(digest, ent):
                        self._unlink_entry(digest, ent, ent.doomed or None, doomed)
                    ent.doomed = None
        finally:
            self._unlink_deferred(doomed)

    def _do_get(self, digest: bytes, ent: _Entry, sel, dests: list[list[torch.Tensor]], out, attempt: int = 0,
                pinned: bool = False) -> object:
        """Read the regions (in a worker); their verification finishes on the hasher threads, so
        the worker is free for the next read as soon as its bytes are in (the disk keeps its
        queue depth while checksums run)."""
        t0 = time.perf_counter()
        try:
            # regions that follow each other in the file are read in groups (one vectored read of
            # up to READ_GROUP_BYTES); when no other read is queued (a lone, latency-bound get)
            # the entry is split into READ_GROUP_SPLIT groups so the hasher verifies group k
            # while group k + 1 is read
            groups = _plan_groups(sel, dests, READ_GROUP_SPLIT if self._q.empty() else 1)
            checks = []
            for off, segs, js in groups:
                self.engine.read_into(ent.path, [(off, segs)])
                if self.verify:
                    checks.append(self._hasher.submit(self._verify, sel, dests, js))
            self._check_not_replaced(ent)
        except (EOFError, FileNotFoundError, _Replaced) as exc:
            short: Exception | None = exc
        else:
            short = None
        finally:
            self._release_reader(ent)
        if short is not None:
            return self._read_failed(digest, ent, sel, dests, out, attempt, _short_read(short), pinned=pinned)
        if not checks:
            return self._got(sel, out, t0)
        # the finisher waits only on checks queued before it (FIFO): they are running or done
        return _Later(self._hasher.submit(self._finish_get, digest, ent, sel, checks, out, t0, dests, attempt, pinned))

    def _finish_get(self, digest: bytes, ent: _Entry, sel, checks, out, t0: float, dests, attempt: int,
                    pinned: bool = False):
        """Collect the failed layers of ``checks`` (futures of lists); the get's result, its retry
        (a :class:`_Later`) or its error."""
        try:
            bad = [b for f in checks for b in f.result()]
        except (EOFError, FileNotFoundError, _Replaced) as exc:  # a fanned-out group read came up short
            return self._read_failed(digest, ent, sel, dests, out, attempt, _short_read(exc), pinned=pinned)
        if bad:
            why = f"region of layer {bad[0]}: checksum mismatch"
            return self._read_failed(digest, ent, sel, dests, out, attempt, why, bad, pinned)
        return self._got(sel, out, t0)

    def _reads_intact(self, digest: bytes, ent: _Entry, regions) -> bool:
        """True when ``regions`` of ``ent``, still the indexed version, read into a buffer of the
        store's own match their checksums (a mismatch seen in the caller's destination was not
        the file's). False when the file fails again, is gone or was replaced meanwhile."""
        with self._lock:
            if self._index.get(digest) is not ent or not self._owns_file(digest, ent):
                return False
            ent.readers += 1
        try:
            for r in regions:
                buf = aligned_empty(r.stored)
                self.engine.read_into(ent.path, [(r.offset, [buf])])
                if checksum_segments(_views([buf])) != r.checksum:
                    return False
            return True
        except (OSError, EOFError):
            return False
        finally:
            self._release_reader(ent)

    def _corrupt(self, digest: bytes, ent: _Entry, why: str) -> CorruptEntryError:
        """Count a corrupt entry, drop it (renamed ``*.corrupt``; only the version that was read)
        and return the error for the get's future."""
        with self._lock:
            self._stats["corrupt"] += 1
        self._drop(digest, rename_to=".corrupt", expect=ent)
        return CorruptEntryError(f"{ent.path}: {why}; entry dropped (the destination buffer must not be used)")

    def _got(self, sel, out, t0: float):
        with self._lock:
            self._stats["gets"] += 1
            self._stats["hits"] += 1
            self._stats["bytes_read"] += sum(r.stored for r in sel)
            self._stats["read_s"] += time.perf_counter() - t0
        return out

    @staticmethod
    def _verify(sel, dests, js) -> list[int]:
        """Layers among regions ``js`` whose checksum does not match (device bytes hashed from a host copy)."""
        return [sel[j].layer for j in js
                if checksum_segments(_views([t if t.device.type == "cpu" else t.cpu() for t in dests[j]]))
                != sel[j].checksum]

    # ------------------------------------------------------------------ misc
    @staticmethod
    def check_key(key) -> None:
        """``TypeError`` (naming ``key``) unless ``key`` is one the store takes: a ``str`` or
        bytes-like (``bytes``, ``bytearray``, ``memoryview``). Only hashed, never a path.
        A type check only (no hashing)."""
        if not isinstance(key, KEY_TYPES):
            key_digest(key)  # raises the calls' own TypeError

    def contains(self, key) -> bool:
        """True when ``key`` has a complete entry (no I/O); False once the store is closed (a
        closed store answers as an empty one: ``header`` None, ``pin`` / ``unpin`` False)."""
        self._check_process()
        digest = key_digest(key)
        with self._lock:
            return not self._closed and digest in self._index

    def remove(self, key, *, expect: Header | None = None) -> bool:
        """Delete ``key``'s entry (pinned or not: an explicit remove wins); False if absent.

        ``expect``: a :class:`Header` from ``header(key)``: delete only that version, or one of the
        same bytes (False when the key holds other content now: e.g. a put replaced the version
        found unusable). ``RuntimeError`` once the store is closed."""
        doomed: list[tuple[str, int]] = []
        try:
            return self._remove_deferring(key, doomed, expect=expect)
        finally:  # after the locks (close() waits for it: the folder stays this store's until then)
            self._unlink_deferred(doomed)

    def _remove_deferring(self, key, doomed: list[tuple[str, int]], *, expect: Header | None = None) -> bool:
        """:meth:`remove` whose file delete is left to the caller: its path goes into ``doomed``,
        for :meth:`_unlink_deferred` once the caller released its own locks (the L2 adapter's
        delete batches). ``close()`` waits for such deletes."""
        self._check_process()
        _check_expect(expect)
        digest = key_digest(key)
        # one step with close(), as a submit is: once closed, the folder may be another store's
        with self._submit_lock:
            if self._closed:
                raise RuntimeError("KVStore is closed")
            if expect is None:
                return self._drop(digest, defer=doomed)
            with self._lock:  # (reentrant: _drop takes it too)
                ent = self._index.get(digest)
                return ent is not None and _same_content(ent.header, expect) and self._drop(digest, expect=ent,
                                                                                             defer=doomed)

    def pin(self, key) -> bool:
        """Protect ``key``'s entry from LRU eviction until a matching :meth:`unpin`; False if absent.

        Pins count (two pins need two unpins). A pinned entry can still be removed explicitly,
        and a checksum failure still drops it. When pinned entries leave no room for a put,
        that put fails with ``OSError(ENOSPC)`` and the store keeps working.
        """
        self._check_process()
        digest = key_digest(key)
        with self._lock:
            if self._closed or digest not in self._index:
                return False
            self._pins[digest] = self._pins.get(digest, 0) + 1
            self._lru.pop(digest, None)
            return True

    def unpin(self, key) -> bool:
        """Undo one :meth:`pin`; False if ``key`` was not pinned."""
        self._check_process()
        digest = key_digest(key)
        with self._lock:
            n = 0 if self._closed else self._pins.get(digest, 0)
            if n == 0:
                return False
            if n == 1:
                del self._pins[digest]
                if digest in self._index:  # (always: a drop takes the pins with the entry)
                    self._lru[digest] = None
            else:
                self._pins[digest] = n - 1
            return True

    def pin_count(self, key) -> int:
        """Current number of pins on ``key`` (0 when unpinned or absent)."""
        self._check_process()
        digest = key_digest(key)
        with self._lock:
            return 0 if self._closed else self._pins.get(digest, 0)

    def stats(self) -> dict:
        self._check_process()
        with self._lock:
            d: dict[str, Any] = dict(self._stats)
            d.update(entries=len(self._index), pinned=len(self._pins), bytes_used=self._used, capacity_bytes=self.capacity_bytes,
                     inflight_bytes=self._inflight, engine=self.engine.name, paths=list(self.paths),
                     io_threads=self.io_threads, read_priority=self.read_priority, recovery=self.recovery)
        return d

    def __len__(self) -> int:
        return 0 if self._closed else len(self._index)

    def close(self) -> None:
        """Finish queued work, stop the workers, release the folders. Idempotent; a call that was
        interrupted (KeyboardInterrupt in the wait) is finished by the next one, and the folders
        stay locked until then: queued writes may still be running.
        In a forked child it only lets go of the inherited store (the parent's work and lock stay
        the parent's)."""
        if os.getpid() != self._pid:
            self._close_done = True
            _unlock(self._locks)  # a no-op for the parent's descriptors (the child closed its copies)
            return
        with self._submit_lock:
            if self._close_done:
                return
            if not self._closed:
                self._closed = True
                for _ in self._workers:  # after everything queued so far (priority 9 sorts last)
                    self._q.put((9, next(self._seq), None, None))
        for w in self._workers:
            w.join()
        self._committer.shutdown(wait=True)
        self._hasher.shutdown(wait=True)
        with self._lock:  # deferred deletes of removed entries finish in these folders, not the next owner's
            while self._unlinking:
                self._unlinked.wait()
        self._close_done = True
        _OPEN_STORES.discard(self)
        _unlock(self._locks)  # the folders are free for the next store

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()



def _plan_read(h: Header, layers, out, *, allocate: bool = True):
    """``get``'s arguments checked against header ``h``: the regions to read, one list of
    destination segments per region, and ``out`` (allocated when ``None`` and ``allocate``)."""
    if layers is None:
        sel = list(h.regions)
    else:
        from kvkernels.staging import normalize_layers

        if not isinstance(layers, (int, torch.Tensor)):
            try:
                layers = list(layers)  # read once (a generator), kept for the order below
            except TypeError:
                pass  # normalize_layers says what is wrong
        want = normalize_layers(layers, h.meta.num_layers)
        if isinstance(out, (list, tuple)) and isinstance(layers, list):
            want = tuple(layers)  # out[j] receives layers[j]: the caller's order, checked above
        have = {r.layer: r for r in h.regions}
        missing = [l for l in want if l not in have]
        check(not missing, "layers", f"layers stored for this key {tuple(have)}", missing)
        sel = [have[l] for l in want]
    region = h.meta.fmt.region_nbytes
    if isinstance(out, (list, tuple)):
        check(len(out) == len(sel), "out", f"{len(sel)} region destinations (one per layer read)", len(out))
        dests = []
        for j, (r, item) in enumerate(zip(sel, out)):
            segs = _check_segments(item, f"out[{j}]")
            have_n = sum(t.numel() for t in segs)
            check(have_n >= r.stored, f"out[{j}]", f"at least {r.stored} bytes (layer {r.layer})", have_n)
            dests.append(_take(segs, r.stored))
        _check_disjoint(dests)
    else:
        total = len(sel) * region
        if out is None:
            if not allocate:
                return sel, [], None
            out = aligned_empty(total)
        else:
            check_tensor(out, "out")
            check_memory(out, "out")
            check(out.dtype == torch.uint8, "out", "dtype torch.uint8", out.dtype, TypeError)
            check(out.dim() == 1 and out.is_contiguous(), "out", "a contiguous 1-D buffer", describe(out))
            check(out.numel() >= total, "out", f"at least {total} bytes", out.numel())
        dests = [[out[j * region : j * region + r.stored]] for j, r in enumerate(sel)]
    return sel, dests, out


def _check_expect(expect) -> None:
    if expect is not None and not isinstance(expect, Header):
        fail("expect", "a kvkernels.io.Header from header(key) or None", type(expect).__name__, TypeError)


def _same_content(a: Header, b: Header) -> bool:
    """Two headers describe the same bytes: one version, or a put of identical content (same
    description, and every region's layer, stored size and checksum)."""
    return a is b or (a.meta == b.meta and [(r.layer, r.stored, r.checksum) for r in a.regions]
                      == [(r.layer, r.stored, r.checksum) for r in b.regions])


def _short_read(exc: BaseException) -> str:
    if isinstance(exc, _Replaced):
        return str(exc)
    return "file missing" if isinstance(exc, FileNotFoundError) else f"truncated ({exc})"


def _check_segments(item, name: str) -> list[torch.Tensor]:
    """One region given as a tensor or a list of tensors: each 1-D, uint8, contiguous, one device."""
    segs = [item] if isinstance(item, torch.Tensor) else list(item) if isinstance(item, (list, tuple)) else None
    if segs:  # fast path (a region of an LMCache chunk is checked per get: keep it cheap)
        dev = segs[0].device if isinstance(segs[0], torch.Tensor) else None
        if dev is not None and dev.type in ("cpu", "cuda") and all(
                type(t) is torch.Tensor and t.dtype is torch.uint8 and t.dim() == 1 and t.is_contiguous()
                and t.device == dev for t in segs):
            return segs
    if not segs:
        fail(name, "a 1-D uint8 tensor or a non-empty list of them", type(item).__name__, TypeError)
    for k, t in enumerate(segs):
        nm = name if len(segs) == 1 and isinstance(item, torch.Tensor) else f"{name}[{k}]"
        check_tensor(t, nm)
        check(t.dtype == torch.uint8, nm, "dtype torch.uint8", t.dtype, TypeError)
        check(t.dim() == 1 and t.is_contiguous(), nm, "a contiguous 1-D uint8 tensor", describe(t))
        check(t.device == segs[0].device, nm, f"device {segs[0].device} (as the region's first piece)", t.device)
        check_memory(t, nm)
    return segs


def _round4k(n: int) -> int:
    return -(-n // 4096) * 4096


def _plan_groups(sel, dests, split: int) -> list[tuple[int, list[torch.Tensor], list[int]]]:
    """``(file offset, pieces, region indices)`` per read: regions that follow each other in the
    file, up to ``READ_GROUP_BYTES`` and at least ``split`` groups (of ``READ_GROUP_MIN`` or more)."""
    groups: list[tuple[int, list[torch.Tensor], list[int]]] = []
    end = None
    total = sum(r.stored for r in sel)
    limit = min(READ_GROUP_BYTES, max(READ_GROUP_MIN, -(-total // max(1, split))))
    size = 0  # bytes of the current group
    for j, (r, segs) in enumerate(zip(sel, dests)):
        if groups and r.offset == end and size + r.stored <= limit and len(groups[-1][1]) + len(segs) <= 512:
            groups[-1][1].extend(segs)
            groups[-1][2].append(j)
            size += r.stored
        else:
            groups.append((r.offset, list(segs), [j]))
            size = r.stored
        end = r.offset + r.stored if r.stored % 4096 == 0 else None
    return groups


def _check_disjoint(dests: list[list[torch.Tensor]]) -> None:
    """Destinations of one get must not share bytes: the second region read would overwrite the
    first before its checksum is taken."""
    spans = sorted((t.device.type, t.device.index or 0, t.data_ptr(), t.data_ptr() + t.numel(), j)
                   for j, segs in enumerate(dests) for t in segs if t.numel())
    for a, b in zip(spans, spans[1:]):
        if a[:2] == b[:2] and b[2] < a[3]:
            fail("out", "destinations that do not overlap", f"out[{a[4]}] and out[{b[4]}] share bytes")


def _take(segs: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The leading ``n`` bytes of the back-to-back ``segs``."""
    if sum(t.numel() for t in segs) == n:
        return segs
    out = []
    for t in segs:
        if n <= 0:
            break
        out.append(t[:n])
        n -= out[-1].numel()
    return out


def _views(segs) -> list[memoryview]:
    return [memoryview(t.numpy()) for t in segs if t.numel()]


_ZERO = None


def _zero_pad() -> torch.Tensor:
    """4096 zero bytes, 4 KiB aligned (the tail that pads a region to its 4 KiB boundary)."""
    global _ZERO
    if _ZERO is None:
        _ZERO = aligned_empty(4096).zero_()
    return _ZERO


def _pad_segments(segs: list[torch.Tensor], zero: torch.Tensor) -> list[torch.Tensor]:
    """The region's pieces followed by zeros up to the next multiple of 4096 bytes."""
    n = sum(t.numel() for t in segs)
    tail = (-n) % 4096
    return list(segs) + ([zero[:tail]] if tail else [])


def _coalesce(pieces, max_segments: int = 512, max_bytes: int = READ_GROUP_BYTES):
    """Merge pieces that follow each other in the file into one vectored transfer (fewer syscalls)."""
    out: list[tuple[int, list[torch.Tensor]]] = []
    end = None
    size = 0
    for off, segs in pieces:
        n = sum(t.numel() for t in segs)
        if out and off == end and len(out[-1][1]) + len(segs) <= max_segments and size + n <= max_bytes:
            out[-1][1].extend(segs)
            size += n
        else:
            out.append((off, list(segs)))
            size = n
        end = off + n
    return out
