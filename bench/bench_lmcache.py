"""Benchmark: the kvkernels LMCache plugin against LMCache's built-in LocalDiskBackend, same disk.

Both backends are created by LMCache's own ``CreateStorageBackends`` from a config, in the same
process, on sibling directories of a new ``kvk-bench-lmcache-*`` folder inside ``--dir`` (removed at
the end; nothing else in ``--dir`` is touched); chunks are real ``MemoryObj`` (``KV_2LTD``) from
LMCache's ``LocalCPUBackend`` allocator, llama3-8b-shaped by default: 32 layers, 8 kv heads,
head_dim 128, bf16, 256-token chunks (32 MiB each).

Measured per backend (medians of ``--reps``):

* ``store``: ``batched_submit_put_task`` of ``--chunks`` chunks until every one is stored (its
  ``on_complete_callback``; visibility through ``contains`` is checked after, untimed) —
  throughput GB/s; ``put_ms``: one chunk, submit -> stored, latency;
* ``retrieve``: ``batched_get_blocking`` of all chunks with the page cache dropped for the files
  (``posix_fadvise(DONTNEED)``) — GB/s; ``get_ms``: one cold ``get_blocking``, latency.

Durability differs by default: the plugin fsyncs every entry (crash safe), LocalDiskBackend never
fsyncs and writes into the page cache, so its ``store`` number is memory speed, not disk speed.
The ``kvkernels-nofsync`` row (``kvkernels.fsync: false``) and the ``LocalDiskBackend-odirect``
row (its ``extra_config.use_odirect: true``: writes and reads bypass the page cache) are the
like-for-like comparisons. LMCache's GDS backend needs CUDA + cuFile and is reported as skipped on CPU hosts.

Bytes counted: every row's GB/s, ``tokens_per_s_retrieve`` and ``store_pct_dd`` /
``retrieve_pct_dd`` count the chunks' logical bytes (bf16, ``chunk_mb``), whatever the backend
writes. ``kvkernels-fp8`` stores e4m3 codes + scales, about half of them, so its ``*_pct_dd`` set
logical bytes against the disk's ceiling: not a like-for-like share of the disk (the meta's
``bytes_counted`` says so too).

Checked (untimed): every chunk (and layer object) holds its own content (the one random source
rolled by an offset of its own, new for every store), the buffers given back after a store or a
read are first overwritten with NaN (LMCache's allocator hands freed buffers out again: a read that
wrote nothing must not find the right bytes there), and each object a ``batched_get_blocking``
or ``get_blocking`` returns is compared whole with what was stored: bit-exact, or for the FP8
rows within e4m3's step (``|err| <= 0.0625 |x| + 0.01``, as the plugin's tests judge it). A
missing object, wrong bytes or an exception drops that backend's rows only: it is named in the
results' ``failed_variants`` (exit code 3) and the other backends' rows are written; what the
host cannot run is named in ``skipped_variants``.

    python bench/bench_lmcache.py --dir /mnt/nvme0/kvk-bench --out bench_results/<device>
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata as md
import importlib.util
import logging
import os
import shutil
import statistics
import sys
import threading
import time
from typing import Any

import torch

try:
    from . import common
except ImportError:  # pragma: no cover
    import common  # type: ignore

STEM = "bench_lmcache"
# kvkernels-staged: the plugin with inplace_io off (chunks converted through a staging buffer:
# the previous version), kept to show what the in-place vectored I/O buys
# kvkernels-fp8: kvkernels.quant fp8 (lossy; on LMCache's CPU chunks the quantization runs on the host CPU)
BACKENDS = ("kvkernels", "kvkernels-nofsync", "kvkernels-staged", "kvkernels-fp8", "LocalDiskBackend",
            "LocalDiskBackend-odirect")
# kvkernels.* keys of each kvkernels row (the rest: defaults)
VARIANTS: dict[str, dict[str, Any]] = {"kvkernels": {}, "kvkernels-nofsync": {"fsync": False}, "kvkernels-staged": {"inplace_io": False},
            "kvkernels-fp8": {"quant": "fp8"}}


def _drop_tree(root: str) -> None:
    for dp, _, fs in os.walk(root):
        for f in fs:
            fd = os.open(os.path.join(dp, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _make(kind: str, root: str, shape, pool_gb: float, loop, disk_gb: float, layerwise: bool = False):
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends

    from kvkernels.integrations.lmcache import lmcache_extra_config

    L, T, H, D, dtype = shape
    kw = dict(chunk_size=T, local_cpu=True, max_local_cpu_size=pool_gb, use_layerwise=layerwise)
    if kind in VARIANTS:
        extra = lmcache_extra_config(os.path.join(root, kind), **VARIANTS[kind])
        cfg = LMCacheEngineConfig.from_defaults(storage_plugins=["kvkernels"], extra_config=extra, **kw)
        name = "kvkernels"
    else:
        # room for every rep: LocalDiskBackend.remove() (0.5.6) does not give back the bytes it
        # counted in current_cache_size, so removed chunks still use its budget
        cfg = LMCacheEngineConfig.from_defaults(local_disk=os.path.join(root, kind) + "/",
                                                max_local_disk_size=disk_gb,
                                                extra_config={"use_odirect": kind.endswith("-odirect")}, **kw)
        name = "LocalDiskBackend"
    meta = LMCacheMetadata(model_name="bench/llama3-8b", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=dtype, kv_shape=(L, 2, T, H, D), chunk_size=T)
    backends = CreateStorageBackends(cfg, meta, loop)
    if name not in backends:
        for b in reversed(list(backends.values())):
            with contextlib.suppress(Exception):
                b.close()
        raise RuntimeError(f"{name} was not created (see LMCache's log)")
    return backends, backends[name], backends["LocalCPUBackend"], os.path.join(root, kind)


def _wait_visible(be, keys, timeout=120.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(keys)
    while pending:
        pending = [k for k in pending if not be.contains(k)]
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} chunks never became visible")
            time.sleep(0.0005)


def _completions(be, keys, objs, timeout=120.0):
    """Submit ``keys``/``objs`` and return a function that waits for every ``on_complete_callback``
    (both backends call it once a chunk is stored: written and indexed, for kvkernels also synced).
    Waiting on callbacks instead of polling ``contains`` keeps the harness's CPU out of the
    measurement: on 2 vCPUs a poll loop over a batch costs a noticeable share of a core, more for
    a backend whose lookup hashes the key."""
    sem = threading.Semaphore(0)
    be.batched_submit_put_task(keys, objs, on_complete_callback=lambda k: sem.release())

    def wait():
        for _ in keys:
            if not sem.acquire(timeout=timeout):
                raise TimeoutError(f"{len(keys)} chunks: not all stored in {timeout} s")
    return wait


def _roll(n: int, shift: int) -> int:
    """Offset ``shift``'s rotation in elements: steps of 4 (8 bytes: the compare's int64 words stay aligned)."""
    return 4 * shift % n


def _fill(dst: torch.Tensor, src: torch.Tensor, shift: int) -> torch.Tensor:
    """``dst`` := ``src`` rotated by offset ``shift`` (flat): every stored object its own random
    content for the cost of a copy (a fresh ``randn`` per 32 MiB chunk costs ~40x more)."""
    d, s = dst.view(-1), src.reshape(-1)
    n = s.numel()
    k = _roll(n, shift)
    d[k:].copy_(s[:n - k])
    d[:k].copy_(s[n - k:])
    return dst


def _release(objs) -> None:
    """Give our reference on ``objs`` back, after overwriting them with NaN: LMCache's allocator
    hands freed buffers out again, and one still holding a chunk's bytes would pass a check of a
    read that wrote nothing into it."""
    for o in objs:
        if o is not None:
            o.tensor.fill_(float("nan"))
            o.ref_count_down()


class _Check:
    """Compares a returned object with the content stored under its offset (see :func:`_fill`):
    whole, bit-exact, or for a lossy (FP8) backend within e4m3's step, ``|err| <= 0.0625 |x| + 0.01``
    elementwise (the plugin's tests' bound). A missing object or another shape / format fails."""

    def __init__(self, src: torch.Tensor, lossy: bool, fmt=None):
        self.src, self.lossy, self.fmt = src, lossy, fmt
        if lossy:  # reused: a float32 temporary per chunk would cost ~5x the time of the check
            self.want = torch.empty_like(src)
            self.w32 = torch.empty(src.shape, dtype=torch.float32)
            self.d32 = torch.empty(src.shape, dtype=torch.float32)

    def ok(self, o, shift: int) -> bool:
        if o is None or (self.fmt is not None and o.get_memory_format() != self.fmt):
            return False
        t = o.tensor
        if t is None or t.dtype != self.src.dtype or tuple(t.shape) != tuple(self.src.shape):
            return False
        if not self.lossy:  # compared with the source's two pieces in place: no copy of the expected bytes
            a, s = t.reshape(-1), self.src.reshape(-1)
            n = s.numel()
            k = _roll(n, shift)
            return common.same_bytes(a[k:], s[:n - k]) and common.same_bytes(a[:k], s[n - k:])
        want = _fill(self.want, self.src, shift)
        w, d = self.w32.copy_(want), self.d32.copy_(t)
        d.sub_(w).abs_().sub_(w.abs_(), alpha=0.0625)  # |err| - 0.0625 |x|
        return bool(d.max() <= 1e-2)  # NaN (a buffer no read wrote) propagates through max: never within

    def count_bad(self, got, shifts) -> int:
        """Objects of ``got`` (one per shift, in order) missing or wrong."""
        return sum(not self.ok(o, s) for o, s in zip(got, shifts)) + max(0, len(shifts) - len(got))


def _lossy(kind: str) -> bool:
    return VARIANTS.get(kind, {}).get("quant", "none") != "none"


class _Offsets:
    """Every object stored gets a content offset (see :func:`_fill`) of its own: never one used before."""

    _shift = 0  # the last offset used

    def _shifts(self, n: int) -> list[int]:
        self._shift += n
        return list(range(self._shift - n + 1, self._shift + 1))


class _Bench(_Offsets):
    """One backend, built once; ``rep()`` measures one repetition (reps of all backends interleave)."""

    def __init__(self, kind, root, shape, n_chunks, reps, loop):
        L, T, H, D, dtype = shape
        self.kind, self.shape, self.n = kind, shape, n_chunks
        self.chunk_bytes = 2 * L * T * H * D * dtype.itemsize
        pool_gb = (n_chunks * 2 + 4) * self.chunk_bytes / 2**30
        disk_gb = 2 * (reps + 1) * (n_chunks + 1) * self.chunk_bytes / 2**30
        self.backends, self.be, self.cpu, self.path = _make(kind, root, shape, pool_gb, loop, disk_gb)
        g = torch.Generator().manual_seed(0)
        self.src = torch.randn(2, L, T, H * D, generator=g).to(dtype)
        self.check = _Check(self.src, _lossy(kind))
        self.store_s, self.retr_s, self.put_ms, self.get_ms = [], [], [], []

    def rep(self, rep: int) -> None:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat

        L, T, H, D, dtype = self.shape
        be, cpu, kind = self.be, self.cpu, self.kind
        keys = [CacheEngineKey("bench/llama3-8b", 1, 0, rep * 1_000_000 + i, dtype) for i in range(self.n)]
        objs = [cpu.allocate(torch.Size([2, L, T, H * D]), dtype, MemoryFormat.KV_2LTD) for _ in keys]
        shifts = self._shifts(len(keys))
        for o, s in zip(objs, shifts):
            _fill(o.tensor, self.src, s)  # distinct chunks
            o.ref_count_up()  # ours until the store is done: poisoned before it goes back (untimed)
        t0 = time.perf_counter()
        done = _completions(be, keys, objs)
        for o in objs:
            o.ref_count_down()  # what LMCache's StorageManager does right after submitting
        done()
        self.store_s.append(time.perf_counter() - t0)
        _release(objs)
        _wait_visible(be, keys)  # untimed: every stored chunk is visible
        # one chunk, submit -> stored
        k1 = CacheEngineKey("bench/llama3-8b", 1, 0, rep * 1_000_000 + 999_999, dtype)
        o1 = cpu.allocate(torch.Size([2, L, T, H * D]), dtype, MemoryFormat.KV_2LTD)
        _fill(o1.tensor, self.src, self._shifts(1)[0])
        o1.ref_count_up()
        t0 = time.perf_counter()
        done = _completions(be, [k1], [o1])
        o1.ref_count_down()
        done()
        self.put_ms.append(1e3 * (time.perf_counter() - t0))
        _release([o1])
        _wait_visible(be, [k1])
        time.sleep(0.05)  # let the backend finish its bookkeeping after the file is visible
        _drop_tree(self.path)
        t0 = time.perf_counter()
        got = be.batched_get_blocking(keys)
        self.retr_s.append(time.perf_counter() - t0)
        # every chunk whole: exact, or for lossy rows (fp8: 3 mantissa bits) within e4m3's step
        bad = self.check.count_bad(got, shifts)
        _release(got)
        if bad:
            raise RuntimeError(f"{kind}: {bad} of {len(keys)} chunks came back wrong or missing (batched_get_blocking)")
        _drop_tree(self.path)
        t0 = time.perf_counter()
        o = be.get_blocking(keys[0])
        self.get_ms.append(1e3 * (time.perf_counter() - t0))
        ok = self.check.ok(o, shifts[0])
        _release([o])
        if not ok:
            raise RuntimeError(f"{kind}: get_blocking's chunk came back " + ("missing" if o is None else "wrong"))
        for k in keys + [k1]:
            be.remove(k)

    def fill(self) -> None:
        """Store one batch for :meth:`cold_retrieve` (the restore of KV written earlier)."""
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat

        L, T, H, D, dtype = self.shape
        self.kept = [CacheEngineKey("bench/llama3-8b", 1, 0, 10_000_000 + i, dtype) for i in range(self.n)]
        objs = [self.cpu.allocate(torch.Size([2, L, T, H * D]), dtype, MemoryFormat.KV_2LTD) for _ in self.kept]
        self.kept_shifts = self._shifts(len(self.kept))
        for o, s in zip(objs, self.kept_shifts):
            _fill(o.tensor, self.src, s)
        done = _completions(self.be, self.kept, objs)  # stored (not only visible) before the buffers are poisoned
        done()
        _release(objs)
        _wait_visible(self.be, self.kept)
        self.cold_s: list[float] = []
        self.cold_cpu: list[float] = []

    def cold_retrieve(self) -> None:
        """One cold ``batched_get_blocking`` of the kept batch; wall time and process CPU (cores)."""
        import resource

        _drop_tree(self.path)
        time.sleep(0.3)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        got = self.be.batched_get_blocking(self.kept)
        dt = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        bad = self.check.count_bad(got, self.kept_shifts)
        _release(got)
        if bad:
            raise RuntimeError(f"{self.kind}: {bad} of {len(self.kept)} chunks came back wrong or missing")
        self.cold_s.append(dt)
        self.cold_cpu.append((r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / dt)

    def cold_row(self) -> dict:
        total = self.n * self.chunk_bytes
        return {"backend": self.kind, "chunks": self.n, "chunk_mb": round(self.chunk_bytes / 2**20, 2),
                "retrieve_gbps": total / statistics.median(self.cold_s) / 1e9,
                "cpu_cores": statistics.median(self.cold_cpu),
                "retrieve_gbps_reps": [round(total / x / 1e9, 3) for x in self.cold_s]}

    def row(self, dd: dict) -> dict:
        T = self.shape[1]
        total = self.n * self.chunk_bytes
        store = total / statistics.median(self.store_s) / 1e9
        retr = total / statistics.median(self.retr_s) / 1e9
        return {"backend": self.kind, "chunks": self.n, "chunk_mb": round(self.chunk_bytes / 2**20, 2),
                "store_gbps": store, "retrieve_gbps": retr,
                "store_pct_dd": 100 * store / dd["dd_write_gbps"] if dd else None,
                "retrieve_pct_dd": 100 * retr / dd["dd_read_gbps"] if dd else None,
                "put_ms": statistics.median(self.put_ms), "get_ms": statistics.median(self.get_ms),
                "tokens_per_s_retrieve": self.n * T / statistics.median(self.retr_s),
                "store_gbps_reps": [round(total / x / 1e9, 3) for x in self.store_s],
                "retrieve_gbps_reps": [round(total / x / 1e9, 3) for x in self.retr_s]}

    def close(self) -> None:
        for b in reversed(list(self.backends.values())):
            b.close()


class _DD:
    """The disk's own sequential ceiling (O_DIRECT write + fsync, cold O_DIRECT read of one file of the
    batch's size, same directory), measured as one more contender in every round: the virtio disk
    drifts by +-30 % within minutes, so a ceiling taken once at the start says little."""

    kind = "dd (ceiling)"

    def __init__(self, directory: str, nbytes: int):
        try:
            from .bench_store import dd_ceiling
        except ImportError:  # pragma: no cover - run as a script
            from bench_store import dd_ceiling  # type: ignore
        self._dd, self.dir, self.nbytes = dd_ceiling, directory, nbytes
        self.w: list[float] = []
        self.r: list[float] = []

    def rep(self, rep: int) -> None:
        d = self._dd(self.dir, self.nbytes, settle_s=0.5)
        self.w.append(d["dd_write_gbps"])
        self.r.append(d["dd_read_gbps"])

    def ceiling(self) -> dict:
        return {"dd_write_gbps": statistics.median(self.w), "dd_read_gbps": statistics.median(self.r)}

    def row(self, dd: dict) -> dict:
        return {"backend": self.kind, "store_gbps": dd["dd_write_gbps"], "retrieve_gbps": dd["dd_read_gbps"],
                "store_pct_dd": 100.0, "retrieve_pct_dd": 100.0,
                "store_gbps_reps": [round(x, 3) for x in self.w], "retrieve_gbps_reps": [round(x, 3) for x in self.r]}

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _session(directory, reps: int, shape, tiny: bool):
    """A fresh ``kvk-bench-lmcache-*`` folder inside ``directory`` (default ``KVKERNELS_BENCH_DIR``,
    else the system temp dir; removed afterwards, nothing else in ``directory`` is touched),
    LMCache's event loop on a thread, run metadata, and a list the caller fills with benches (all
    closed on exit)."""
    directory = common.fresh_bench_dir(directory, "kvk-bench-lmcache-", "bench lmcache")
    logging.getLogger("lmcache").setLevel(logging.WARNING)
    L, T, H, D, _ = shape
    meta = common.env_record(tiny=tiny)  # (a tiny run's file said nothing of it: it read as a measurement)
    try:
        meta["lmcache"] = md.version("lmcache")
    except md.PackageNotFoundError:  # pragma: no cover
        meta["lmcache"] = None
    meta.update(directory=directory, reps=reps,
                shape={"layers": L, "tokens": T, "kv_heads": H, "head_dim": D, "dtype": "bfloat16"},
                order="rounds over all rows, the order rotated each round; medians per row")
    meta["bytes_counted"] = ("logical chunk bytes (bf16) in every row's GB/s, tokens/s and *_pct_dd; "
                             "kvkernels-fp8 writes and reads about half of them")
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    benches: list = []
    try:
        yield directory, loop, meta, benches
    finally:
        for b in benches:
            if not _guarded(f"{b.kind} (close)", b.close):
                b.failed = True  # its rows are dropped too
        loop.call_soon_threadsafe(loop.stop)
        th.join(5)
        shutil.rmtree(directory, ignore_errors=True)  # only the folder this run made


_VARIANTS = common.Variants()  # failed backends (rows dropped; exit code 3) and skipped ones: in the meta
_FAILED, _SKIPPED = _VARIANTS.failed, _VARIANTS.skipped
_skip = _VARIANTS.skip
_optional_rows = _VARIANTS.guard  # with _optional_rows(tag): one backend (its rows are made at the end)


def _guarded(tag: str, fn, *args) -> bool:
    """``fn(*args)`` under :func:`_optional_rows`; False when it failed."""
    with _optional_rows(tag):
        fn(*args)
        return True
    return False


def _build(benches: list, backends, make, *args) -> None:
    """``make(kind, *args)`` for every backend; one that cannot be built is a failure, not the run's end."""
    for kind in backends:
        with _optional_rows(kind):
            benches.append(make(kind, *args))


