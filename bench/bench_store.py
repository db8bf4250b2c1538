"""Benchmark: the SSD store against the disk's own ceiling, in one run on one directory.

* ``dd-write`` / ``dd-read``: sequential O_DIRECT write (+ fsync) and cold O_DIRECT read of one
  large file in 16 MiB pieces — the ceiling (page cache dropped for the file with
  ``posix_fadvise(DONTNEED)``; O_DIRECT falls back to buffered I/O where the FS refuses it);
* ``put`` / ``get`` / ``get-1-layer``: the store with llama3-8b-shaped entries (32 layers, 8 kv
  heads, head_dim 128, block 16, bf16; ``--blocks`` blocks per entry), cold reads;
* ``qd-sweep``: puts then gets of many entries with 1/2/4/8 worker threads (queue depth);
* ``read-while-write``: reads of old entries while new entries are written, with and without
  read priority (reported: read GB/s, which priority should protect);
* ``restore``: tokens/s of whole-entry cold reads (tokens = blocks x block_size).

Reads and the ceiling are medians of ``--reps`` runs (virtual disks are noisy). Everything is
written into a new ``kvk-bench-store-*`` folder inside ``--dir``, removed at the end: nothing else
in ``--dir`` is touched.

Checked: every entry holds its own bytes (the random entry XOR a per-entry 64-bit pattern), and
before each timed read its destination is overwritten with their complement (not timed); after
the read the bytes read are compared with the entry's (not only the store's checksums): a read
that wrote nothing, or wrong bytes, fails its variant. Every entry written is read back the same
way (the read-while-write rows' new entries after their timed run). A variant (the ceiling; put / get /
restore / get-1-layer of one engine; one queue depth of the sweep; one read-while-write setting)
that raises or reads wrong bytes has its rows dropped and is named in the results'
``failed_variants`` (exit code 3); one the machine cannot run (kvikio without CUDA or the
package) is named in ``skipped_variants``. The results are written after the ceiling and after
each variant (meta ``"partial": true``), so a run cut off by a time cap keeps what it measured.

Targets (issue 3): >= 90 % of the dd ceiling for large entries with both engines.

    python bench/bench_store.py --dir /mnt/nvme0/kvk --out bench_results/<device>
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import shutil
import sys
import tempfile
import threading
import time

import torch

try:
    from . import common
except ImportError:  # pragma: no cover
    import common  # type: ignore

import kvkernels
from kvkernels import config
from kvkernels.io import EntryMeta, KVStore, aligned_empty, available_engines
from kvkernels.models import get_model, make_cache

PIECE = 16 << 20


def _drop_cache(path: str) -> None:
    """Evict a file's pages from the page cache (clean pages; no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _drop_tree(root: str) -> None:
    for dp, _, fs in os.walk(root):
        for f in fs:
            _drop_cache(os.path.join(dp, f))


def dd_ceiling(directory: str, nbytes: int, settle_s: float = 3.0, threads: int = 4) -> dict:
    """The disk's ceiling for this size: O_DIRECT write + fsync, then cold O_DIRECT reads of one file,
    with one stream (``dd``) and with ``threads`` streams at separate offsets (the store reads and
    writes with several workers: a one-stream ceiling is not a ceiling for it; on the H100 VM the
    store's QD-1 get already read faster than one-stream ``dd``). ``dd_*_gbps`` is the better of
    the two; both are reported. Bytes are counted as moved (whole ``PIECE`` s). The file is a new
    one with a unique name in ``directory`` (never a user's file there), removed afterwards."""
    fd, path = tempfile.mkstemp(prefix="kvk-dd-", suffix=".bin", dir=directory)
    os.close(fd)
    try:
        return _dd_ceiling(path, nbytes, settle_s, threads)
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _dd_ceiling(path: str, nbytes: int, settle_s: float, threads: int) -> dict:
    pieces = max(1, -(-nbytes // PIECE))
    moved = pieces * PIECE
    bufs = []
    for _ in range(max(1, threads)):
        b = mmap.mmap(-1, PIECE)  # page aligned
        b.write(os.urandom(1 << 20) * (PIECE >> 20))
        bufs.append(b)
    flags = getattr(os, "O_DIRECT", 0)
    direct = True
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
        os.close(fd)
    except OSError:
        direct = False

    def run(write: bool, n: int) -> float:
        mode = (os.O_WRONLY if write else os.O_RDONLY) | (flags if direct else 0)
        fd = os.open(path, mode)

        def part(k: int) -> None:
            for i in range(k, pieces, n):
                if write:
                    os.pwrite(fd, bufs[k], i * PIECE)
                else:
                    os.preadv(fd, [bufs[k]], i * PIECE)

        t0 = time.perf_counter()
        try:
            if n == 1:
                part(0)
            else:
                ts = [threading.Thread(target=part, args=(k,)) for k in range(n)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
            if write:
                os.fsync(fd)
        finally:
            os.close(fd)
        return moved / (time.perf_counter() - t0) / 1e9

    def settle():
        _drop_cache(path)
        time.sleep(settle_s)  # virtual disks keep flushing after fsync: reading at once understates reads

    n = max(1, threads)
    w1 = run(True, 1)
    settle()
    r1 = run(False, 1)
    wn = run(True, n) if n > 1 else w1
    settle()
    rn = run(False, n) if n > 1 else r1
    return {"dd_write_gbps": max(w1, wn), "dd_read_gbps": max(r1, rn), "dd_write_qd1_gbps": w1, "dd_read_qd1_gbps": r1,
            f"dd_write_qd{n}_gbps": wn, f"dd_read_qd{n}_gbps": rn, "o_direct": direct}


def _entry(blocks: int, tiny: bool):
    shape = get_model("llama3-8b")
    if tiny:
        shape = shape.scaled(num_layers=4, num_kv_heads=1)
    lay = make_cache("vllm-nhd", num_layers=shape.num_layers, num_blocks=blocks, block_size=16,
                     num_heads=shape.num_kv_heads, head_dim=shape.head_dim)
    meta = EntryMeta.for_layout(lay, blocks)
    buf = kvkernels.gather(lay, list(range(blocks)), out=aligned_empty(meta.fmt.nbytes))  # like the pinned pool
    return lay, buf, meta


def _sources(buf: torch.Tensor, entries: int, seed: int = 0) -> list[torch.Tensor]:
    """``entries`` buffers like ``buf``, each ``buf`` XOR its own 64-bit pattern: a read of another
    entry (or of stale bytes) differs from the one asked for."""
    import random

    rng, keys = random.Random(seed), set[int]()
    while len(keys) < entries:
        keys.add(rng.getrandbits(63) | 1)
    n = buf.numel() // 8 * 8  # (an 8-byte multiple for every model here; a tail gets the low byte)
    out = []
    for k in sorted(keys):
        src = aligned_empty(buf.numel())  # 4096-aligned: the int64 views hold
        torch.bitwise_xor(buf[:n].view(torch.int64), k, out=src[:n].view(torch.int64))
        torch.bitwise_xor(buf[n:], k & 0xFF, out=src[n:])
        out.append(src)
    return out


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The bytes read are the entry's; else ``RuntimeError`` (the variant fails)."""
    if not common.same_bytes(got, want):
        diff = got != want
        raise RuntimeError(f"{what}: read wrong bytes: {int(diff.sum())} of {got.numel()} differ "
                           f"(first at byte {int(diff.nonzero()[0, 0])})")


_VARIANTS = common.Variants()  # failed variants (rows dropped; exit code 3) and skipped ones: in the meta
_FAILED, _SKIPPED = _VARIANTS.failed, _VARIANTS.skipped
_skip = _VARIANTS.skip
_optional_rows = _VARIANTS.guard  # with _optional_rows(tag, rows): one variant's rows


def run(*, directory: str | None = None, blocks: int = 512, entries: int = 8, dd_bytes: int = 2 << 30,
        out_dir: str = "bench_results", tiny: bool = False, plot: bool = True, reps: int = 3) -> dict:
    """``directory``: where to measure (default: ``KVKERNELS_BENCH_DIR``, else the system temp
    dir). Everything is written into a fresh temporary folder inside it (``kvk-bench-store-*``),
    removed at the end: nothing already in ``directory`` is touched."""
    for name, v in (("blocks", blocks), ("entries", entries), ("dd_bytes", dd_bytes), ("reps", reps)):
        if v < 1:
            raise ValueError(f"`{name}`: expected a positive integer, got {v}")
    if tiny:
        blocks, entries, dd_bytes = 8, 4, 32 << 20
        print(f"[bench] tiny sizes: {blocks} blocks per entry, {entries} entries, dd {dd_bytes >> 20} MiB "
              "(--blocks / --entries / --dd-bytes do not apply)", flush=True)
    work = common.fresh_bench_dir(directory, "kvk-bench-store-", "bench store")  # ours alone: removed at the end
    meta = common.env_record(tiny=tiny)
    meta["directory"] = work
    from kvkernels.io.engines import kvikio_status

    meta["kvikio"] = kvikio_status()  # version, compat mode, GDS: the kvikio rows depend on them
    rows: list[dict] = []
    _VARIANTS.clear()

    def save_partial() -> None:  # after the ceiling and each variant: a run cut off keeps what it measured
        common.write_results(rows, {**meta, **_VARIANTS.meta(partial=True)}, out_dir, "store")

    ceil: dict = {}
    dd_streams = config.io_threads()  # the store's queue depth: the ceiling reads as wide
    try:
        with _optional_rows("ceiling", rows):  # without it the rows stand, with no pct_dd
            runs = [dd_ceiling(work, dd_bytes, settle_s=0.0 if tiny else 3.0, threads=dd_streams) for _ in range(reps)]  # median of reps: virtual disks are noisy
            ceil = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k.endswith("_gbps")}
            ceil["o_direct"] = runs[0]["o_direct"]
            meta["ceiling"] = ceil
            # printed now, not only with the table: a run cut off by its time cap still shows its ceiling
            common.progress({"ceiling": {k: round(v, 3) if isinstance(v, float) else v for k, v in ceil.items()},
                             "streams": dd_streams, "reps": reps})
        save_partial()
        lay, buf, emeta = _entry(blocks, tiny)
        nbytes = buf.numel()
        tokens = blocks * 16
        srcs = _sources(buf, entries)  # entry i's bytes: each entry its own (a stale or wrong read differs)
        del buf

        def add(method, gbps, peak_key, **extra):
            peak = ceil.get(peak_key)
            rows.append({"method": method, "entry_mb": round(nbytes / 1e6, 2), "gbps": gbps,
                         "pct_dd": 100.0 * gbps / peak if peak else None, "ceiling": peak_key, **extra})
            common.progress(rows[-1])

        def timed_get(store, what: str, key: str, layers=None, lo: int = 0, hi: int = nbytes) -> float:
            """Seconds of one cold read of every entry (``key`` + index) into ``outs``, then its bytes
            checked: each destination holds the complement of the expected bytes before (not timed)."""
            dsts = [o[: hi - lo] for o in outs]
            for i in range(entries):
                common.poison(dsts[i], srcs[i][lo:hi])
            _drop_tree(root)
            t0 = time.perf_counter()
            futs = [store.get(f"{key}{i}", layers=layers, out=dsts[i]) for i in range(entries)]
            for f in futs:
                f.result()
            dt = time.perf_counter() - t0
            for i in range(entries):
                _check(dsts[i], srcs[i][lo:hi], f"{what}: {key}{i}")
            return dt

        root = os.path.join(work, "store")
        outs = [aligned_empty(nbytes) for _ in range(entries)]  # pre-faulted by the first poison, like a pinned pool
        engines = available_engines()  # kvikio (when importable) and posix: the target is for both
        meta["engine"] = engines[0]
        meta["engines"] = engines
        if "kvikio" not in engines:
            st = meta["kvikio"]
            _skip("engine[kvikio]", "no CUDA" if st.get("importable") else f"kvikio not importable ({st.get('reason')})")
        for eng in engines:
            with _optional_rows(f"engine[{eng}]", rows):
                shutil.rmtree(root, ignore_errors=True)
                with KVStore(root, engine=eng) as store:
                    t0 = time.perf_counter()
                    futs = [store.put(f"e{i}", srcs[i], emeta) for i in range(entries)]
                    for f in futs:
                        f.result()
                    add(f"put[{eng}]", entries * nbytes / (time.perf_counter() - t0) / 1e9, "dd_write_gbps", engine=eng)
                    dt = statistics.median(timed_get(store, f"get[{eng}] rep {k + 1}", "e") for k in range(reps))
                    add(f"get[{eng}]", entries * nbytes / dt / 1e9, "dd_read_gbps", engine=eng)
                    add(f"restore[{eng}]", entries * nbytes / dt / 1e9, "dd_read_gbps", engine=eng,
                        tokens_per_s=entries * tokens / dt)
                    region = emeta.fmt.region_nbytes
                    mid = lay.num_layers // 2
                    dt = statistics.median(timed_get(store, f"get-1-layer[{eng}] rep {k + 1}", "e", layers=mid,
                                                     lo=mid * region, hi=(mid + 1) * region) for k in range(reps))
                    add(f"get-1-layer[{eng}]", entries * region / dt / 1e9, "dd_read_gbps", engine=eng)
            shutil.rmtree(root, ignore_errors=True)
            save_partial()
        for qd in (1, 2, 4, 8):
            with _optional_rows(f"qd-sweep[qd={qd}]", rows):
                with KVStore(root, io_threads=qd) as store:
                    t0 = time.perf_counter()
                    for f in [store.put(f"q{i}", srcs[i], emeta) for i in range(entries)]:
                        f.result()
                    w = time.perf_counter() - t0
                    r = statistics.median(timed_get(store, f"qd-sweep-get[qd={qd}] rep {k + 1}", "q") for k in range(reps))
                add(f"qd-sweep-put[qd={qd}]", entries * nbytes / w / 1e9, "dd_write_gbps")
                add(f"qd-sweep-get[qd={qd}]", entries * nbytes / r / 1e9, "dd_read_gbps")
            shutil.rmtree(root, ignore_errors=True)
            save_partial()
        for prio in (True, False):
            what = f"read-while-write[read_priority={prio}]"
            with _optional_rows(what, rows):
                with KVStore(root, io_threads=2, read_priority=prio) as store:
                    for f in [store.put(f"old{i}", srcs[i], emeta) for i in range(entries)]:
                        f.result()
                    for i in range(entries):
                        common.poison(outs[i], srcs[i])
                    _drop_tree(root)
                    t0 = time.perf_counter()
                    # the new entries hold other bytes than the old ones read beside them
                    news = srcs[1:] + srcs[:1]
                    wf = [store.put(f"new{i}", news[i], emeta) for i in range(entries)]
                    rf = [store.get(f"old{i}", out=outs[i]) for i in range(entries)]
                    for f in rf:
                        f.result()
                    r = time.perf_counter() - t0
                    for f in wf:
                        f.result()
                    total = time.perf_counter() - t0
                    for i in range(entries):
                        _check(outs[i], srcs[i], f"{what}: old{i}")
                    # the writes timed beside the reads are read back too (not timed): a put that
                    # stored wrong bytes must not leave a mixed-throughput row standing
                    for i in range(entries):
                        common.poison(outs[i], news[i])
                    for i, f in enumerate([store.get(f"new{i}", out=outs[i]) for i in range(entries)]):
                        f.result()
                        _check(outs[i], news[i], f"{what}: new{i}")
                add(what, entries * nbytes / r / 1e9, "dd_read_gbps", mixed_total_gbps=2 * entries * nbytes / total / 1e9)
            shutil.rmtree(root, ignore_errors=True)
            save_partial()
    finally:
        shutil.rmtree(work, ignore_errors=True)  # only the folder this run made
    meta.update(_VARIANTS.meta())
    paths = common.write_results(rows, meta, out_dir, "store")
    print(f"# {meta['device']}  {meta['date']}  dir={work} (removed)  engine={meta.get('engine')}")
    if ceil:
        print(f"# ceiling (O_DIRECT={ceil['o_direct']}, best of 1 and {dd_streams} streams): write {ceil['dd_write_gbps']:.2f} GB/s "
              f"(1 stream {ceil['dd_write_qd1_gbps']:.2f}), read {ceil['dd_read_gbps']:.2f} GB/s (1 stream {ceil['dd_read_qd1_gbps']:.2f})")
    else:
        print("# ceiling: failed (see failed_variants); no pct_dd")
    print(common.format_table(rows, ["method", "entry_mb", "gbps", "pct_dd", "tokens_per_s", "mixed_total_gbps"]))
    for row in rows:
        row["model"] = "llama3-8b"
    return common.finish(rows, meta, paths, out_dir=out_dir, stem="store", plot=plot, case=lambda r: r["method"].split("[")[0],
                         value="pct_dd", ylabel="% of dd ceiling", title="SSD store vs dd")


def main(argv=None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None,
                   help="directory on the disk to measure (default: a temp dir; created when missing, and then "
                        "left); the bench writes only into a new kvk-bench-store-* folder inside it and removes "
                        "that folder (and, first, makes and removes an empty probe folder there)")
    p.add_argument("--blocks", type=common.positive_int, default=512,
                   help="blocks per llama3-8b entry (512 = 8192 tokens, 1 GiB)")
    p.add_argument("--entries", type=common.positive_int, default=8)
    p.add_argument("--dd-bytes", type=common.positive_int, default=2 << 30)
    p.add_argument("--out", default="bench_results", help=common.OUT_HELP)
    p.add_argument("--reps", type=common.positive_int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)
    common.bench_paths(p, out=a.out, directory=a.dir, scratch=True)
    _VARIANTS.clear()  # this call's failures only (run() clears them too)
    run(directory=a.dir, blocks=a.blocks, entries=a.entries, dd_bytes=a.dd_bytes, out_dir=a.out, tiny=a.tiny,
        plot=not a.no_plot, reps=a.reps)
    return _VARIANTS.exit_code()  # the rows that ran are written; the rc (and .ci/gpu-bench's) says some did not


if __name__ == "__main__":
    sys.exit(main())