def _rounds(benches: list, reps: int, step) -> None:
    """``step(bench, rep)`` for every bench in every round, starting one later each round. A bench
    whose step fails is marked ``failed`` (named in ``_FAILED``) and left out of the later rounds."""
    for rep in range(reps):
        k = rep % max(1, len(benches))
        for b in benches[k:] + benches[:k]:
            if not getattr(b, "failed", False) and not _guarded(b.kind, step, b, rep):
                b.failed = True


def _rows(benches: list, *args) -> list[dict]:
    """``bench.row(*args)`` of every bench that did not fail."""
    rows: list[dict] = []
    for b in benches:
        if not getattr(b, "failed", False):
            _guarded(b.kind, lambda: rows.append(b.row(*args)))
    return rows


def _start() -> None:
    _VARIANTS.clear()


def _finish_meta(meta: dict) -> None:
    meta.update(_VARIANTS.meta())


def run(*, directory=None, chunks=32, reps=3, out_dir="bench_results", tiny=False, layers=32, tokens=256, heads=8,
        head_dim=128, dd: bool = True, plot: bool = True, backends=BACKENDS) -> list[dict]:
    if tiny:
        chunks, reps, layers, tokens, heads, head_dim, dd = 4, 1, 4, 32, 2, 64, False
        print(f"[bench] tiny sizes: {chunks} chunks of {tokens} tokens, 1 rep, no dd ceiling (--chunks / --reps "
              "do not apply)", flush=True)
    shape = (layers, tokens, heads, head_dim, torch.bfloat16)
    ceiling = None
    _start()
    with _session(directory, reps, shape, tiny) as (directory, loop, meta, benches):
        meta["gds"] = "skipped: LMCache's GdsBackend needs CUDA and cuFile" if not torch.cuda.is_available() else \
            "not measured by this script yet"
        if not torch.cuda.is_available():
            _skip("GdsBackend", "needs CUDA and cuFile")
        if dd:
            with _optional_rows(_DD.kind):
                benches.append(_DD(directory, chunks * 2 * layers * tokens * heads * head_dim * 2))
        _build(benches, backends, _Bench, directory, shape, chunks, reps, loop)
        _rounds(benches, reps, lambda b, rep: b.rep(rep))
    dds = [b for b in benches if isinstance(b, _DD) and not getattr(b, "failed", False)]
    if dds:
        ceiling = meta["dd"] = dds[0].ceiling()
    rows = _rows(benches, ceiling)
    _finish_meta(meta)
    if ceiling:
        print(f"# disk ceiling (dd, O_DIRECT, same dir, one round each rep, medians): write "
              f"{ceiling['dd_write_gbps']:.2f} GB/s, read {ceiling['dd_read_gbps']:.2f} GB/s")
    print(common.format_table(rows, ["backend", "chunks", "chunk_mb", "store_gbps", "store_pct_dd", "retrieve_gbps",
                                     "retrieve_pct_dd", "put_ms", "get_ms", "tokens_per_s_retrieve"]))
    paths = common.write_results(rows, meta, out_dir, STEM)
    if plot and rows:
        flat = [{"case": r["backend"], "method": m, "gbps": r[f"{m}_gbps"]} for r in rows for m in ("store", "retrieve")]
        png = common.plot_bars(flat, group="case", series="method", value="gbps", ylabel="GB/s",
                               title=f"LMCache backends, llama3-8b 256-token chunks - {meta['device']}",
                               path=os.path.join(out_dir, f"{STEM}.png"))
        if png:
            paths["png"] = png
    print("# wrote " + ", ".join(paths.values()))
    return rows


class _LayerBench(_Offsets):
    """Layer-wise mode (``use_layerwise``): each chunk is stored as one ``KV_T2D`` object
    ``[T, 2, H*D]`` per layer under a ``LayerCacheEngineKey`` (1 MiB each for llama3-8b), and read
    back layer by layer, as LMCache's layer-wise store / retrieve do. Completion of a store is
    each object's ``on_complete_callback`` (not polling, which would cost CPU in this process)."""

    def __init__(self, kind, root, shape, n_chunks, reps, loop):
        from lmcache.v1.memory_management import MemoryFormat

        L, T, H, D, dtype = shape
        self.kind, self.shape, self.n = kind, shape, n_chunks
        self.obj_bytes = T * 2 * H * D * dtype.itemsize
        pool_gb = (n_chunks * L * 2 + 8) * self.obj_bytes / 2**30
        disk_gb = 2 * (reps + 1) * n_chunks * L * self.obj_bytes / 2**30
        self.backends, self.be, self.cpu, self.path = _make(kind, root, shape, pool_gb, loop, disk_gb, layerwise=True)
        self.src = torch.randn(T, 2, H * D, generator=torch.Generator().manual_seed(0)).to(dtype)
        self.check = _Check(self.src, _lossy(kind), fmt=MemoryFormat.KV_T2D)
        self.store_s, self.retr_s = [], []

    def rep(self, rep: int) -> None:
        from lmcache.utils import LayerCacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat

        L, T, H, D, dtype = self.shape
        keys = [[LayerCacheEngineKey("bench/llama3-8b", 1, 0, rep * 1_000_000 + c, dtype, layer_id=layer)
                 for c in range(self.n)] for layer in range(L)]
        flat = [k for per_layer in keys for k in per_layer]
        objs = [self.cpu.allocate(torch.Size([T, 2, H * D]), dtype, MemoryFormat.KV_T2D) for _ in flat]
        shifts = self._shifts(len(flat))  # flat order: layer by layer
        for o, s in zip(objs, shifts):
            _fill(o.tensor, self.src, s)
            o.ref_count_up()  # ours until stored, then poisoned (untimed)
        t0 = time.perf_counter()
        waits = [_completions(self.be, keys[layer], objs[layer * self.n:(layer + 1) * self.n])
                 for layer in range(L)]  # one call per layer, as the model finishes it
        for o in objs:
            o.ref_count_down()
        for w in waits:
            w()
        self.store_s.append(time.perf_counter() - t0)
        _release(objs)
        _wait_visible(self.be, flat)
        time.sleep(0.05)
        _drop_tree(self.path)
        t0 = time.perf_counter()
        got = [self.be.batched_get_blocking(keys[layer]) for layer in range(L)]
        self.retr_s.append(time.perf_counter() - t0)
        bad = 0
        for layer, row in enumerate(got):  # each object whole, in KV_T2D
            bad += self.check.count_bad(row, shifts[layer * self.n:(layer + 1) * self.n])
            _release(row)
        if bad:
            raise RuntimeError(f"{self.kind}: {bad} layer objects came back wrong or missing")
        for k in flat:
            self.be.remove(k)

    def row(self, dd=None) -> dict:
        L = self.shape[0]
        n_obj = self.n * L
        total = n_obj * self.obj_bytes
        return {"backend": self.kind, "chunks": self.n, "objects": n_obj, "object_mb": round(self.obj_bytes / 2**20, 2),
                "store_gbps": total / statistics.median(self.store_s) / 1e9,
                "retrieve_gbps": total / statistics.median(self.retr_s) / 1e9,
                "store_ms_per_object": 1e3 * statistics.median(self.store_s) / n_obj,
                "retrieve_ms_per_object": 1e3 * statistics.median(self.retr_s) / n_obj,
                "store_gbps_reps": [round(total / x / 1e9, 3) for x in self.store_s],
                "retrieve_gbps_reps": [round(total / x / 1e9, 3) for x in self.retr_s]}

    close = _Bench.close


_FOUR_BACKENDS = ("kvkernels", "kvkernels-nofsync", "LocalDiskBackend", "LocalDiskBackend-odirect")


def _run_mode(mode: str, stem: str, columns, make, step, *, directory, chunks, reps, out_dir, tiny, tiny_chunks,
              backends) -> list[dict]:
    """One batch mode: ``make(kind, directory, shape, chunks, reps, loop)`` per backend, ``step(bench, rep)``
    in rotating rounds, then a table and CSV/JSON of ``bench.row()``."""
    shape = (*((4, 32, 2, 64) if tiny else (32, 256, 8, 128)), torch.bfloat16)
    if tiny:
        chunks, reps = tiny_chunks, 1
        print(f"[bench] tiny sizes: {chunks} chunks, 1 rep (--chunks / --reps do not apply)", flush=True)
    _start()
    with _session(directory, reps, shape, tiny) as (directory, loop, meta, benches):
        meta["mode"] = mode
        _build(benches, backends, make, directory, shape, chunks, reps, loop)
        _rounds(benches, reps, step)
    rows = _rows(benches)
    _finish_meta(meta)
    print(common.format_table(rows, list(columns)))
    paths = common.write_results(rows, meta, out_dir, stem)
    print("# wrote " + ", ".join(paths.values()))
    return rows


def run_layerwise(*, directory=None, chunks=8, reps=5, out_dir="bench_results", tiny=False, backends=_FOUR_BACKENDS):
    """Layer-wise mode: store and retrieve of per-layer ``KV_T2D`` objects (rounds rotate)."""
    return _run_mode("layer-wise (use_layerwise): one KV_T2D object per (chunk, layer)", STEM + "_layerwise",
                     ["backend", "objects", "object_mb", "store_gbps", "retrieve_gbps", "store_ms_per_object",
                      "retrieve_ms_per_object"], _LayerBench, lambda b, rep: b.rep(rep), directory=directory,
                     chunks=chunks, reps=reps, out_dir=out_dir, tiny=tiny, tiny_chunks=2, backends=backends)


class _RestoreBench(_Bench):
    """A :class:`_Bench` that stores one batch when built; its rows are the cold restores."""

    def __init__(self, *args):
        super().__init__(*args)
        try:
            self.fill()
        except BaseException:
            self.close()  # not in the session's list yet: its backends would be left running
            raise

    def row(self, dd=None) -> dict:
        return self.cold_row()


def run_restore(*, directory=None, chunks=32, reps=8, out_dir="bench_results", tiny=False,
                backends=_FOUR_BACKENDS) -> list[dict]:
    """Restore of KV written earlier: each backend stores one batch once, then cold
    ``batched_get_blocking`` rounds rotate over the backends (no writes in between, so the disk's
    write-back does not slow one backend's reads). Rows: median GB/s and process CPU in cores."""
    return _run_mode("restore of stored KV, cold", STEM + "_restore",
                     ["backend", "chunks", "chunk_mb", "retrieve_gbps", "cpu_cores"], _RestoreBench,
                     lambda b, rep: b.cold_retrieve(), directory=directory, chunks=chunks, reps=reps,
                     out_dir=out_dir, tiny=tiny, tiny_chunks=4, backends=backends)


def main(argv=None, prog: str | None = None) -> int:
    """Exit code: 0, or 3 when a backend failed (its rows dropped, the others written; the results'
    ``failed_variants`` names it); the rows are :func:`run`'s (and ``run_layerwise`` / ``run_restore``'s)
    result."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None,
                   help="directory on the disk to measure (default: a temp dir; created when missing, and then "
                        "left); the bench writes only into a new kvk-bench-lmcache-* folder inside it and removes "
                        "that folder (and, first, makes and removes an empty probe folder there)")
    p.add_argument("--chunks", type=common.positive_int, default=None,
                   help="256-token chunks per batch (default 32 = 8192 tokens, 1 GiB; 8 with --layerwise)")
    p.add_argument("--reps", type=common.positive_int, default=3)
    p.add_argument("--out", default="bench_results", help=common.OUT_HELP)
    p.add_argument("--tiny", action="store_true", help="a few small chunks (CI)")
    p.add_argument("--no-dd", action="store_true", help="skip the dd ceiling")
    p.add_argument("--no-plot", action="store_true")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--restore", action="store_true",
                      help="only the restore of KV stored once (cold reads, rounds rotate over the backends)")
    mode.add_argument("--layerwise", action="store_true",
                      help="layer-wise mode: one KV_T2D object per (chunk, layer), --chunks 8 by default")
    a = p.parse_args(argv)
    if importlib.util.find_spec("lmcache") is None:  # before any folder is made or disk measured
        p.error("needs lmcache: pip install 'kvkernels[lmcache]'")
    common.bench_paths(p, out=a.out, directory=a.dir, scratch=True)
    _start()  # this call's failures only (each run clears them too)
    if a.layerwise:
        run_layerwise(directory=a.dir, chunks=8 if a.chunks is None else a.chunks, reps=a.reps,
                      out_dir=a.out, tiny=a.tiny)
    elif a.restore:
        run_restore(directory=a.dir, chunks=32 if a.chunks is None else a.chunks, reps=a.reps,
                    out_dir=a.out, tiny=a.tiny)
    else:
        run(directory=a.dir, chunks=32 if a.chunks is None else a.chunks, reps=a.reps,
            out_dir=a.out, tiny=a.tiny, dd=not a.no_dd, plot=not a.no_plot)
    return _VARIANTS.exit_code("backend")  # the rows that ran are written; the rc says some did not


if __name__ == "__main__":
    sys.exit(main())
