"""KVStore (POSIX engine on CPU; kvikio on GPU): round trips, partial reads, corruption, torn
writes (SIGKILL), disk full (RLIMIT_FSIZE), eviction, concurrency, hostile keys, recovery.

Tests taking the ``engine`` fixture run with each engine: ``posix``, ``fake-kvikio`` (the
``KvikioEngine`` over a CPU model of kvikio 26.10, ``fake_kvikio.py``: runs everywhere) and
``kvikio`` (the real one, GPU machines only)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvkernels
from kvkernels import StagingFormat
from kvkernels.io import CorruptEntryError, EntryMeta, Header, KVStore
from kvkernels.io.format import RegionInfo, key_digest
from kvkernels.models import make_cache
from kvtest import DAMAGE_OPS, DEVICE, bytes_equal, damage

import fake_kvikio

L, NB, BS, H, D = 3, 16, 4, 2, 64


def cache(name="vllm-nhd", seed=0, fill="random"):
    return make_cache(name, num_layers=L, num_blocks=NB, block_size=BS, num_heads=H, head_dim=D, device=DEVICE,
                      seed=seed, fill=fill)


def staged(name="vllm-nhd", ids=(3, 9, 1), seed=0):
    lay = cache(name, seed=seed)
    return lay, kvkernels.gather(lay, list(ids)).cpu(), EntryMeta.for_layout(lay, len(ids))


def files(root):
    """The store's entry files and temporaries under ``root`` (not its folder lock)."""
    out = []
    for dp, _, fs in os.walk(root):
        out += [os.path.join(dp, f) for f in fs if f != ".kvkernels.lock"]
    return sorted(out)


ENGINES = ["posix", "fake-kvikio", pytest.param("kvikio", marks=pytest.mark.gpu)]


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch):
    """Every KVStore the test builds uses this engine (whatever its ``engine=``). With the kvikio
    model, afterwards: no kvikio task is left running and none ran on a closed file."""
    state = fake_kvikio.force_engine(request.param, monkeypatch)
    if state is not None:
        state.task_size = 8192  # entries here are tens of KiB: several kvikio tasks per region
    yield request.param
    if state is not None:
        try:
            assert state.idle(10), "kvikio tasks still running after the test"
            assert state.late == 0, f"{state.late} kvikio task(s) ran on a closed file"
        finally:
            state.pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.parametrize("layout", ["vllm-nhd", "flashinfer-hnd", "mla", "sglang", "vllm-packed"])
def test_round_trip_through_store_into_other_blocks(tmp_path, layout, engine):
    src, buf, meta = staged(layout)
    dst = cache(layout, fill="zero")
    with KVStore(tmp_path) as store:
        store.put("req", buf, meta).result()
        back = store.get("req").result()
    assert torch.equal(back, buf)
    kvkernels.scatter(back.to(DEVICE), dst, [10, 11, 12])
    for l in range(L):
        for c in range(src.num_kv):
            for s, d in zip((3, 9, 1), (10, 11, 12)):
                assert bytes_equal(dst.views[l][c][d].cpu(), src.views[l][c][s].cpu())


def test_partial_layer_reads_and_layer_subset_entries(tmp_path):
    lay, buf, meta = staged()
    fmt = meta.fmt
    with KVStore(tmp_path) as store:
        store.put("k", buf, meta).result()
        one = store.get("k", layers=1).result()
        assert torch.equal(one, buf[fmt.region_offset(1) : fmt.region_offset(1) + fmt.region_nbytes])
        two = store.get("k", layers=[2, 0]).result()
        assert torch.equal(two, torch.cat([buf[: fmt.region_nbytes], buf[fmt.region_offset(2) :]]))
        # an entry holding only layers (0, 2): scatter with layers= restores exactly those
        sub = kvkernels.gather(lay, [5, 6], layers=[0, 2]).cpu()
        store.put("sub", sub, EntryMeta.for_layout(lay, 2, layers=[0, 2])).result()
        with pytest.raises(ValueError, match="layers"):
            store.get("sub", layers=[1])
        assert torch.equal(store.get("sub", layers=[2]).result(), sub[StagingFormat.for_layout(lay, 2, [0, 2]).region_nbytes :])
        out = torch.full((buf.numel() + 7,), 0xEE, dtype=torch.uint8)
        assert store.get("k", out=out).result() is out and torch.equal(out[: buf.numel()], buf)
        assert bool((out[buf.numel() :] == 0xEE).all())
        # a list of destinations follows the order of ``layers``: out[j] receives layers[j]
        a, b = (torch.zeros(fmt.region_nbytes, dtype=torch.uint8) for _ in range(2))
        store.get("k", out=[a, b], layers=iter([2, 0])).result()
        assert torch.equal(a, buf[fmt.region_offset(2) : fmt.region_offset(2) + fmt.region_nbytes])
        assert torch.equal(b, buf[: fmt.region_nbytes])


def test_header_is_one_aligned_block_and_regions_are_4k_aligned(tmp_path):
    _, buf, meta = staged("mla")  # MLA regions carry padding
    with KVStore(tmp_path) as store:
        h = store.put("k", buf, meta).result()
        (path,) = files(tmp_path)
    assert h.nbytes == 4096 and all(r.offset % 4096 == 0 for r in h.regions)
    assert os.path.getsize(path) == h.file_nbytes == 4096 + buf.numel()
    assert Header.unpack(open(path, "rb").read(4096)) == h
    # docs/store.md's worked example: MLA, 3 layers, 3 blocks of 4 x 576 bf16 (13824 B per layer)
    lay = make_cache("mla", num_layers=3, num_blocks=16, block_size=4, num_heads=1, head_dim=576, device=DEVICE)
    with KVStore(tmp_path / "example") as store:
        h = store.put("k", kvkernels.gather(lay, [3, 9, 1]).cpu(), EntryMeta.for_layout(lay, 3)).result()
    assert [(r.offset, r.raw, r.stored) for r in h.regions] == [(o, 16384, 16384) for o in (4096, 20480, 36864)]
    assert h.file_nbytes == 53248


def test_per_region_stored_buffers_for_compressed_schemes(tmp_path):
    lay, buf, meta = staged()
    fmt = meta.fmt
    regions = [buf[fmt.region_offset(l) : fmt.region_offset(l) + 1000 + 10 * l].clone() for l in range(L)]
    cmeta = EntryMeta(**{**meta.__dict__, "scheme": "raw", "codec": "zstd"})
    with KVStore(tmp_path) as store:
        h = store.put("c", regions, cmeta).result()
        assert [r.stored for r in h.regions] == [1000, 1010, 1020]
        out = store.get("c").result()
        assert store.header("c").meta.codec == "zstd"
    for j, r in enumerate(regions):
        assert torch.equal(out[j * fmt.region_nbytes : j * fmt.region_nbytes + r.numel()], r)


def test_flip_a_region_byte_gives_corrupt_error_then_miss(tmp_path, engine):
    _, buf, meta = staged()
    with KVStore(tmp_path) as store:
        h = store.put("k", buf, meta).result()
        (path,) = files(tmp_path)
        with open(path, "r+b") as f:
            f.seek(h.regions[1].offset + 77)
            b = f.read(1)
            f.seek(h.regions[1].offset + 77)
            f.write(bytes([b[0] ^ 0x10]))
        assert torch.equal(store.get("k", layers=0).result(), buf[: meta.fmt.region_nbytes])  # other layer fine
        with pytest.raises(CorruptEntryError, match="checksum"):
            store.get("k").result()
        assert not store.contains("k")  # dropped: later lookups miss
        with pytest.raises(KeyError):
            store.get("k").result()
        assert store.stats()["corrupt"] == 1
    assert files(tmp_path) == [path + ".corrupt"]


def test_damaged_files_renamed_aside_are_reported_at_open(tmp_path, caplog):
    """From review (2026-11-25): the *.corrupt files a get renames aside were never counted,
    listed or said again: on a failing disk they pile up outside capacity_bytes unnoticed. The
    store still never deletes them (they are the evidence); an open reports them."""
    _, buf, meta = staged()
    with KVStore(tmp_path) as store:
        h = store.put("k", buf, meta).result()
        (path,) = files(tmp_path)
        with open(path, "r+b") as f:
            f.seek(h.regions[0].offset)
            f.write(b"\xff" * 8)
        with pytest.raises(CorruptEntryError):
            store.get("k").result()
        assert store.recovery["corrupt_files"] == 0
    size = os.path.getsize(path + ".corrupt")
    with caplog.at_level(logging.WARNING, logger="kvkernels.io.store"), KVStore(tmp_path) as store:
        assert (store.recovery["corrupt_files"], store.recovery["corrupt_bytes"]) == (1, size)
        assert store.stats()["bytes_used"] == 0 and len(store) == 0
    assert any("renamed *.corrupt" in r.getMessage() for r in caplog.records)
    assert files(tmp_path) == [path + ".corrupt"]


def test_flip_a_header_byte_is_skipped_and_reported_on_open(tmp_path, caplog):
    _, buf, meta = staged()
    with KVStore(tmp_path) as store:
        store.put("a", buf, meta).result()
        store.put("b", buf, meta).result()
    victim = files(tmp_path)[0]
    with open(victim, "r+b") as f:
        f.seek(50)
        f.write(b"\xff")
    with caplog.at_level(logging.WARNING, logger="kvkernels.io.store"), KVStore(tmp_path) as store:
        assert len(store) == 1
        bad = store.stats()["recovery"]["bad_files"]
        assert [p for p, _ in bad] == [victim] and "checksum" in bad[0][1]
    # said at open (it was only counted: a user learned of it from stats(), or never)
    said = [r.getMessage() for r in caplog.records if "could not be recovered" in r.getMessage()]
    assert len(said) == 1 and "1 file(s)" in said[0] and victim in said[0]


def test_a_header_whose_region_claims_more_stored_than_raw_bytes_is_corrupt(tmp_path):
    # a consistent checksum over inconsistent fields (a writer bug, a crafted file): refused at
    # parse time, not left to fail every read as a "disturbed destination"
    _, buf, meta = staged()
    with KVStore(tmp_path) as store:
        h = store.put("k", buf, meta).result()
    r0 = h.regions[0]
    bad = Header(h.digest, h.meta, Header.layout_regions(h.meta, [r0.raw + 4096] + [r.stored for r in h.regions[1:]],
                                                          [r.checksum for r in h.regions]), h.created_ns)
    with pytest.raises(CorruptEntryError, match="region table"):
        Header.unpack(bad.pack())


def test_a_meta_too_large_for_the_header_is_refused_up_front(tmp_path):
    """Each field fits its u32 but the buffer they describe (and its offsets) would not fit the
    header's u64 fields: the put is refused with a ValueError naming the meta (the future used
    to fail later with a bare struct.error), and a header claiming it is corrupt."""
    from dataclasses import replace

    _, buf, meta = staged()
    top = 2**31 - 1
    big = replace(meta, num_blocks=top, block_size=top, num_heads=top, head_dim=top)
    with KVStore(tmp_path) as store:
        with pytest.raises(ValueError, match="meta.*2\\*\\*62"):
            store.put("big", [torch.zeros(4096, dtype=torch.uint8)] * len(meta.layers), big)
        assert store.stats()["put_errors"] == 0 and len(store) == 0
        h = store.put("k", buf, meta).result()
    with pytest.raises(ValueError, match="2\\*\\*62"):
        big.validate()
    # a header (checksum valid) whose fields fit their u32s and the region's u64 but describe a
    # buffer past 2**62 bytes is corrupt, never a size to allocate
    huge = replace(meta, layers=(0,), num_blocks=top, block_size=top, num_heads=1, head_dim=1, element_size=1,
                   num_layers=1)
    assert 2**62 < huge.fmt.region_nbytes < 2**64
    crafted = Header(h.digest, huge, (RegionInfo(0, 4096, 4096, huge.fmt.region_nbytes, 0),), h.created_ns)
    with pytest.raises(CorruptEntryError, match="2\\*\\*62"):
        Header.unpack(crafted.pack())
    ok = replace(meta, num_blocks=top)  # large, but every size fits: still a valid meta
    assert ok.validate() is ok and h.meta.validate() == meta


def test_recovery_deletes_only_its_own_temporaries(tmp_path):
    _, buf, meta = staged()
    with KVStore(tmp_path) as store:
        store.put("k", buf, meta).result()
    (entry,) = files(tmp_path)
    shard = os.path.dirname(entry)
    ours = entry + ".tmp.123.4"  # what a put killed mid-write leaves
    foreign = os.path.join(shard, "wal.tmp.0001")  # another program's file in a folder we share
    for p in (ours, foreign):
        open(p, "wb").write(b"x" * 10)
    with KVStore(tmp_path) as store:
        assert store.stats()["recovery"]["removed_temporaries"] == 1 and len(store) == 1
    assert not os.path.exists(ours) and os.path.exists(foreign)


def test_check_key_takes_what_the_store_takes(tmp_path):
    """``check_key`` (used by the pipeline before a step's copies) refuses exactly the keys every
    call refuses: str and bytes-like pass; anything else is the calls' own TypeError."""
    with KVStore(tmp_path) as store:
        for key in ("k", b"k", bytearray(b"k"), memoryview(b"k"), "", "../x\0"):
            KVStore.check_key(key)
            store.check_key(key)
            assert not store.contains(key)
        for key in (("req", 0), 7, None, 1.5):
            with pytest.raises(TypeError, match="`key`: expected a str or bytes") as ei:
                store.check_key(key)
            with pytest.raises(TypeError) as ei2:
                store.contains(key)
            assert str(ei.value) == str(ei2.value)


def test_the_first_put_into_a_new_shard_syncs_the_store_root(tmp_path, monkeypatch):
    import kvkernels.io.store as store_mod

    synced = []
    real = store_mod._fsync_dir
    monkeypatch.setattr(store_mod, "_fsync_dir", lambda d: (synced.append(d), real(d))[1])
    _, buf, meta = staged()
    with KVStore(tmp_path) as store:
        store.put("k", buf, meta).result()
        (entry,) = files(tmp_path)
        assert synced == [str(tmp_path), os.path.dirname(entry)]  # the new shard's name, then the rename
        synced.clear()
        store.put("k", buf, meta).result()  # the shard exists: only the rename is synced
        assert synced == [os.path.dirname(entry)]
        import shutil

        shutil.rmtree(os.path.dirname(entry))  # the shard removed from outside: the next put makes it again
        store.put("k", buf, meta).result()
        assert os.path.exists(entry)
    synced.clear()
    with KVStore(tmp_path / "nosync", fsync=False) as store:
        store.put("k", buf, meta).result()
    assert synced == []


def test_folders_the_store_creates_are_synced_into_their_parents(tmp_path, monkeypatch):
    """With fsync, a store root that did not exist (LMCache's per-worker subfolder) is made durable
    in its parent, and so is every folder created above it, top down, before any put is
    acknowledged; existing folders are left alone."""
    import kvkernels.io.store as store_mod

    synced = []
    real = store_mod._fsync_dir
    monkeypatch.setattr(store_mod, "_fsync_dir", lambda d: (synced.append(d), real(d))[1])
    root = tmp_path / "new" / "deeper" / "store"
    with KVStore(root):
        assert synced == [str(tmp_path), str(tmp_path / "new"), str(tmp_path / "new" / "deeper")]
    synced.clear()
    with KVStore(root):  # exists now: nothing to sync at open
        assert synced == []


def test_a_second_store_on_one_folder_is_refused_until_the_first_closes(tmp_path):
    _, buf, meta = staged()
    other = tmp_path / "other"
    first = KVStore(tmp_path / "a")
    try:
        first.put("k", buf, meta).result()
        threads = threading.active_count()
        with pytest.raises(RuntimeError, match="in use by another KVStore"):
            KVStore(tmp_path / "a", io_threads=4)
        assert threading.active_count() == threads  # a refused open starts no thread (they stayed alive)
        with pytest.raises(RuntimeError, match="in use by another KVStore"):  # any root shared
            KVStore([other, tmp_path / "a"])
        with KVStore(other):  # the refused store released what it had taken
            pass
        # another process is refused too (flock), and the first store's temporaries and entries survive
        code = textwrap.dedent(f"""
            from kvkernels.io import KVStore
            try:
                KVStore({str(tmp_path / "a")!r})
            except RuntimeError as exc:
                print("refused:", exc)
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert "refused:" in out.stdout and "in use by another KVStore" in out.stdout, out.stdout + out.stderr
        assert torch.equal(first.get("k").result(), buf)
    finally:
        first.close()
    with KVStore(tmp_path / "a") as again:  # closed: the folder is free, the entry still there
        assert torch.equal(again.get("k").result(), buf)


def test_a_forked_child_does_not_keep_the_folder_locked(tmp_path):
    """flock belongs to the open file, which fork shares: a living child kept the folder locked
    after the parent closed its store (a restart in the parent was refused)."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    store = KVStore(tmp_path / "a")
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child (reports through its exit status)
        code = 0
        try:
            os.close(w)
            os.close(ready_r)
            os.write(ready_w, b"r")  # running: its fork hooks have run (until then it holds the copy)
            # the child's own store may get the inherited lock's descriptor number: closing the
            # inherited store must not close it (the child's folder would be unlocked)
            own = KVStore(tmp_path / "b", io_threads=1)
            store.close()
            try:
                KVStore(tmp_path / "b", io_threads=1)
                code = 3  # a second store on the child's folder opened: its lock was lost
            except RuntimeError:
                pass
            own.close()
            os.read(r, 1)  # wait until the parent is done
        except BaseException:  # noqa: BLE001
            code = 4
        os._exit(code)
    os.close(r)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"r"
        store.close()
        with KVStore(tmp_path / "a"):  # the child still lives
            pass
    finally:
        os.write(w, b"x")
        os.close(w)
        os.close(ready_r)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_forked_child_is_refused_the_inherited_store_and_can_close_it(tmp_path):
    """A forked child inherits the store without its I/O threads (a put or get would never
    complete) and without its folder lock: every call is a clear RuntimeError, close() returns,
    and the parent's store keeps working."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    _, buf, meta = staged()
    store = KVStore(tmp_path / "a", io_threads=2)
    store.put("k", buf, meta).result()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child (reports through the pipe and its exit status)
        code = 0
        try:
            os.close(r)
            refused = []
            for name, call in (("put", lambda: store.put("j", buf, meta)), ("get", lambda: store.get("k")),
                               ("header", lambda: store.header("k")), ("contains", lambda: store.contains("k")),
                               ("remove", lambda: store.remove("k")), ("pin", lambda: store.pin("k")),
                               ("unpin", lambda: store.unpin("k")), ("pin_count", lambda: store.pin_count("k")),
                               ("stats", store.stats)):
                try:
                    call()
                except RuntimeError as exc:
                    if "forked" in str(exc):
                        refused.append(name)
            os.write(w, ",".join(refused).encode())
            store.close()
        except BaseException:  # noqa: BLE001
            code = 4
        os._exit(code)
    os.close(w)
    try:
        got = b""
        while chunk := os.read(r, 256):
            got += chunk
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert got.decode().split(",") == ["put", "get", "header", "contains", "remove", "pin", "unpin", "pin_count",
                                       "stats"]
    assert torch.equal(store.get("k").result(timeout=20), buf) and store.contains("k")
    store.close()


def test_puts_still_queued_when_the_interpreter_exits_are_written(tmp_path):
    """A script that puts without waiting and exits without close(): the store is closed at exit
    before the thread pools stop, so its queued puts commit (their commits could no longer be
    scheduled, and every one still queued was lost)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import torch
        from kvkernels.io import EntryMeta, KVStore
        meta = EntryMeta(layers=(0, 1), num_blocks=1, block_size=16, num_heads=2, head_dim=64, element_size=2,
                         num_kv=2, num_layers=2, dtype="bfloat16", scheme="raw", codec="none").validate()
        store = KVStore({str(tmp_path)!r}, io_threads=2)
        for i in range(24):
            store.put(f"k{{i}}", torch.full((meta.fmt.nbytes,), i, dtype=torch.uint8), meta)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    with KVStore(tmp_path) as store:
        assert len(store) == 24
        assert all(int(store.get(f"k{i}").result(timeout=20)[0]) == i for i in (0, 11, 23))


def test_every_errno_kvikio_names_maps_to_itself():
    """kvikio reports failures as RuntimeError ending in strerror(errno); each recognised errno
    comes back as itself (ENFILE's message starts with EMFILE's: it was reported as EMFILE)."""
    from kvkernels.io.engines import _KVIKIO_ERRNOS, KvikioEngine

    for e in _KVIKIO_ERRNOS:
        for text in (f"POSIX error on pwrite: {os.strerror(e)}", f"cuFile error: {os.strerror(e)}"):
            got = KvikioEngine._posix_error(RuntimeError(text), "/nonexistent/x", [], write=True)
            assert isinstance(got, OSError) and got.errno == e, (text, got)


def test_a_failing_header_write_closes_its_file(tmp_path):
    """write_header opened the file before preparing its buffer: a failure there (here a `data`
    that is not bytes) left the descriptor open."""
    from kvkernels.io.engines import PosixEngine

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("no /proc/self/fd")
    path = tmp_path / "f"
    path.write_bytes(bytes(8192))
    eng = PosixEngine()

    def open_on_path() -> int:  # descriptors of this file only (not other tests' or threads')
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
            except OSError:
                pass
        return n

    for bad in ([0] * 4096, "a" * 4096):
        with pytest.raises(TypeError):
            eng.write_header(str(path), bad, fsync=False)
    assert open_on_path() == 0
    eng.write_header(str(path), bytes(range(256)) * 16, fsync=False)
    assert path.read_bytes()[:4096] == bytes(range(256)) * 16


def test_a_lock_file_that_cannot_be_written_or_a_file_system_without_flock_still_opens(tmp_path, monkeypatch, caplog):
    import fcntl

    real_open = os.open

    def no_write(path, flags, *a):
        if str(path).endswith(".kvkernels.lock") and flags & (os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, "simulated: another user's lock file")
        return real_open(path, flags, *a)

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / ".kvkernels.lock").write_text("")
    monkeypatch.setattr(os, "open", no_write)
    with KVStore(tmp_path / "a"):  # locked read-only: a second store is still refused
        with pytest.raises(RuntimeError, match="in use by another KVStore"):
            KVStore(tmp_path / "a")
    monkeypatch.undo()

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "simulated: no lock daemon")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    _, buf, meta = staged()
    with caplog.at_level("WARNING"), KVStore(tmp_path / "b") as store:
        store.put("k", buf, meta).result()
    assert "cannot be locked" in caplog.text and "not locked against a second store" in caplog.text


def test_a_deleted_lock_file_does_not_let_a_second_store_in(tmp_path):
    """A cleanup that deleted ``.kvkernels.lock`` under an open store let a second one make a new
    lock file and open the same folder (their recoveries and indexes then fight)."""
    with KVStore(tmp_path / "a"):
        os.unlink(tmp_path / "a" / ".kvkernels.lock")
        with pytest.raises(RuntimeError, match="in use by another KVStore"):
            KVStore(tmp_path / "a")


def test_the_lock_file_is_readable_by_other_users_whatever_the_umask(tmp_path):
    """Made under umask 077 it was 0600: another user's store could not open it and ran unlocked."""
    old = os.umask(0o077)
    try:
        with KVStore(tmp_path / "a"):
            assert (os.stat(tmp_path / "a" / ".kvkernels.lock").st_mode & 0o777) == 0o644
    finally:
        os.umask(old)


def test_a_store_whose_folder_was_replaced_writes_and_deletes_nothing_in_the_new_one(tmp_path):
    """The folder renamed (or deleted) under an open store, a second store opening a new folder of
    that name: the first one's puts re-created the folder or wrote into the second's (whose gets
    then failed their checksum: its good file renamed *.corrupt)."""
    _, buf, meta = staged()
    root = tmp_path / "kv"
    first = KVStore(root)
    try:
        first.put("x", buf, meta).result()
        os.rename(root, tmp_path / "kv.old")
        with pytest.raises(OSError, match="is gone") as e:
            first.put("y", buf, meta).result()
        assert e.value.errno == errno.ESTALE and not root.exists()  # not made anew
        with KVStore(root) as second:
            second.put("y", buf, meta).result()
            with pytest.raises(OSError, match="was replaced by another directory"):
                first.put("y", buf.flip(0), meta).result()
            first.remove("x")  # (its file is under kv.old now: nothing of the new folder is touched)
            assert torch.equal(second.get("y").result(), buf)
            assert not list(root.rglob("*.corrupt"))
    finally:
        first.close()


def test_a_store_opened_through_a_link_keeps_its_folder_when_the_link_is_switched(tmp_path):
    """A draining server's store opened through a link, the link switched to a new server's folder:
    the first store's puts went through the link into the second's folder."""
    _, buf, meta = staged()
    (tmp_path / "d1").mkdir()
    (tmp_path / "d2").mkdir()
    link = tmp_path / "current"
    link.symlink_to(tmp_path / "d1")
    first = KVStore(link)
    try:
        assert first.paths == [str(tmp_path / "d1")]
        link.unlink()
        link.symlink_to(tmp_path / "d2")
        with KVStore(link) as second:
            second.put("k", buf, meta).result()
            first.put("k", buf.flip(0), meta).result()  # into d1, its own folder
            assert torch.equal(second.get("k").result(), buf)
            assert torch.equal(first.get("k").result(), buf.flip(0))
    finally:
        first.close()


def test_a_store_that_fails_to_open_releases_its_folders(tmp_path, monkeypatch):
    def broken(self):
        raise OSError(errno.EIO, "simulated")

    monkeypatch.setattr(KVStore, "_recover", broken)
    with pytest.raises(OSError, match="simulated"):
        KVStore(tmp_path)
    monkeypatch.undo()
    with KVStore(tmp_path):
        pass


def test_a_failed_put_whose_temporary_cannot_be_deleted_gives_back_its_bytes(tmp_path, monkeypatch):
    """The body write fails (EIO) and the file system then refuses the temporary's delete (EROFS,
    an ext4 remounted read-only): the put's future reports the EIO, its in-flight bytes are given
    back (later puts used to block for ever once they reached max_inflight_bytes), the refusal is
    counted, and the next open deletes the temporary."""
    import kvkernels.io.store as store_mod

    _, buf, meta = staged()
    real_unlink = os.unlink

    def refuse_tmp(p, *a, **kw):
        if ".kvk.tmp." in str(p) and os.path.exists(p):  # (a missing file is ENOENT first)
            raise OSError(errno.EROFS, "Read-only file system (simulated)", p)
        return real_unlink(p, *a, **kw)

    with KVStore(tmp_path, max_inflight_bytes=2 * buf.numel()) as store:
        real_write = store.engine.write_file

        def eio(*a, **kw):
            raise OSError(errno.EIO, "write failed (simulated)")

        monkeypatch.setattr(store.engine, "write_file", eio)
        monkeypatch.setattr(store_mod.os, "unlink", refuse_tmp)
        for i in range(3):
            with pytest.raises(OSError, match="write failed"):
                store.put(f"k{i}", buf, meta).result(timeout=10)
        assert store._inflight == 0 and store._reserved == 0
        assert store.stats()["unlink_errors"] == 0  # the engine failed before creating a file
        monkeypatch.setattr(store.engine, "write_file", real_write)

        def header_eio(*a, **kw):
            raise OSError(errno.EIO, "header write failed (simulated)")

        monkeypatch.setattr(store.engine, "write_header", header_eio)
        for i in range(3):  # the body is on disk now: its temporary's delete is refused
            with pytest.raises(OSError, match="header write failed"):
                store.put(f"h{i}", buf, meta).result(timeout=10)
        assert store._inflight == 0 and store._reserved == 0 and store.stats()["unlink_errors"] == 3
        monkeypatch.undo()
        store.put("ok", buf, meta).result(timeout=10)  # nothing is left blocking the next put
        assert torch.equal(store.get("ok").result(), buf)
    assert sum(".kvk.tmp." in p for p in files(tmp_path)) == 3
    with KVStore(tmp_path) as again:
        assert again.stats()["recovery"]["removed_temporaries"] == 3 and len(again) == 1
    assert not [p for p in files(tmp_path) if ".kvk.tmp." in p]


def test_a_temporary_recovery_cannot_delete_does_not_stop_the_open(tmp_path, monkeypatch):
    """A put's leftover temporary on a folder the store may not write (a read-only mount): the
    open goes on, the file is listed as bad and the refusal counted."""
    import kvkernels.io.store as store_mod

    _, buf, meta = staged()
    with KVStore(tmp_path) as store:
        store.put("k", buf, meta).result()
    (entry,) = files(tmp_path)
    leftover = entry + ".tmp.123.4"
    open(leftover, "wb").write(b"x" * 10)

    def refuse(p, *a, **kw):
        raise OSError(errno.EROFS, "Read-only file system (simulated)", p)

    monkeypatch.setattr(store_mod.os, "unlink", refuse)
    with KVStore(tmp_path) as store:
        rec = store.stats()["recovery"]
        assert len(store) == 1 and rec["removed_temporaries"] == 0 and store.stats()["unlink_errors"] == 1
        assert [p for p, _ in rec["bad_files"]] == [leftover] and "could not be deleted" in rec["bad_files"][0][1]
        assert torch.equal(store.get("k").result(), buf)


def test_no_put_into_a_new_shard_is_acknowledged_before_the_shard_name_is_durable(tmp_path, monkeypatch):
    """Two puts into one new shard folder at once: each is acknowledged only after the store
    root was synced (the second used to see the folder and skip, acknowledged before the first
    put's root sync had ended)."""
    import kvkernels.io.store as store_mod
    from kvkernels.io.store import key_digest

    first = key_digest("k0")[:1]
    twin = next(f"k{i}" for i in range(1, 10_000) if key_digest(f"k{i}")[:1] == first)
    real = store_mod._fsync_dir
    root_synced = []

    def slow_root(d):
        if d == str(tmp_path):
            time.sleep(0.5)
            real(d)
            root_synced.append(time.monotonic())
        else:
            real(d)

    monkeypatch.setattr(store_mod, "_fsync_dir", slow_root)
    _, buf, meta = staged()
    with KVStore(tmp_path, io_threads=2) as store:
        acked = []
        f1 = store.put("k0", buf, meta)
        f1.add_done_callback(lambda f: acked.append(time.monotonic()))
        time.sleep(0.05)
        f2 = store.put(twin, buf, meta)
        f2.add_done_callback(lambda f: acked.append(time.monotonic()))
        f1.result(timeout=30), f2.result(timeout=30)
    assert root_synced and len(acked) == 2 and all(a >= root_synced[0] for a in acked), (root_synced, acked)


def test_truncated_file_is_skipped_on_open(tmp_path):
    _, buf, meta = staged()
    with KVStore(tmp_path) as store:
        store.put("a", buf, meta).result()
    (path,) = files(tmp_path)
    os.truncate(path, 4096 + 100)
    with KVStore(tmp_path) as store:
        assert not store.contains("a") and store.stats()["recovery"]["bad_files"]


def test_a_tail_cut_inside_the_last_4k_block_is_skipped_on_open(tmp_path):
    _, buf, meta = staged()
    with KVStore(tmp_path) as store:
        store.put("a", buf, meta).result()
    (path,) = files(tmp_path)
    os.truncate(path, os.path.getsize(path) - 4000)  # every put pads its file to the 4 KiB boundary
    with KVStore(tmp_path) as store:
        assert not store.contains("a")
        assert "truncated" in store.stats()["recovery"]["bad_files"][0][1]


def test_lru_eviction_order(tmp_path):
    _, buf, meta = staged()
    size = 4096 + buf.numel()
    with KVStore(tmp_path, capacity_bytes=3 * size) as store:
        for k in "abc":
            store.put(k, buf, meta).result()
        store.get("a").result()  # a is now most recent: b is the oldest
        store.put("d", buf, meta).result()
        assert [store.contains(k) for k in "abcd"] == [True, False, True, True]
        assert store.stats()["evictions"] == 1 and store.stats()["bytes_used"] == 3 * size
        fut = store.put("huge", torch.zeros(4 * size, dtype=torch.uint8),
                        EntryMeta(**{**meta.__dict__, "num_blocks": meta.num_blocks * 5}))
        with pytest.raises(ValueError, match="capacity"):
            fut.result()
        assert len(store) == 3


def test_evictions_and_removes_unlink_outside_the_store_lock(tmp_path, monkeypatch):
    # an eviction batch unlinked its victims under the lock: ~1,400 files took 2 s, and every
    # contains / get / pin waited (LMCache's event loop, through the plugin's lookups)
    import kvkernels.io.store as store_mod

    _, buf, meta = staged()
    size = 4096 + buf.numel()
    seen = []
    real_unlink = os.unlink
    with KVStore(tmp_path, capacity_bytes=3 * size) as store:
        def unlink(path, *a, **k):
            if str(path).endswith(".kvk"):  # an entry's file (not a temporary)
                seen.append(store._lock._is_owned())
            return real_unlink(path, *a, **k)

        monkeypatch.setattr(store_mod.os, "unlink", unlink)
        for k in "abcdef":
            store.put(k, buf, meta).result()  # d, e, f each evict one
        assert store.remove("e")
        h = store.header("f")
        assert store.remove("f", expect=h)
        assert store.stats()["evictions"] == 3 and len(seen) == 5 and not any(seen), seen
        assert len(files(tmp_path)) == 1 and store._unlinking == {}


def test_a_commit_into_a_path_whose_unlink_is_deferred_waits_for_it(tmp_path):
    # the deferred unlink of an evicted or removed version must never delete a newer file renamed
    # into the same path: the commit waits until the unlink is done
    _, buf, meta = staged()
    other = buf.clone()
    other[:8] ^= 0xFF
    with KVStore(tmp_path) as store:
        store.put("k", buf, meta).result()
        doomed = []
        assert store._drop(key_digest("k"), defer=doomed) and len(doomed) == 1  # its unlink pending
        fut = store.put("k", other, meta)
        time.sleep(0.3)
        assert not fut.done()  # written, but its rename waits
        store._unlink_deferred(doomed)
        fut.result(timeout=30)
        assert torch.equal(store.get("k").result(), other)  # the new file is there, the old one gone
        assert len(files(tmp_path)) == 1 and store._unlinking == {}
    with KVStore(tmp_path) as store:  # and on disk after a reopen
        assert torch.equal(store.get("k").result(), other)


def test_files_on_disk_stay_within_capacity_while_evicted_files_are_deleted(tmp_path, monkeypatch):
    # with the victims' deletes after the lock, other puts reserved their bytes at once and wrote
    # into room not yet freed: 1.25-1.43x the capacity on disk with 20 ms deletes
    import kvkernels.io.store as store_mod

    _, buf, meta = staged()
    size = 4096 + buf.numel()
    cap = 8 * size
    real_unlink = os.unlink

    def slow_unlink(path, *a, **k):
        if str(path).endswith(".kvk"):
            time.sleep(0.03)
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(store_mod.os, "unlink", slow_unlink)
    peak, stop = [0], threading.Event()

    def sample():
        # under the store's lock: no room is given or taken back meanwhile, so the walk (not one
        # snapshot across the shard folders) cannot count a deleted victim beside the file that
        # took its room later; files only go (deletes) or grow within their reservation
        while not stop.is_set():
            n = 0
            with store._lock:
                for dirpath, _, names in os.walk(tmp_path):
                    for f in names:
                        if ".kvk" in f:  # entries and their temporaries
                            try:
                                n += os.path.getsize(os.path.join(dirpath, f))
                            except FileNotFoundError:
                                pass
            peak[0] = max(peak[0], n)
            time.sleep(0.001)

    with KVStore(tmp_path, capacity_bytes=cap, io_threads=4, fsync=False) as store:
        t = threading.Thread(target=sample)
        t.start()
        try:
            futs = [store.put(f"k{i}", buf, meta) for i in range(96)]
            for f in futs:
                f.result(timeout=60)
        finally:
            stop.set()
            t.join()
        assert peak[0] <= cap, (peak[0] / cap)
        assert store.stats()["evictions"] == 88 and len(store) == 8
        assert store._pending_unlink == 0 and store._unlinking == {}


def _entry_bytes(root) -> int:
    return sum(os.path.getsize(f) for f in files(root) if ".kvk" in os.path.basename(f))


def _full_store(tmp_path, keys: str, **kw):
    """A store whose capacity is ``len(keys)`` entries, holding them (oldest first); its entry
    buffer and one entry's file size."""
    _, buf, meta = staged()
    size = 4096 + buf.numel()
    store = KVStore(tmp_path, capacity_bytes=len(keys) * size, fsync=False, **kw)
    for k in keys:
        store.put(k, buf, meta).result()
    return store, buf, meta, size


def _hold_reads(monkeypatch, store, keys):
    """Reads of the files of ``keys`` wait for the returned event (set it to let them finish)."""
    paths = {store._index[key_digest(k)].path for k in keys}
    release, real = threading.Event(), store.engine.read_into
    entered = threading.Semaphore(0)

    def read_into(path, pieces):
        if path in paths:
            entered.release()
            release.wait(20)
        return real(path, pieces)

    monkeypatch.setattr(store.engine, "read_into", read_into)
    return release, entered


def test_an_entry_evicted_while_it_is_read_counts_against_the_capacity_until_the_read_ends(tmp_path, monkeypatch):
    """Found by review (2026-11-25): an entry evicted while a get read it stayed on disk until
    the read ended, uncounted, and later puts filled its room (1.33x the capacity with one slow
    get). Its bytes count now, and an entry being read is not a victim while another is."""
    store, buf, meta, size = _full_store(tmp_path, "ABC", io_threads=2)
    with store:
        release, entered = _hold_reads(monkeypatch, store, "A")
        g = store.get("A")  # A: the most recently used, and being read
        assert entered.acquire(timeout=10)
        for k in "DEF":  # D evicts B, E evicts C, F evicts D (not A: its read frees nothing now)
            store.put(k, buf, meta).result(timeout=20)
            assert _entry_bytes(tmp_path) <= 3 * size
        assert [k for k in "ABCDEFG" if store.contains(k)] == ["A", "E", "F"]
        store.remove("A")  # removed while read: the file stays, and counts
        assert os.path.exists(store._path_for(key_digest("A"))) and store._read_held == size
        store.put("G", buf, meta).result(timeout=20)  # evicts E rather than overshoot
        assert _entry_bytes(tmp_path) <= 3 * size and [k for k in "ABCDEFG" if store.contains(k)] == ["F", "G"]
        release.set()
        assert torch.equal(g.result(timeout=20), buf)  # the read finished on its file
        assert store._read_held == 0 and _entry_bytes(tmp_path) == 2 * size
        assert store.stats()["evictions"] == 4


def test_a_put_never_waits_for_a_read_and_overshoots_only_for_entries_being_read(tmp_path, monkeypatch):
    """When every evictable entry is being read, the put evicts one anyway (the rule before):
    its file overshoots the capacity until the read ends. It does not wait for the read: with
    one I/O worker the put runs in it and the read is queued behind it."""
    store, buf, meta, size = _full_store(tmp_path, "AB", io_threads=1)
    with store:
        release, entered = _hold_reads(monkeypatch, store, "A")
        go, real_room = threading.Event(), store._make_room
        in_put = threading.Event()

        def make_room(need, exclude):
            in_put.set()
            assert go.wait(20)
            return real_room(need, exclude)

        monkeypatch.setattr(store, "_make_room", make_room)
        put = store.put("C", buf, meta)  # in the only worker, before its room check
        assert in_put.wait(10)
        gets = [store.get(k) for k in "AB"]  # both being read (queued behind the put)
        go.set()
        put.result(timeout=20)  # no wait for the reads: they cannot run before it
        assert entered.acquire(timeout=10)  # A's read (evicted: A was the oldest) is under way
        assert _entry_bytes(tmp_path) == 3 * size and store._read_held == size  # A's file, until its read
        release.set()
        assert all(torch.equal(g.result(timeout=20), buf) for g in gets)
        assert store._read_held == 0 and _entry_bytes(tmp_path) == 2 * size
        assert [k for k in "ABC" if store.contains(k)] == ["B", "C"]


def test_an_interrupted_deferred_delete_still_frees_its_path(tmp_path, monkeypatch):
    # a Ctrl-C in the lock acquire after a remove's delete left the path pending for good: a
    # later put of the key never committed and close() never returned
    import kvkernels.io.store as store_mod

    _, buf, meta = staged()
    store = KVStore(tmp_path)
    store.put("k", buf, meta).result()
    real_lock, armed = store._lock, []

    class InterruptOnce:  # the store's lock, whose next acquire once armed is interrupted
        def __enter__(self):
            if armed and armed.pop():
                raise KeyboardInterrupt
            return real_lock.__enter__()

        def __exit__(self, *exc):
            return real_lock.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(real_lock, name)

    real_unlink = os.unlink

    def unlink(path, *a, **k):
        if str(path).endswith(".kvk"):
            armed.append(True)
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(store, "_lock", InterruptOnce())
    monkeypatch.setattr(store_mod.os, "unlink", unlink)
    with pytest.raises(KeyboardInterrupt):
        store.remove("k")
    monkeypatch.undo()
    assert store._unlinking == {} and store._pending_unlink == 0 and not store.contains("k")
    store.put("k", buf, meta).result(timeout=30)  # commits: the path is free
    t = threading.Thread(target=store.close)
    t.start()
    t.join(30)
    assert not t.is_alive()


def test_an_entry_removed_while_read_is_deleted_after_the_lock_once_read(tmp_path, monkeypatch):
    """A drop of an entry that a get is reading leaves the file until the last reader is done;
    that reader deleted it under the store's lock (file-system time that `contains`, `pin` and
    every other call waited for). It is deleted after the lock now, and counted as a pending
    delete until then, as evictions are."""
    import kvkernels.io.store as store_mod

    _, buf, meta = staged()
    with KVStore(tmp_path, io_threads=1) as store:
        store.put("k", buf, meta).result()
        (path,) = files(tmp_path)
        entered, release = threading.Event(), threading.Event()
        real_read = store.engine.read_into

        def held_read(p, pieces):
            entered.set()
            release.wait(10)
            return real_read(p, pieces)

        monkeypatch.setattr(store.engine, "read_into", held_read)
        owned = []
        real_remove = store_mod._remove_file

        def remove_file(p, rename_to=None):
            owned.append((p, store._lock._is_owned()))
            return real_remove(p, rename_to)

        monkeypatch.setattr(store_mod, "_remove_file", remove_file)
        fut = store.get("k")
        assert entered.wait(10)
        assert store.remove("k") and os.path.exists(path) and owned == []  # read under way: the file stays
        release.set()
        assert torch.equal(fut.result(timeout=10), buf)  # the read finishes on the old file
        assert owned == [(path, False)]  # deleted, with the store's lock not held
        assert files(tmp_path) == [] and store._pending_unlink == 0 and store._unlinking == {}


def test_close_waits_for_a_deferred_delete_before_letting_the_folder_go(tmp_path):
    # a removed entry's file is deleted after the store's locks; the folder must still be this
    # store's then (the next owner's file at that path would go)
    _, buf, meta = staged()
    store = KVStore(tmp_path)
    store.put("k", buf, meta).result()
    doomed = []
    assert store._remove_deferring("k", doomed) and len(doomed) == 1
    t = threading.Thread(target=store.close)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()  # waiting for the delete
    store._unlink_deferred(doomed)
    t.join(30)
    assert not t.is_alive() and files(tmp_path) == []


@pytest.mark.parametrize("key", ["../../etc/passwd", "/", "a/b\\c", "x\x00y", "", "ü" * 300, b"\x00\xff/.."])
def test_keys_with_path_characters_stay_inside(tmp_path, key):
    _, buf, meta = staged()
    with KVStore(tmp_path) as store:
        store.put(key, buf, meta).result()
        assert store.contains(key) and torch.equal(store.get(key).result(), buf)
    (path,) = files(tmp_path)
    assert os.path.commonpath([path, str(tmp_path)]) == str(tmp_path)
    assert len(os.path.basename(path)) == 32 + 4


def test_str_and_bytes_keys_differ_and_remove(tmp_path):
    _, buf, meta = staged()
    with KVStore(tmp_path) as store:
        store.put("k", buf, meta).result()
        assert not store.contains(b"k")
        assert store.remove("k") and not store.remove("k")
        assert files(tmp_path) == []


def test_reopen_after_close_and_several_paths(tmp_path):
    paths = [tmp_path / "ssd0", tmp_path / "ssd1"]
    _, buf, meta = staged()
    with KVStore(paths) as store:
        for i in range(12):
            store.put(f"k{i}", buf, meta).result()
    assert files(paths[0]) and files(paths[1])  # spread over both "SSDs"
    with KVStore(paths) as store:
        assert len(store) == 12
        assert torch.equal(store.get("k7").result(), buf)
    with pytest.raises(RuntimeError, match="closed"):
        store.put("x", buf, meta)


def test_concurrent_puts_gets_removes_with_bounded_memory(tmp_path, engine):
    _, buf, meta = staged()
    errors, peak = [], [0]
    with KVStore(tmp_path, io_threads=3, max_inflight_bytes=2 * buf.numel()) as store:
        def watch():
            while not stop.is_set():
                peak[0] = max(peak[0], store.stats()["inflight_bytes"])
                time.sleep(0.001)

        def worker(t):
            try:
                for i in range(15):
                    k = f"t{t}-{i % 4}"
                    store.put(k, buf, meta).result()
                    got = store.get(k).result()
                    if not torch.equal(got, buf):
                        errors.append("mismatch")
                    if i % 5 == 4:
                        store.remove(k)
            except Exception as exc:  # collected, asserted below
                errors.append(repr(exc))

        stop = threading.Event()
        w = threading.Thread(target=watch)
        w.start()
        ts = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        stop.set()
        w.join()
        assert errors == []
        assert peak[0] <= 2 * buf.numel()
        assert store.stats()["inflight_bytes"] == 0


def test_reads_go_before_queued_writes(tmp_path):
    _, buf, meta = staged()
    with KVStore(tmp_path, io_threads=1) as store:
        store.put("r", buf, meta).result()
        gate = threading.Event()
        order = []  # the order the worker *starts* them (a put's future ends later, after its
        # commit thread's fsyncs, so completion order would pass without any priority)
        do_put, do_get = store._do_put, store._do_get
        store._do_put = lambda *a, **k: (order.append("w"), do_put(*a, **k))[1]
        store._do_get = lambda *a, **k: (order.append("r"), do_get(*a, **k))[1]
        store._submit(0, lambda: gate.wait(5))  # occupy the single worker
        w = [store.put(f"w{i}", buf, meta) for i in range(3)]
        r = store.get("r")
        gate.set()
        r.result()
        for f in w:
            f.result()
    assert order == ["r", "w", "w", "w"]


def test_bad_arguments(tmp_path):
    _, buf, meta = staged()
    with KVStore(tmp_path) as store:
        with pytest.raises(TypeError, match="key"):
            store.put(3, buf, meta)
        with pytest.raises(TypeError, match="meta"):
            store.put("k", buf, {"layers": (0,)})
        with pytest.raises(ValueError, match="staging"):
            store.put("k", buf[:100], meta)
        with pytest.raises(TypeError, match="staging"):
            store.put("k", buf.view(torch.int8), meta)
        with pytest.raises(ValueError, match="meta.scheme"):
            store.put("k", buf, EntryMeta(**{**meta.__dict__, "scheme": "x" * 40}))
        store.put("k", buf, meta).result()
        with pytest.raises(ValueError, match="out"):
            store.get("k", out=torch.empty(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="engine"):
        KVStore(tmp_path, engine="nvme")
    with pytest.raises(ValueError, match="capacity_bytes"):
        KVStore(tmp_path, capacity_bytes=0)
    for bad, exc in ((0, ValueError), (-1, ValueError), ("1GiB", TypeError)):
        with pytest.raises(exc, match="max_inflight_bytes"):
            KVStore(tmp_path, max_inflight_bytes=bad)
    for layers, exc in (((-1, 0), ValueError), ((0.0, 1.0), TypeError)):
        with pytest.raises(exc, match="meta.layers"):
            EntryMeta(**{**meta.__dict__, "layers": layers}).validate()
    # the same folder twice, or through a link, is refused (recovery would see each file twice
    # and delete it as its own duplicate)
    os.symlink(tmp_path, tmp_path / "link")
    for paths in ([tmp_path, tmp_path], [tmp_path, tmp_path / "link"]):
        with pytest.raises(ValueError, match="distinct directories"):
            KVStore(paths)
    for paths in ("", [tmp_path, "  "]):  # "" was the working directory, silently
        with pytest.raises(ValueError, match="non-empty directory paths"):
            KVStore(paths)
    with KVStore(tmp_path) as store:  # a staging without bytes (meta) is named, not torch's copy error
        for st in (buf.to("meta"), [[p.to("meta") for p in r] for r in _split_regions(buf, meta.fmt, ())]):
            with pytest.raises(ValueError, match="CPU or CUDA memory"):
                store.put("m", st, meta)
        with pytest.raises(ValueError, match="CPU or CUDA memory"):
            store.get("k", out=torch.empty(meta.fmt.nbytes, dtype=torch.uint8, device="meta"))
    # a file, or a folder that cannot be made: the error names `paths` (the OSError kind kept)
    (tmp_path / "afile").write_text("x")
    for bad, exc in ((tmp_path / "afile", NotADirectoryError), (tmp_path / "afile" / "sub", NotADirectoryError)):
        with pytest.raises(exc, match="`paths`"):
            KVStore(bad)
    # the other arguments are checked before any folder is made: a refused store leaves none
    for kw in (dict(io_threads=0), dict(max_inflight_bytes=0), dict(engine="bogus")):
        with pytest.raises(ValueError):
            KVStore(tmp_path / "new" / "store", **kw)
        assert not (tmp_path / "new").exists(), kw
    with KVStore(tmp_path) as store:  # nothing was deleted by the refused opens
        assert store.contains("k")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="kvikio"):
            KVStore(tmp_path, engine="kvikio")


# ------------------------------------------------------------------- vectored (in-place) I/O, pins
def _split_regions(buf, fmt, cuts):
    """Each region of ``buf`` as a list of pieces cut at ``cuts`` (views: no copy)."""
    out = []
    for j in range(fmt.num_regions):
        r = buf[j * fmt.region_nbytes : (j + 1) * fmt.region_nbytes]
        edges = [0, *[c for c in cuts if 0 < c < r.numel()], r.numel()]
        out.append([r[a:b] for a, b in zip(edges, edges[1:])])
    return out


@pytest.mark.parametrize("cuts", [(), (4096,), (1000, 5000, 5001)], ids=["whole", "aligned-cut", "unaligned-cuts"])
def test_vectored_put_writes_the_same_file_as_one_staging_buffer(tmp_path, cuts, engine):
    """Regions given as lists of pieces (aligned or not) give a byte-identical entry file."""
    from kvkernels.io import aligned_empty

    _, buf, meta = staged(ids=(3, 9, 1, 4, 7, 0, 2, 5))
    fmt = meta.fmt
    al = aligned_empty(buf.numel()).copy_(buf)  # aligned pieces take the in-place O_DIRECT path
    with KVStore(tmp_path / "a") as one, KVStore(tmp_path / "b") as vec:
        h1 = one.put("k", al, meta).result()
        h2 = vec.put("k", _split_regions(al, fmt, cuts), meta).result()
        assert [(r.offset, r.stored, r.checksum) for r in h1.regions] == [(r.offset, r.stored, r.checksum) for r in h2.regions]
        f1, f2 = files(tmp_path / "a"), files(tmp_path / "b")
        with open(f1[0], "rb") as a, open(f2[0], "rb") as b:
            assert a.read()[4096:] == b.read()[4096:]  # the header differs only in its timestamp
        # and reads back into pieces of another cut
        dst = torch.full_like(al, 0x5A)
        vec.get("k", out=_split_regions(dst, fmt, (3000,))).result()
        assert torch.equal(dst, al)


def test_vectored_regions_shorter_than_the_region_are_zero_padded_on_disk(tmp_path, engine):
    """Regions of odd sizes (no 4 KiB multiple): stored bytes round-trip, the file pads with zeros."""
    _, buf, meta = staged()
    fmt = meta.fmt
    parts = [[buf[j * fmt.region_nbytes : j * fmt.region_nbytes + 100], buf[7 : 7 + 33 + j]] for j in range(fmt.num_regions)]
    with KVStore(tmp_path) as store:
        h = store.put("odd", parts, meta).result()
        assert [r.stored for r in h.regions] == [133 + j for j in range(fmt.num_regions)]
        assert all(r.offset % 4096 == 0 for r in h.regions)
        outs = [[torch.zeros(50, dtype=torch.uint8), torch.zeros(200, dtype=torch.uint8)] for _ in h.regions]
        store.get("odd", out=outs).result()
        for j, (o, p) in enumerate(zip(outs, parts)):
            assert bytes(torch.cat(o)[: 133 + j].numpy()) == bytes(torch.cat(p).numpy())
            assert bool((o[1][83 + j :] == 0).all())  # beyond the stored bytes nothing is written
        with open(files(tmp_path)[0], "rb") as f:
            raw = f.read()
        r0 = h.regions[0]
        assert raw[r0.offset + r0.stored : h.regions[1].offset] == b"\0" * (h.regions[1].offset - r0.offset - r0.stored)
        # one layer into a list destination; a corrupt byte in that region is caught the same way
        one = [torch.zeros(133 + 2, dtype=torch.uint8)]
        store.get("odd", out=one, layers=[2]).result()
        assert bytes(one[0].numpy()) == bytes(torch.cat(parts[2]).numpy())
    path = files(tmp_path)[0]
    with open(path, "r+b") as f:
        f.seek(h.regions[1].offset + 5)
        b = f.read(1)
        f.seek(h.regions[1].offset + 5)
        f.write(bytes([b[0] ^ 0x10]))
    with KVStore(tmp_path) as store:
        with pytest.raises(CorruptEntryError, match="layer 1"):
            store.get("odd", out=[[torch.zeros(200, dtype=torch.uint8)] for _ in h.regions]).result()
        assert not store.contains("odd")


def test_vectored_arguments_are_checked(tmp_path):
    _, buf, meta = staged()
    fmt = meta.fmt
    regions = _split_regions(buf, fmt, (4096,))
    with KVStore(tmp_path) as store:
        with pytest.raises(ValueError, match="staging"):
            store.put("k", regions[:-1], meta)
        with pytest.raises(TypeError, match=r"staging\[0\]\[1\]"):
            store.put("k", [[regions[0][0], regions[0][1].view(torch.int8)], *regions[1:]], meta)
        with pytest.raises(ValueError, match=r"staging\[1\]"):
            store.put("k", [regions[0], [buf, buf], *regions[2:]], meta)  # more than a region
        with pytest.raises(TypeError, match=r"staging\[0\]"):
            store.put("k", [[], *regions[1:]], meta)
        store.put("k", regions, meta).result()
        with pytest.raises(ValueError, match="out"):
            store.get("k", out=[torch.empty(fmt.region_nbytes, dtype=torch.uint8)])  # 1 of 3 regions
        with pytest.raises(ValueError, match=r"out\[2\]"):
            store.get("k", out=[torch.empty(fmt.region_nbytes, dtype=torch.uint8)] * 2
                      + [torch.empty(fmt.region_nbytes - 1, dtype=torch.uint8)])
        with pytest.raises(ValueError, match=r"out\[0\]"):
            store.get("k", out=[buf[::2]] * 3)


def test_lone_large_get_fans_out_into_parallel_group_reads(tmp_path, monkeypatch, engine):
    """A get with nothing else queued reads its groups on several workers; bytes, corruption and
    truncation behave exactly as in a single read."""
    import kvkernels.io.store as store_mod

    monkeypatch.setattr(store_mod, "READ_GROUP_MIN", 4096)  # test-sized entries count as large
    _, buf, meta = staged(ids=(3, 9, 1, 4, 7, 0, 2, 5))
    fmt = meta.fmt
    calls = []
    with KVStore(tmp_path, io_threads=4) as store:
        real = store._read_group
        monkeypatch.setattr(store, "_read_group", lambda *a: calls.append(a[1]) or real(*a))
        store.put("k", buf, meta).result()
        assert torch.equal(store.get("k").result(), buf)
        assert len(calls) == 3  # one group per region here: offsets of the three regions
        outs = _split_regions(torch.zeros_like(buf), fmt, (1000,))
        store.get("k", out=outs).result()
        assert torch.equal(torch.cat([torch.cat(r) for r in outs]), buf)
        assert torch.equal(store.get("k", layers=[2, 0]).result(),  # layers come back in ascending order
                           torch.cat([buf[: fmt.region_nbytes], buf[fmt.region_offset(2):]]))
        store.put("bad", buf, meta).result()
        store.put("short", buf, meta).result()
        from kvkernels.io.format import key_digest

        path = {k: store._index[key_digest(k)].path for k in ("bad", "short")}
        with open(path["short"], "r+b") as f:  # cut short under the open store (recovery would skip it)
            f.truncate(os.path.getsize(path["short"]) - 5000)
        with pytest.raises(CorruptEntryError, match="truncated"):
            store.get("short").result()
        assert not store.contains("short")
    with open(path["bad"], "r+b") as f:  # flip a byte in the last region
        f.seek(-100, 2)
        b = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([b[0] ^ 1]))
    with KVStore(tmp_path, io_threads=4) as store:
        assert store.contains("bad")
        with pytest.raises(CorruptEntryError, match="layer 2"):
            store.get("bad").result()
        assert not store.contains("bad") and store.stats()["corrupt"] == 1
        assert torch.equal(store.get("k").result(), buf)  # the store keeps working
        assert [e.readers for e in store._index.values()] == [0]  # every group released the file


def _held_reads(store, monkeypatch):
    """Make the store's reads wait until ``release`` is set (``started`` is set by the first)."""
    started, release = threading.Event(), threading.Event()
    real = store.engine.read_into

    def read_into(path, pieces):
        started.set()
        assert release.wait(30)
        return real(path, pieces)

    monkeypatch.setattr(store.engine, "read_into", read_into)
    return started, release


@pytest.mark.parametrize("fan_out", [False, True])
def test_get_whose_file_a_put_replaces_reads_the_new_version(tmp_path, monkeypatch, fan_out, engine):
    """A put of the same key renames its file over the one a get is reading: the get's checksums
    fail, and the store reads the new version instead of calling it corrupt (same description
    and sizes), or misses when the new version has other sizes. Nothing is dropped."""
    import kvkernels.io.store as store_mod

    if fan_out:
        monkeypatch.setattr(store_mod, "READ_GROUP_MIN", 4096)
    _, old, meta = staged(ids=(3, 9, 1, 4, 7, 0, 2, 5))
    _, new, _ = staged(ids=(3, 9, 1, 4, 7, 0, 2, 5), seed=1)
    assert not torch.equal(old, new)
    with KVStore(tmp_path, io_threads=4) as store:
        store.put("k", old, meta).result()
        started, release = _held_reads(store, monkeypatch)
        got = store.get("k")
        assert started.wait(30)
        monkeypatch.setattr(store.engine, "read_into", type(store.engine).read_into.__get__(store.engine))
        store.put("k", new, meta).result()  # renamed over the file the get has not read yet
        release.set()
        assert torch.equal(got.result(timeout=30), new)
        st = store.stats()
        assert st["replaced_reads"] >= 1 and st["corrupt"] == 0
        assert torch.equal(store.get("k").result(), new) and len(store) == 1
        # a new version of other sizes: the caller's header() no longer describes it -> a miss
        started, release = _held_reads(store, monkeypatch)
        got = store.get("k")
        assert started.wait(30)
        monkeypatch.setattr(store.engine, "read_into", type(store.engine).read_into.__get__(store.engine))
        _, small, small_meta = staged(ids=(3, 9))
        store.put("k", small, small_meta).result()
        release.set()
        with pytest.raises(KeyError, match="replaced or removed"):
            got.result(timeout=30)
        assert store.stats()["corrupt"] == 0 and torch.equal(store.get("k").result(), small)
        assert [e.readers for e in store._index.values()] == [0]


@pytest.mark.parametrize("fan_out", [False, True])
def test_get_with_expect_reads_only_that_version(tmp_path, monkeypatch, fan_out, engine):
    """``get(expect=header)`` reads the version ``header`` describes or misses: after a put of the
    key, and when that put renames its file over the one being read (same sizes: a get without
    ``expect`` would retry on the new version), it raises KeyError instead of giving other bytes."""
    import kvkernels.io.store as store_mod

    if fan_out:
        monkeypatch.setattr(store_mod, "READ_GROUP_MIN", 4096)
    _, v1, meta = staged(ids=(3, 9, 1, 4, 7, 0, 2, 5))
    _, v2, _ = staged(ids=(3, 9, 1, 4, 7, 0, 2, 5), seed=1)
    _, v3, _ = staged(ids=(3, 9, 1, 4, 7, 0, 2, 5), seed=2)
    with KVStore(tmp_path, io_threads=4) as store:
        h1 = store.put("k", v1, meta).result()
        assert store.header("k") is h1
        assert torch.equal(store.get("k", expect=h1).result(), v1)
        with pytest.raises(TypeError, match="expect"):
            store.get("k", expect="version 1")
        h2 = store.put("k", v2, meta).result()
        with pytest.raises(KeyError, match="not the one expected"):
            store.get("k", expect=h1).result()
        # bad arguments are errors whether the expected version is there or not (not a miss)
        for h in (h1, h2):
            with pytest.raises(ValueError, match="layers"):
                store.get("k", expect=h, layers=[meta.num_layers])
            with pytest.raises(ValueError, match="out"):
                store.get("k", expect=h, out=torch.empty(8, dtype=torch.uint8))
        assert torch.equal(store.get("k", expect=h2, layers=[1, 2]).result(),
                           v2[meta.fmt.region_offset(1):])
        assert not store.remove("k", expect=h1) and store.header("k") is h2  # remove(expect=): that version only
        # a put of the same bytes is the same version for `expect` (a header of its own, same content)
        h2b = store.put("k", v2.clone(), meta).result()
        assert h2b is not h2 and store.header("k") is h2b
        assert torch.equal(store.get("k", expect=h2).result(), v2)
        started, release = _held_reads(store, monkeypatch)
        got = store.get("k", expect=h2)
        assert started.wait(30)
        monkeypatch.setattr(store.engine, "read_into", type(store.engine).read_into.__get__(store.engine))
        store.put("k", v2.clone(), meta).result()  # identical bytes renamed in mid-read: read again, whole
        release.set()
        assert torch.equal(got.result(timeout=30), v2)
        with pytest.raises(TypeError, match="expect"):
            store.remove("k", expect="version 2")
        started, release = _held_reads(store, monkeypatch)
        out = torch.full_like(v2, 0xCD)
        got = store.get("k", out=out, expect=h2)
        assert started.wait(30)
        monkeypatch.setattr(store.engine, "read_into", type(store.engine).read_into.__get__(store.engine))
        store.put("k", v3, meta).result()  # renamed over the file the get has not read yet
        release.set()
        with pytest.raises(KeyError, match="replaced or removed"):
            got.result(timeout=30)
        st = store.stats()  # two misses: the other version asked for, the version replaced mid-read
        assert st["corrupt"] == 0 and st["replaced_reads"] >= 1 and st["misses"] == 2
        assert torch.equal(store.get("k").result(), v3)
        assert [e.readers for e in store._index.values()] == [0]
        assert store.remove("k", expect=store.header("k")) and not store.contains("k")


@pytest.mark.parametrize("fan_out", [False, True])
def test_get_without_verify_never_returns_two_versions(tmp_path, monkeypatch, fan_out, engine):
    """With ``verify=False`` no checksum catches a file replaced part-way through a get (its first
    group read the old file, the others the new one): the store sees the rename itself and reads
    the new version again, whole."""
    import itertools

    import kvkernels.io.store as store_mod

    monkeypatch.setattr(store_mod, "READ_GROUP_MIN", 4096)  # small entries read in several groups
    _, v1, meta = staged(ids=(3, 9, 1, 4, 7, 0, 2, 5))
    _, v2, _ = staged(ids=(3, 9, 1, 4, 7, 0, 2, 5), seed=1)
    with KVStore(tmp_path, io_threads=4, verify=False) as store:
        if not fan_out:  # no lone-get fan-out: one worker reads the groups in turn (4 still serve)
            monkeypatch.setattr(store, "io_threads", 1)
        store.put("k", v1, meta).result()
        real = store.engine.read_into
        calls = itertools.count()
        first_done, release = threading.Event(), threading.Event()

        def read_into(path, pieces):
            if next(calls) == 0:  # the first group reads version 1 ...
                r = real(path, pieces)
                first_done.set()
                return r
            assert release.wait(30)  # ... the others only once version 2 is renamed in
            return real(path, pieces)

        monkeypatch.setattr(store.engine, "read_into", read_into)
        got = store.get("k", out=torch.full_like(v1, 0xCD))
        assert first_done.wait(30)
        store.put("k", v2, meta).result()
        release.set()
        assert torch.equal(got.result(timeout=30), v2)
        assert next(calls) >= 3  # several groups, and the get read again
        assert store.stats()["replaced_reads"] >= 1 and store.stats()["corrupt"] == 0
        # pinned to a version (expect=): read again only when the new file holds the same bytes
        for new, same in ((v2.clone(), True), (v1, False)):
            calls = itertools.count()
            first_done.clear()
            release.clear()
            before = store.stats()["replaced_reads"]
            got = store.get("k", out=torch.full_like(v1, 0xCD), expect=store.header("k"))
            assert first_done.wait(30)
            store.put("k", new, meta).result()
            release.set()
            if same:
                assert torch.equal(got.result(timeout=30), v2)
            else:
                with pytest.raises(KeyError, match="replaced"):
                    got.result(timeout=30)
            assert store.stats()["replaced_reads"] == before + 1


@pytest.mark.parametrize("expect", [False, True])
def test_a_recovered_entry_read_across_a_replacement_never_returns_two_versions(tmp_path, monkeypatch, expect):
    """An entry found by recovery (no rename of this store's) had no rename number: once a newer
    version put at its path was removed again, it counted as owning the path, so a
    ``verify=False`` get whose later groups had read the newer file returned both versions."""
    import kvkernels.io.store as store_mod

    monkeypatch.setattr(store_mod, "READ_GROUP_MIN", 4096)  # several groups
    _, v1, meta = staged(ids=(3, 9, 1, 4, 7, 0, 2, 5))
    _, v2, _ = staged(ids=(3, 9, 1, 4, 7, 0, 2, 5), seed=1)
    with KVStore(tmp_path, io_threads=1) as s:
        s.put("k", v1, meta).result()
    store = KVStore(tmp_path, io_threads=2, verify=False)  # "k" is recovered
    try:
        monkeypatch.setattr(store, "io_threads", 1)  # no fan-out: one worker reads the groups in turn
        h = store.header("k")
        real = store.engine.read_into
        lock, n = threading.Lock(), [0]
        ev = [threading.Event() for _ in range(4)]

        def read_into(path, pieces):
            with lock:
                i, n[0] = n[0], n[0] + 1
            real(path, pieces)
            if i in (0, 2):  # after the first group (version 1) and the third (version 2)
                ev[i].set()
                assert ev[i + 1].wait(30)

        monkeypatch.setattr(store.engine, "read_into", read_into)
        fut = store.get("k", out=torch.full_like(v1, 0xCD), **({"expect": h} if expect else {}))
        assert ev[0].wait(30)
        store.put("k", v2, meta).result()
        ev[1].set()
        assert ev[2].wait(30)
        assert store.remove("k")  # the newer version leaves the path
        ev[3].set()
        with pytest.raises(KeyError):  # no version left to read whole: a miss, never a mix
            fut.result(timeout=30)
    finally:
        store.close()


def test_concurrent_vectored_fanned_out_gets_with_removes_and_eviction(tmp_path, monkeypatch, engine):
    """Vectored puts, fanned-out gets (forced), removes, pins and LRU eviction from many threads:
    every successful get returns the exact bytes, failures are only misses, and afterwards no
    reader is left, nothing is in flight, and the files on disk are exactly the indexed entries."""
    import kvkernels.io.store as store_mod

    monkeypatch.setattr(store_mod, "READ_GROUP_MIN", 4096)
    bufs = [staged(ids=(3, 9, 1, 4, 7, 0, 2, 5), seed=s)[1] for s in range(3)]
    _, _, meta = staged(ids=(3, 9, 1, 4, 7, 0, 2, 5))
    fmt = meta.fmt
    size = 4096 + bufs[0].numel()
    errors = []
    with KVStore(tmp_path, io_threads=4, capacity_bytes=6 * size) as store:
        def worker(t):
            g = torch.Generator().manual_seed(t)
            held = []  # threads 0-2 hold a pin across operations (at most 3 of the 6 slots pinned)
            try:
                for i in range(25):
                    if held and int(torch.randint(0, 3, (1,), generator=g)) == 0:
                        store.unpin(held.pop())
                    k = f"k{int(torch.randint(0, 8, (1,), generator=g))}"
                    b = bufs[int(k[1:]) % 3]
                    op = int(torch.randint(0, 10, (1,), generator=g))
                    if op < 3:
                        store.put(k, _split_regions(b, fmt, (777, 4096)), meta).result()
                    elif op < 8:
                        out = torch.full_like(b, 0xCD)
                        try:
                            store.get(k, out=_split_regions(out, fmt, (1000,))).result()
                        except KeyError:
                            continue
                        if not torch.equal(out, b):
                            errors.append(f"wrong bytes for {k}")
                    elif op < 9:
                        if store.pin(k):
                            if t < 3 and not held:
                                held.append(k)
                            else:
                                store.unpin(k)
                    else:
                        store.remove(k)
                while held:
                    store.unpin(held.pop())
            except Exception as exc:  # collected, asserted below
                errors.append(repr(exc))

        ts = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert errors == []
        st = store.stats()
        assert st["inflight_bytes"] == 0 and st["pinned"] == 0 and st["bytes_used"] <= 6 * size
        assert all(e.readers == 0 for e in store._index.values())
        assert sorted(store._lru) == sorted(store._index)  # the eviction order holds every unpinned entry
        on_disk = sorted(p for p in files(tmp_path) if p.endswith(".kvk"))
        assert on_disk == sorted(e.path for e in store._index.values())


def test_pinned_entries_are_not_evicted(tmp_path):
    _, buf, meta = staged()
    size = 4096 + buf.numel()
    with KVStore(tmp_path, capacity_bytes=2 * size) as store:
        store.put("a", buf, meta).result()
        store.put("b", buf, meta).result()
        assert store.pin("a") and store.pin("a") and not store.pin("zz")
        store.put("c", buf, meta).result()  # "a" is the oldest but pinned: "b" goes
        assert [store.contains(k) for k in "abc"] == [True, False, True]
        assert store.pin("c") and store.stats()["pinned"] == 2
        with pytest.raises(OSError, match="pinned") as ei:  # everything pinned: the put fails cleanly
            store.put("d", buf, meta).result()
        assert ei.value.errno == errno.ENOSPC and not store.contains("d") and len(files(tmp_path)) == 2
        assert store.unpin("a") and store.pin_count("a") == 1 and store.unpin("a") and not store.unpin("a")
        store.put("d", buf, meta).result()  # "a" is evictable again
        assert [store.contains(k) for k in "acd"] == [False, True, True]
        assert store.remove("c") and store.pin_count("c") == 0  # an explicit remove wins over a pin


def test_eviction_does_not_rewalk_the_same_pinned_entries_on_every_put(tmp_path):
    """LMCache pins the chunks a lookup hit until their load, and hits are old entries: the LRU
    end an eviction starts from. Each put at capacity walked past every pinned entry there (33 ms
    per put at 200k pinned). Pinned entries are now out of the eviction order until their last
    unpin, which puts them back at its young end (the load that follows a lookup's pin is a use).
    The walk's checks are counted (``_pins`` and ``_credits`` lookups: at least one per entry it
    visits), with the store's behaviour unchanged: only unpinned entries go, oldest first."""
    _, buf, meta = staged()
    size = 4096 + buf.numel()
    n_pinned, n_free, n_puts = 300, 20, 60
    with KVStore(tmp_path, capacity_bytes=(n_pinned + n_free) * size, fsync=False) as store:
        for i in range(n_pinned + n_free):
            store.put(f"k{i}", buf, meta).result()
        assert all(store.pin(f"k{i}") for i in range(n_pinned))  # the oldest 300

        class Counting(dict):
            looked = 0

            def __contains__(self, key):
                Counting.looked += 1
                return super().__contains__(key)

        store._pins, store._credits = Counting(store._pins), Counting(store._credits)
        for j in range(n_puts):
            store.put(f"n{j}", buf, meta).result()
        # each put evicts the oldest unpinned entry: the 20 unpinned originals, then the new ones
        alive = [k for k in [f"k{i}" for i in range(n_pinned + n_free)] + [f"n{j}" for j in range(n_puts)]
                 if store.contains(k)]
        assert alive == [f"k{i}" for i in range(n_pinned)] + [f"n{j}" for j in range(n_puts - n_free, n_puts)]
        # walking past the pinned entries on every put visited n_puts * n_pinned = 18,000 entries
        assert Counting.looked <= 4 * n_puts, Counting.looked
        # unpinned, they are evictable again, as entries used at their unpin: after the new ones
        assert all(store.unpin(f"k{i}") for i in range(n_pinned))
        for j in range(n_free + 1):
            store.put(f"m{j}", buf, meta).result()
        assert not any(store.contains(f"n{j}") for j in range(n_puts))
        assert not store.contains("k0") and all(store.contains(f"k{i}") for i in range(1, n_pinned))
        assert sorted(store._lru) == sorted(store._index) and not store._pins


# ------------------------------------------------------------------- crash safety, disk full
CHILD = textwrap.dedent(
    """
    import os, sys, signal, torch
    from kvkernels.io import KVStore, EntryMeta
    from kvkernels.models import make_cache
    import kvkernels
    mode, root = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 3:  # the engine under test: sys.argv[3], fake_kvikio.py's folder: sys.argv[4]
        sys.path.insert(0, sys.argv[4])
        import fake_kvikio
        fake_kvikio.force_engine(sys.argv[3])
    lay = make_cache("vllm-nhd", num_layers=8, num_blocks=64, block_size=16, num_heads=8, head_dim=128)
    buf = kvkernels.gather(lay, list(range(48)))
    meta = EntryMeta.for_layout(lay, 48)
    store = KVStore(root, io_threads=2)
    if mode == "kill":
        print("ready", flush=True)
        i = 0
        while True:
            store.put(f"k{i}", buf, meta)
            i += 1
    if mode == "fsize":
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (buf.numel() // 2, buf.numel() // 2))
        fut = store.put("big", buf, meta)
        err = fut.exception()
        small = kvkernels.gather(lay, [1])
        store.put("small", small, EntryMeta.for_layout(lay, 1)).result()
        ok = torch.equal(store.get("small").result(), small)
        print("result", type(err).__name__, getattr(err, "errno", None), store.contains("big"), ok,
              store.engine.name, flush=True)
        store.close()
    """
)


def test_sigkill_during_puts_leaves_no_partial_entry(tmp_path):
    root = tmp_path / "store"
    p = subprocess.Popen([sys.executable, "-c", CHILD, "kill", str(root)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    with KVStore(root) as store:
        rec = store.stats()["recovery"]
        assert rec["bad_files"] == []
        assert all(f.endswith(".kvk") for f in files(root))  # temporaries were deleted
        for digest_entry in list(store._index.values()):  # every visible entry reads back intact
            h = digest_entry.header
            assert os.path.getsize(digest_entry.path) == h.file_nbytes
        # puts complete out of order (two workers, many in flight): look for every key the child
        # may have written until each indexed entry has been read back
        n, read = len(store), 0
        for i in range(1_000_000):
            if read == n:
                break
            if store.contains(f"k{i}"):
                store.get(f"k{i}").result()  # checksums verified: raises if torn
                read += 1
        assert read == n


def test_disk_full_fails_put_cleanly_and_store_keeps_working(tmp_path, engine):
    root = tmp_path / "store"
    r = subprocess.run([sys.executable, "-c", CHILD, "fsize", str(root), engine, os.path.dirname(fake_kvikio.__file__)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("result")][0].split()
    assert line[1] in ("OSError", "PermissionError") and line[2] == "27"  # EFBIG
    assert line[3] == "False" and line[4] == "True"
    assert line[5] == engine.replace("fake-", "")  # the child ran the engine under test
    assert not [f for f in files(root) if ".tmp." in f]


def test_a_full_disk_fails_the_put_with_enospc_and_the_store_keeps_working(tmp_path, monkeypatch, engine):
    """ENOSPC from a body write (kvikio reports it as RuntimeError "POSIX error on pwrite: No space
    left on device") fails the put's future with OSError(ENOSPC), as the POSIX engine's does; the
    temporary is deleted, nothing is indexed, the next put works."""
    if engine == "kvikio":
        pytest.skip("injected at os.pwritev: the real kvikio writes from C++ (the RLIMIT_FSIZE test covers it)")
    _, buf, meta = staged()
    real = os.pwritev

    def pwritev(fd, bufs, offset, *a):  # a disk with room for the header and one region
        if offset + sum(memoryview(b).nbytes for b in bufs) > 4096 + meta.fmt.region_nbytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bufs, offset, *a)

    import kvkernels.io.store as store_mod

    real_remove, removed = store_mod._remove_file, []
    with KVStore(tmp_path) as store:
        def remove_file(p, rename_to=None):  # (the failed put's temporary goes without the store's lock)
            removed.append((".tmp." in p, store._lock._is_owned()))
            return real_remove(p, rename_to)

        monkeypatch.setattr(store_mod, "_remove_file", remove_file)
        monkeypatch.setattr(os, "pwritev", pwritev)
        err = store.put("k", buf, meta).exception(timeout=30)
        monkeypatch.setattr(os, "pwritev", real)
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC, repr(err)
        assert not store.contains("k") and store.stats()["put_errors"] == 1
        assert not [f for f in files(tmp_path) if ".tmp." in f] and removed == [(True, False)]
        store.put("k", buf, meta).result(timeout=30)
        assert torch.equal(store.get("k").result(), buf)


def test_a_truncated_or_vanished_entry_file_is_corrupt_and_dropped(tmp_path, engine):
    """An entry file cut short, or deleted, under the open store (not replaced by a put): the get
    fails with CorruptEntryError and the entry is dropped, whatever the engine (kvikio reports
    both as RuntimeError: "POSIX error on pread: EOF", "Unable to open file")."""
    from kvkernels.io.format import key_digest

    _, buf, meta = staged()
    with KVStore(tmp_path, io_threads=1) as store:
        for k in ("short", "gone", "fine"):
            store.put(k, buf, meta).result()
        path = {k: store._index[key_digest(k)].path for k in ("short", "gone")}
        os.truncate(path["short"], os.path.getsize(path["short"]) - 5000)
        os.unlink(path["gone"])
        with pytest.raises(CorruptEntryError, match="truncated"):
            store.get("short").result(timeout=30)
        with pytest.raises(CorruptEntryError, match="file missing"):
            store.get("gone", out=torch.empty_like(buf)).result(timeout=30)
        assert not store.contains("short") and not store.contains("gone")
        assert store.stats()["corrupt"] == 2
        with pytest.raises(KeyError):
            store.get("short").result()
        assert torch.equal(store.get("fine").result(), buf)  # the store keeps working
        assert [e.readers for e in store._index.values()] == [0]
    assert path["short"] + ".corrupt" in files(tmp_path)


@pytest.fixture
def kvikio_model(monkeypatch, tmp_path):
    """A KvikioEngine over the kvikio model (task_size 4096), its state, three segments and a file
    holding them back to back (segs[0] at 0, segs[1] + segs[2] at 3 * 4096)."""
    from kvkernels.io.engines import KvikioEngine

    state = fake_kvikio.install(monkeypatch, task_size=4096)
    eng = KvikioEngine()
    g = torch.Generator().manual_seed(0)
    segs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (3 * 4096, 5000, 4096)]
    path = str(tmp_path / "f")
    eng.write_file(path, [(0, segs[0]), (3 * 4096, [segs[1], segs[2]])])
    state.calls.clear()
    yield eng, state, segs, path
    state.pool.shutdown(wait=True, cancel_futures=True)


def test_kvikio_engine_issues_one_task_per_future_and_nothing_for_empty_segments(kvikio_model, tmp_path):
    """Every pread/pwrite is one task_size piece issued with task_size = its size (so its future is
    exactly one kvikio task: waiting on the futures waits on the tasks); zero-length segments issue
    nothing (no task to wait for; an empty CUDA tensor has a null data pointer)."""
    eng, state, segs, path = kvikio_model
    empty = torch.empty(0, dtype=torch.uint8)
    eng.write_file(str(tmp_path / "g"), [(0, [segs[0], empty]), (3 * 4096, [segs[1], empty, segs[2]])])
    back = [torch.zeros_like(t) for t in segs]
    eng.read_into(str(tmp_path / "g"), [(0, [empty, back[0]]), (3 * 4096, [back[1], empty, back[2]])])
    assert all(torch.equal(x, y) for x, y in zip(back, segs))
    assert {op for op, *_ in state.calls} == {"pread", "pwrite"}
    assert all(0 < n <= 4096 and ts == n for _, _, n, ts in state.calls), state.calls
    with open(path, "rb") as f, open(tmp_path / "g", "rb") as g:
        assert f.read() == g.read()


@pytest.mark.parametrize("task_size,piece", [(4096, 4096), (5000, 4096), (3 * 4096 + 100, 3 * 4096), (100, 4096)])
def test_kvikio_pieces_are_whole_pages_whatever_the_task_size(monkeypatch, tmp_path, task_size, piece):
    """A KVIKIO_TASK_SIZE that is not a multiple of 4 KiB: every piece after a region's first
    started off a page (GDS moves such pieces through its bounce buffers). Pieces are the task
    size rounded down to whole pages (at least one page)."""
    from kvkernels.io.engines import KvikioEngine

    state = fake_kvikio.install(monkeypatch, task_size=task_size)
    try:
        eng = KvikioEngine()
        data = torch.arange(5 * 4096 + 300, dtype=torch.int64).to(torch.uint8)
        eng.write_file(str(tmp_path / "f"), [(0, data)])
        back = torch.zeros_like(data)
        eng.read_into(str(tmp_path / "f"), [(0, back)])
        assert torch.equal(back, data)
        offs = sorted({off for op, off, n, ts in state.calls if op == "pread"})
        assert offs == list(range(0, data.numel(), piece)), (offs, piece)
    finally:
        state.pool.shutdown(wait=True, cancel_futures=True)


def test_a_failed_kvikio_read_returns_only_after_every_task_it_issued(kvikio_model, tmp_path):
    """kvikio's futures raise at their first failed task while the call's other tasks still run on
    the CuFile's handle and the caller's buffer, and CuFile.close() does not wait for them: a failed
    read_into returns only once every task it issued is done (the destination is no longer written
    and no task runs on the closed file), then raises EOFError / FileNotFoundError as the POSIX
    engine does."""
    eng, state, segs, path = kvikio_model
    size = os.path.getsize(path)
    # the first piece ends past EOF (fails at once); the others are slow
    state.delay = lambda op, off, n: 0.3 if off + n <= 3 * 4096 else 0.0
    tail, head = torch.zeros(8192, dtype=torch.uint8), torch.zeros(3 * 4096, dtype=torch.uint8)
    with pytest.raises(Exception) as ei:
        eng.read_into(path, [(size - 4096, tail), (0, head)])
    assert state.pending == 0, "read_into returned while kvikio tasks still ran"
    assert torch.equal(head, segs[0]), "the slow pieces were still being read when the failure returned"
    assert isinstance(ei.value, EOFError) and isinstance(ei.value.__cause__, RuntimeError), repr(ei.value)
    with pytest.raises(FileNotFoundError):
        eng.read_into(str(tmp_path / "missing"), [(0, head)])
    assert state.idle() and state.late == 0  # no task ran on a closed file


def test_a_failed_kvikio_write_returns_only_after_every_task_it_issued(kvikio_model, tmp_path):
    """The write side: the first piece fails at once with ENOSPC while the others are slow;
    write_file returns only once all of them are done, with OSError(ENOSPC)."""
    eng, state, segs, path = kvikio_model
    state.delay = lambda op, off, n: 0.3 if off >= 4096 else 0.0
    state.fail = lambda op, off, n: errno.ENOSPC if off < 4096 else None
    with pytest.raises(Exception) as ei:
        eng.write_file(str(tmp_path / "g"), [(0, segs[0]), (3 * 4096, [segs[1], segs[2]])], fsync=False)
    assert state.pending == 0, "write_file returned while kvikio tasks still ran"
    assert isinstance(ei.value, OSError) and ei.value.errno == errno.ENOSPC, repr(ei.value)
    assert state.idle() and state.late == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dest", ["host", "cuda-inline", "cuda-threadpool"])
def test_kvikio_truncated_and_replaced_entries_into_host_and_device_memory(tmp_path, monkeypatch, dest):
    """The real kvikio engine: a truncated entry is CorruptEntryError and dropped; a get whose file
    a put of the same key replaces reads the new version (same sizes) or misses with KeyError
    (other sizes), nothing dropped. Into pinned host memory and into device memory, where kvikio
    moves a request below its ``gds_threshold`` (default 16 KiB) inside ``pread``/``pwrite`` (a
    failure raises from the call, not from the future: ``cuda-inline``, threshold 1 GiB) and
    larger ones on its thread pool (``cuda-threadpool``, threshold 0)."""
    import kvikio.defaults

    from kvkernels.io.format import key_digest

    # (kvikio.defaults.set returns a context manager whose exit restores the old value)
    threshold = {"cuda-inline": 1 << 30, "cuda-threadpool": 0}.get(dest)
    restore = kvikio.defaults.set("gds_threshold", threshold) if threshold is not None else None
    ids = (3, 9, 1, 4, 7, 0, 2, 5)
    _, old, meta = staged(ids=ids)
    _, new, _ = staged(ids=ids, seed=1)
    _, small, small_meta = staged(ids=(3, 9))

    def out_for(t):
        if dest == "host":
            return torch.empty(t.numel(), dtype=torch.uint8).pin_memory()
        return torch.empty(t.numel(), dtype=torch.uint8, device="cuda")

    try:
        with KVStore(tmp_path, engine="kvikio") as store:
            assert store.engine.name == "kvikio"
            # a file cut short under the open store
            store.put("short", old.cuda(), meta).result()  # device buffer straight to the file
            p = store._index[key_digest("short")].path
            os.truncate(p, os.path.getsize(p) - 5000)
            with pytest.raises(CorruptEntryError, match="truncated"):
                store.get("short", out=out_for(old)).result(timeout=60)
            assert not store.contains("short") and store.stats()["corrupt"] == 1
            # replaced while read: by a version of the same sizes (read instead), of other sizes (miss)
            store.put("k", old, meta).result()
            for version, version_meta in ((new, meta), (small, small_meta)):
                started, release = _held_reads(store, monkeypatch)
                got = store.get("k", out=out_for(old))
                assert started.wait(30)
                monkeypatch.setattr(store.engine, "read_into", type(store.engine).read_into.__get__(store.engine))
                store.put("k", version, version_meta).result()
                release.set()
                if version is new:
                    assert torch.equal(got.result(timeout=60).cpu(), new)
                else:
                    with pytest.raises(KeyError, match="replaced or removed"):
                        got.result(timeout=60)
            st_ = store.stats()
            assert st_["corrupt"] == 1 and st_["replaced_reads"] >= 2
            assert torch.equal(store.get("k", out=out_for(small)).result().cpu(), small)
            assert [e.readers for e in store._index.values()] == [0]
    finally:
        if restore is not None:
            restore.__exit__(None, None, None)


# ------------------------------------------------------------------------ header fuzzing
@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=9000))
def test_random_bytes_never_parse_as_a_header(data):
    with pytest.raises(CorruptEntryError):
        Header.unpack(data)


@pytest.mark.parametrize("kw, name", [({"digest": b"\x01" * 15}, "digest"), ({"digest": b"\x01" * 17}, "digest"),
                                      ({"digest": "k" * 16}, "digest"), ({"regions": ()}, "regions"),
                                      ({"created_ns": -1}, "created_ns"), ({"created_ns": 1 << 64}, "created_ns")])
def test_a_header_that_would_pack_into_another_header_is_refused(kw, name):
    """struct padded a short digest with zeros and cut a long one: the header packed, then read
    back with another digest (the entry's key check failed); a header without regions packed
    and could not be read back; a created_ns out of the u64 raised struct.error."""
    _, _, meta = staged()
    args = dict(digest=b"\x01" * 16, meta=meta, regions=Header.layout_regions(meta, [meta.fmt.region_nbytes] * L, [1, 2, 3]))
    assert Header.unpack(Header(**args).pack()).digest == args["digest"]
    with pytest.raises((ValueError, TypeError), match=f"`{name}`"):
        Header(**{**args, **kw})


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 4095), st.integers(1, 255))
def test_any_single_byte_flip_in_a_header_is_detected(pos, bit):
    _, _, meta = staged()
    h = Header(b"\x01" * 16, meta, Header.layout_regions(meta, [meta.fmt.region_nbytes] * L, [1, 2, 3]))
    raw = bytearray(h.pack())
    raw[pos] ^= bit
    with pytest.raises(CorruptEntryError):
        Header.unpack(bytes(raw))


@settings(max_examples=80, deadline=None)
@given(op=st.sampled_from(DAMAGE_OPS), where=st.floats(0, 1, exclude_max=True),
       val=st.integers(1, 255), n=st.integers(1, 5000), reopen=st.booleans(),
       layers=st.sampled_from([None, 0, [1, 2]]))
def test_any_damage_to_an_entry_file_is_caught_or_harmless(op, where, val, n, reopen, layers):
    """Whatever happens to an entry's file (a flipped or overwritten byte, a cut, bytes added, a
    zeroed run; in the header, a region or the padding), with the store open or before a
    reopen: a get returns the stored bytes of the layers it asks for, or raises
    CorruptEntryError (the entry then dropped), or misses (KeyError: recovery set the file
    aside). Never other bytes, never another error. (85k random trials of the same found
    nothing, 27th session.)"""
    import tempfile

    _, buf, meta = staged()
    fmt = meta.fmt
    with tempfile.TemporaryDirectory() as root:
        store = KVStore(root, fsync=False)
        try:
            store.put("k", buf, meta).result()
            (path,) = files(root)
            with open(path, "rb") as f:
                data = damage(f.read(), op, where, val, n)
            with open(path, "r+b") as f:
                f.truncate(0)
                f.write(data)
            if reopen:
                store.close()
                store = KVStore(root, fsync=False)
            try:
                got = store.get("k", layers=layers).result()
            except CorruptEntryError:
                assert not store.contains("k")
                return
            except KeyError:
                assert reopen and not store.contains("k")
                return
            sel = fmt.layers if layers is None else [layers] if isinstance(layers, int) else layers
            for i, layer in enumerate(sel):
                at = fmt.region_offset(layer)
                assert torch.equal(got[i * fmt.region_nbytes: i * fmt.region_nbytes + fmt.payload_nbytes],
                                   buf[at: at + fmt.payload_nbytes]), f"layer {layer}: other bytes"
        finally:
            store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("small_tasks", [False, True])
def test_kvikio_and_posix_read_each_others_files(tmp_path, small_tasks):
    """Files written by kvikio (from device memory) read back by POSIX and by kvikio, and the
    other way round. ``small_tasks``: 4 KiB kvikio tasks and no inline threshold, so every region
    is several pieces, i.e. device views at non-zero offsets, each on kvikio's thread pool."""
    import contextlib

    import kvikio.defaults

    lay = cache()
    buf = kvkernels.gather(lay, [1, 2, 3])
    meta = EntryMeta.for_layout(lay, 3)
    restore = (kvikio.defaults.set({"task_size": 4096, "gds_threshold": 0}) if small_tasks
               else contextlib.nullcontext())
    try:
        with KVStore(tmp_path / "a", engine="kvikio") as kv:
            kv.put("k", buf, meta).result()  # device buffer straight to the file
        with KVStore(tmp_path / "a", engine="posix") as px:
            assert torch.equal(px.get("k").result(), buf.cpu())
            px.put("p", buf.cpu(), meta).result()
        with KVStore(tmp_path / "a", engine="kvikio") as kv:
            out = torch.empty_like(buf)
            assert torch.equal(kv.get("p", out=out).result(), buf)  # read straight into device memory
            pinned = torch.empty(buf.numel(), dtype=torch.uint8).pin_memory()
            assert torch.equal(kv.get("k", out=pinned).result(), buf.cpu())
    finally:
        restore.__exit__(None, None, None)


# ------------------------------------------------ regressions found by review (2026-11-23)
def test_queued_requests_cannot_be_cancelled_into_leaking_their_reservations(tmp_path):
    # a skipped (cancelled) put kept its in-flight bytes (later puts blocked for good) and a
    # skipped get kept its reader (a remove left the file, which came back after a reopen)
    _, buf, meta = staged()
    store = KVStore(tmp_path, io_threads=1, max_inflight_bytes=buf.numel())
    try:
        store.put("a", buf, meta).result()
        release = threading.Event()
        real = store.engine.read_into
        store.engine.read_into = lambda p, pc: (release.wait(10), real(p, pc))[1]
        blocker = store.get("a")
        time.sleep(0.1)
        f_put, f_get = store.put("b", buf, meta), store.get("a")
        assert not f_put.cancel() and not f_get.cancel()
        release.set()
        store.engine.read_into = real
        blocker.result(timeout=10), f_put.result(timeout=10), f_get.result(timeout=10)
        assert store.stats()["inflight_bytes"] == 0
        done = threading.Event()
        threading.Thread(target=lambda: (store.put("c", buf, meta).result(), done.set()), daemon=True).start()
        assert done.wait(10)
        assert store.remove("a")
    finally:
        store.close()
    with KVStore(tmp_path) as again:
        assert not again.contains("a") and again.contains("b") and again.contains("c")


def test_concurrent_puts_of_one_key_index_the_file_that_won_the_rename(tmp_path, monkeypatch):
    import kvkernels.io.store as store_mod

    _, v1, meta = staged(seed=1)
    _, v2, _ = staged(seed=2)
    real = store_mod._fsync_dir
    calls = []

    def slow_first(d):  # the first put's directory sync is slow: the second put renames and indexes first
        if d == str(tmp_path):  # the new shard's name (the first put, before its body)
            return real(d)
        calls.append(d)
        if len(calls) == 1:
            time.sleep(0.5)
        real(d)

    monkeypatch.setattr(store_mod, "_fsync_dir", slow_first)
    with KVStore(tmp_path, io_threads=2) as store:
        f1 = store.put("k", v1, meta)
        time.sleep(0.1)
        f2 = store.put("k", v2, meta)
        f1.result(timeout=10), f2.result(timeout=10)
        assert torch.equal(store.get("k").result(timeout=10), v2)  # the file's version, read clean
        assert store.stats()["corrupt"] == 0 and not [p for p in files(tmp_path) if p.endswith(".corrupt")]
        assert store.stats()["bytes_used"] == store.header("k").file_nbytes


def test_a_new_keys_rename_runs_outside_the_store_lock(tmp_path, monkeypatch):
    """A commit renames its file into place; under 4 fsync writers on the CPU host a rename takes
    0.3 ms median and up to ms, and it ran under the store's lock, so LMCache's `contains`, `pin`
    and `header` calls (made on its event loop) waited for other keys' renames. A key with nothing
    of its own at its path (every new content key) now renames outside the lock: while one such
    rename is held up, the store answers; a second put of the same key waits for it, and the
    index ends on the file that won."""
    import kvkernels.io.store as store_mod

    _, v1, meta = staged(seed=1)
    _, v2, _ = staged(seed=2)
    real = os.replace
    entered, release = threading.Event(), threading.Event()
    calls = []

    def held_up(src, dst):
        calls.append(dst)
        if len(calls) == 1:
            entered.set()
            release.wait(10)
        real(src, dst)

    with KVStore(tmp_path, io_threads=2) as store:
        store.put("other", v1, meta).result()
        monkeypatch.setattr(store_mod.os, "replace", held_up)
        f1 = store.put("k", v1, meta)
        assert entered.wait(10)
        answers = []
        t = threading.Thread(target=lambda: answers.append((store.contains("other"), store.pin("other"),
                                                            store.unpin("other"), store.header("k"))))
        t.start()
        t.join(5)
        assert answers == [(True, True, True, None)]  # (the old code: stuck behind the rename)
        f2 = store.put("k", v2, meta)  # waits for the first rename of its path
        time.sleep(0.2)
        assert len(calls) == 1 and not f2.done()
        release.set()
        f1.result(timeout=10), f2.result(timeout=10)
        monkeypatch.undo()
        assert len(calls) == 2 and torch.equal(store.get("k").result(timeout=10), v2)
        assert not store._renaming and store.stats()["corrupt"] == 0
        assert sorted(p for p in files(tmp_path)) == sorted(store._path_for(key_digest(k)) for k in ("k", "other"))


def test_a_failed_rename_outside_the_lock_fails_only_its_put(tmp_path, monkeypatch):
    import kvkernels.io.store as store_mod

    _, v1, meta = staged(seed=1)
    real = os.replace

    def refused(src, dst):
        raise OSError(errno.EIO, "injected EIO on rename")

    with KVStore(tmp_path) as store:
        monkeypatch.setattr(store_mod.os, "replace", refused)
        with pytest.raises(OSError, match="injected EIO"):
            store.put("k", v1, meta).result(timeout=10)
        monkeypatch.setattr(store_mod.os, "replace", real)
        assert not store.contains("k") and not store._renaming and files(tmp_path) == []  # no temporary left
        store.put("k", v1, meta).result(timeout=10)  # the path is free again
        assert torch.equal(store.get("k").result(timeout=10), v1) and store.stats()["put_errors"] == 1


def test_failed_directory_sync_fails_the_put_but_keeps_the_index_true(tmp_path, monkeypatch):
    import kvkernels.io.store as store_mod

    _, v1, meta = staged(seed=1)
    _, v2, _ = staged(seed=2)
    with KVStore(tmp_path) as store:
        store.put("k", v1, meta).result()

        def failing(d):
            raise OSError(errno.EIO, "injected EIO on directory fsync")

        monkeypatch.setattr(store_mod, "_fsync_dir", failing)
        with pytest.raises(OSError, match="injected EIO"):
            store.put("k", v2, meta).result()
        monkeypatch.undo()
        # the new file is in place: a get reads it clean instead of calling it corrupt and dropping it
        assert torch.equal(store.get("k").result(), v2)
        assert store.stats()["corrupt"] == 0 and store.stats()["put_errors"] == 1


def test_changed_paths_leave_one_copy_per_key(tmp_path):
    from kvkernels.io.format import key_digest

    _, v1, meta = staged(seed=1)
    _, v2, _ = staged(seed=2)
    a, b = str(tmp_path / "ssd0"), str(tmp_path / "ssd1")
    with KVStore([a, b]) as probe:
        key = next(f"k{i}" for i in range(200) if probe._path_for(key_digest(f"k{i}")).startswith(b))
    with KVStore([a]) as one:  # one SSD at first
        one.put(key, v1, meta).result()
    with KVStore([a, b]) as two:  # a second SSD added: the key now maps to it
        assert two.contains(key)
        two.put(key, v2, meta).result()
        assert [p for p in files(tmp_path) if p.endswith(".kvk")] == [two._path_for(key_digest(key))]
    # copies left by an older layout (e.g. a crash before the delete) are resolved at recovery
    with KVStore([a]) as one:
        one.put(key, v1, meta).result()
    time.sleep(0.01)
    with KVStore([b]) as only_b:
        only_b.put(key, v2, meta).result()
    with KVStore([a, b]) as both:
        assert both.recovery["removed_duplicates"] == 1 and both.stats()["entries"] == 1
        assert torch.equal(both.get(key).result(), v2)  # the newest copy
        assert both.remove(key)
    with KVStore([a, b]) as again:
        assert not again.contains(key)


def test_a_disturbed_destination_is_not_taken_for_a_corrupt_file(tmp_path, engine):
    """A checksum mismatch in the caller's memory (destinations that overlap, or one scratch
    buffer shared by concurrent gets) must not drop a sound entry: overlapping destinations are
    refused up front, and a mismatch that a re-read into the store's own buffer does not confirm
    fails the get with RuntimeError and keeps the entry."""
    _, buf, meta = staged()
    fmt = meta.fmt
    with KVStore(tmp_path) as store:
        store.put("k", buf, meta).result()
        x = torch.empty(fmt.region_nbytes, dtype=torch.uint8)
        with pytest.raises(ValueError, match="do not overlap"):
            store.get("k", out=[x] * fmt.num_regions)
        # a destination written while the get runs: simulated by damaging the bytes after the read
        real = KVStore._verify

        def scribbled(sel, dests, js):
            for j in js:
                dests[j][0][0] ^= 0xFF
            return real(sel, dests, js)

        store._verify = scribbled
        with pytest.raises(RuntimeError, match="re-reads intact"):
            store.get("k").result()
        del store._verify
        st_ = store.stats()
        assert store.contains("k") and st_["corrupt"] == 0 and st_["disturbed_reads"] == 1
        assert torch.equal(store.get("k").result(), buf)
        assert not [p for p in files(tmp_path) if p.endswith(".corrupt")]
        # a real flip in the file is still corruption (the re-read confirms it)
        (path,) = [p for p in files(tmp_path) if p.endswith(".kvk")]
        with open(path, "r+b") as f:
            f.seek(Header.unpack(open(path, "rb").read(4096)).regions[0].offset + 7)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
        with pytest.raises(CorruptEntryError):
            store.get("k").result()
        assert not store.contains("k")


def _moved_key(tmp_path):
    """Roots A and B, a key that maps to B once both are listed, stored under A alone (v1): the
    paths changed between runs. Returns (a, b, key, v1, v2, meta)."""
    from kvkernels.io.format import key_digest

    _, v1, meta = staged(seed=1)
    _, v2, _ = staged(seed=2)
    a, b = str(tmp_path / "A"), str(tmp_path / "B")
    with KVStore([a, b]) as probe:
        key = next(f"k{i}" for i in range(200) if probe._path_for(key_digest(f"k{i}")).startswith(b))
    with KVStore([a]) as one:
        one.put(key, v1, meta).result()
    return a, b, key, v1, v2, meta


def test_a_remove_while_a_put_publishes_under_another_root_deletes_the_old_copy(tmp_path, monkeypatch):
    """The paths changed: a key's old copy lives under root A, a new put of it goes to root B.
    A remove landing between that put's rename and its directory fsync must delete A's copy
    (only a copy at B's path is the new version's), or the removed key comes back on reopen."""
    from kvkernels.io import store as store_mod

    a, b, key, v1, v2, meta = _moved_key(tmp_path)
    entered, go = threading.Event(), threading.Event()
    real = store_mod._fsync_dir

    def slow(d):
        if d.startswith(b):
            entered.set()
            go.wait(10)
        real(d)

    monkeypatch.setattr(store_mod, "_fsync_dir", slow)
    with KVStore([a, b]) as two:
        fut = two.put(key, v2, meta)
        assert entered.wait(10)
        assert two.remove(key)  # removes the old version (A's copy)
        go.set()
        fut.result()
        assert not [p for p in files(a) if p.endswith(".kvk")]
        assert torch.equal(two.get(key).result(), v2)
        assert two.remove(key)
    with KVStore([a, b]) as again:
        assert not again.contains(key)


def _tiny_meta():
    return EntryMeta(layers=(0, 1), num_blocks=1, block_size=4, num_heads=1, head_dim=64, element_size=2, num_kv=2,
                     num_layers=2, dtype="bfloat16")


def test_removing_a_put_indexed_before_an_older_put_of_its_key_deletes_its_file(tmp_path, monkeypatch):
    """Put A renames first but syncs its folder slowly; put B renames second and is indexed first.
    Removing B while A was still publishing kept B's file (the publishing put was taken for a newer
    one at that path): an unindexed file over the capacity, and the removed key back at reopen."""
    import kvkernels.io.store as store_mod

    meta = _tiny_meta()
    n = meta.fmt.nbytes
    real = store_mod._fsync_dir
    shard_syncs = []

    def slow_first(d):
        if os.path.dirname(os.path.abspath(d)) == os.path.abspath(str(tmp_path)):  # a shard folder
            shard_syncs.append(d)
            if len(shard_syncs) == 2:  # A's sync after its rename (the first synced the new shard)
                time.sleep(1.0)
        real(d)

    monkeypatch.setattr(store_mod, "_fsync_dir", slow_first)
    with KVStore(tmp_path, io_threads=2) as store:
        store.put("k", torch.full((n,), 7, dtype=torch.uint8), meta).result()  # the shard exists now
        shard_syncs.clear()
        shard_syncs.append("first")  # so A's own sync is the slow one
        fa = store.put("k", torch.full((n,), 1, dtype=torch.uint8), meta)
        t0 = time.time()
        while key_digest("k") not in store._publishing and time.time() - t0 < 20:
            time.sleep(0.005)  # until A has renamed (it is in its slow folder sync now)
        assert key_digest("k") in store._publishing
        fb = store.put("k", torch.full((n,), 2, dtype=torch.uint8), meta)
        fb.result(timeout=20)
        assert int(store.get("k").result()[0]) == 2
        assert store.remove("k")
        fa.result(timeout=20)
        assert not store.contains("k") and store.stats()["bytes_used"] == 0
        assert not [p for p in files(tmp_path) if p.endswith(".kvk")]
    monkeypatch.setattr(store_mod, "_fsync_dir", real)
    with KVStore(tmp_path) as again:
        assert not again.contains("k")


def test_the_last_reader_of_an_old_version_never_deletes_the_newer_file_being_read(tmp_path):
    """Capacity for one entry: version 1 of k is evicted while get G1 reads it, version 2 is put
    and evicted while get G2 reads it. G1's release deleted the file at k's path — version 2's,
    under G2, which failed with a KeyError."""
    meta = _tiny_meta()
    n = meta.fmt.nbytes
    store = KVStore(tmp_path, capacity_bytes=4096 + meta.fmt.nbytes, io_threads=3)
    try:
        real = store.engine.read_into
        calls = []
        g1_read, release_g1, g2_started, release_g2 = (threading.Event() for _ in range(4))

        def held(path, pieces):
            calls.append(path)
            if len(calls) == 1:  # G1 reads version 1, then holds its reader
                real(path, pieces)
                g1_read.set()
                release_g1.wait(20)
            elif len(calls) == 2:  # G2 holds its reader before reading version 2
                g2_started.set()
                release_g2.wait(20)
                real(path, pieces)
            else:
                real(path, pieces)

        store.engine.read_into = held
        val = lambda b: torch.full((n,), b, dtype=torch.uint8)  # noqa: E731
        store.put("k", val(1), meta).result()
        g1 = store.get("k")
        assert g1_read.wait(20)
        store.put("x", val(9), meta).result()  # evicts k v1 (G1 still reads it)
        store.put("k", val(2), meta).result()  # evicts x; k v2 at k's path
        g2 = store.get("k")
        assert g2_started.wait(20)
        store.put("x", val(9), meta).result()  # evicts k v2 (G2 reads it)
        release_g1.set()
        assert int(g1.result(timeout=20)[0]) == 1
        release_g2.set()
        assert int(g2.result(timeout=20)[0]) == 2
        assert store.stats()["replaced_reads"] == 0
        assert [p for p in files(tmp_path) if p.endswith(".kvk")] == [store._path_for(key_digest("x"))]
    finally:
        store.close()


def test_a_refused_unlink_of_an_old_copy_leaves_the_store_working(tmp_path, monkeypatch):
    """Deleting a key's old copy under another root fails (e.g. that SSD went read-only): the
    put still commits, every reservation is given back, later puts proceed, and the refusal is
    counted."""
    from kvkernels.io import store as store_mod

    a, b, key, v1, v2, meta = _moved_key(tmp_path)
    real_unlink = os.unlink

    def unlink(p, *args, **kw):
        if str(p).startswith(a):
            raise OSError(errno.EROFS, "Read-only file system", p)
        return real_unlink(p, *args, **kw)

    size = 4096 + meta.fmt.nbytes
    with KVStore([a, b], capacity_bytes=2 * size) as two:
        monkeypatch.setattr(store_mod.os, "unlink", unlink)
        two.put(key, v2, meta).result()
        monkeypatch.setattr(store_mod.os, "unlink", real_unlink)
        st_ = two.stats()
        assert two.contains(key) and st_["unlink_errors"] == 1 and st_["bytes_used"] == size
        assert two._reserved == 0 and two._inflight == 0 and not two._publishing
        two.put("other", v1, meta).result(timeout=10)
        two.put("other2", v1, meta).result(timeout=10)  # evicts: the capacity accounting held
        assert torch.equal(two.get("other2").result(), v1)


def test_requests_racing_close_are_refused_or_completed_never_stranded(tmp_path):
    _, buf, meta = staged()
    store = KVStore(tmp_path, io_threads=2)
    store.put("a", buf, meta).result()
    real_put = store._q.put

    def slow_put(item, *a, **k):
        if item[2] is not None:
            time.sleep(0.3)  # a thread switch inside the submit
        return real_put(item, *a, **k)

    store._q.put = slow_put
    res = {}
    t = threading.Thread(target=lambda: res.setdefault("f", store.get("a")))
    t.start()
    time.sleep(0.1)
    store.close()
    t.join()
    assert torch.equal(res["f"].result(timeout=5), buf)  # queued before the workers' stop: it ran
    with pytest.raises(RuntimeError, match="closed"):
        store.get("a")
    from kvkernels.io.format import key_digest

    assert store._index[key_digest("a")].readers == 0  # the refused get gave its reader back


def test_a_closed_store_refuses_remove_and_get(tmp_path):
    # a closed store's remove deleted the entry of the store that took its folder next; its get
    # of a key it did not hold was a KeyError future where a held key raised "closed"
    _, buf, meta = staged()
    old = KVStore(tmp_path)
    old.put("k", buf, meta).result()
    old.close()
    with KVStore(tmp_path) as new:
        h = new.header("k")
        for call in (lambda: old.remove("k"), lambda: old.remove("k", expect=h), lambda: old.get("k"),
                     lambda: old.get("absent"), lambda: old.get("absent", expect=h)):
            with pytest.raises(RuntimeError, match="KVStore is closed"):
                call()
        assert torch.equal(new.get("k").result(timeout=10), buf)


def test_a_closed_store_answers_as_an_empty_one(tmp_path):
    """Found by review (2026-11-25): after close() `contains`, `header` and `pin` answered from
    the stale index, so a key the store that took the folder next had removed still showed, and
    pinned. They answer as an empty store now (a late call from a shutting-down integration is a
    miss, not an error); a bad key is still a TypeError."""
    _, buf, meta = staged()
    old = KVStore(tmp_path)
    old.put("k", buf, meta).result()
    assert old.pin("k")
    old.close()
    with KVStore(tmp_path) as new:
        assert new.remove("k")
        assert not old.contains("k") and old.header("k") is None and not old.pin("k") and not old.unpin("k")
        assert old.pin_count("k") == 0 and len(old) == 0
        with pytest.raises(TypeError):
            old.contains(3.5)


def test_a_refused_store_leaves_no_folder_behind(tmp_path):
    """Found by review (2026-11-25): the distinct-directories check ran after the folders were
    made, so KVStore([new, new]) raised and left `new/` (and its missing parents) on disk."""
    new = tmp_path / "a" / "b" / "new"
    with pytest.raises(ValueError, match="distinct directories"):
        KVStore([new, new])
    assert os.listdir(tmp_path) == []
    (tmp_path / "keep").mkdir()
    with pytest.raises(ValueError, match="distinct directories"):
        KVStore([tmp_path / "keep", tmp_path / "x" / "y", tmp_path / "keep"])
    assert os.listdir(tmp_path) == ["keep"]  # folders that were there stay


def _gate_headers(store, monkeypatch):
    """Hold every put after its room check (its header write waits): returns the gate to open."""
    gate = threading.Event()
    real = store.engine.write_header
    monkeypatch.setattr(store.engine, "write_header", lambda *a, **kw: (gate.wait(10), real(*a, **kw))[1])
    return gate


def _wait_reserved(store, n):
    deadline = time.monotonic() + 10
    while store._reserved != n:
        assert time.monotonic() < deadline, (store._reserved, n)
        time.sleep(0.01)


def test_concurrent_overwrites_evict_no_unrelated_entry(tmp_path, monkeypatch):
    # each overwrite's room check counted the other's new file in full beside the old version it
    # replaces: x, k0', k1', k2 fit exactly, yet x was evicted
    _, buf, meta = staged()
    _, buf2, _ = staged(seed=1)
    size = 4096 + buf.numel()
    with KVStore(tmp_path, capacity_bytes=4 * size, io_threads=4) as store:
        for k in ("x", "k0", "k1", "k2"):
            store.put(k, buf, meta).result()
        gate = _gate_headers(store, monkeypatch)
        f0 = store.put("k0", buf2, meta)
        _wait_reserved(store, size)
        f1 = store.put("k1", buf2, meta)
        _wait_reserved(store, 2 * size)
        gate.set()
        f0.result(timeout=10), f1.result(timeout=10)
        st = store.stats()
        assert store.contains("x") and st["evictions"] == 0 and st["bytes_used"] == 4 * size
        # two puts of one key and a remove of the version they replace: its bytes are credited
        # once (both new files are on disk until one rename replaces the other: the second room
        # check may evict), and the credit goes with the entry, not again with each put
        gate.clear()
        fs = [store.put("k2", buf2, meta) for _ in range(2)]
        _wait_reserved(store, 2 * size)
        assert store._credit == size
        assert store.remove("k2") and store._credit == 0
        gate.set()
        for f in fs:
            f.result(timeout=10)
        assert (store._reserved, store._credit, store._credits) == (0, 0, {})
        assert store.contains("k2") and store.stats()["bytes_used"] == sum(os.path.getsize(p) for p in files(tmp_path))


def test_a_failed_smaller_overwrite_lends_no_room_to_other_puts(tmp_path, monkeypatch):
    # (second review) the credit was the replaced entry's full size: a put replacing a large
    # entry with a small one let another put in without eviction, on room that exists only if
    # the overwrite commits; it failed, and the store stayed over capacity_bytes
    _, small, meta = staged()
    _, big, big_meta = staged(ids=(3, 9, 1, 4, 5, 6, 7, 8, 10))
    s, b = 4096 + small.numel(), 4096 + big.numel()
    with KVStore(tmp_path, capacity_bytes=b + 2 * s, io_threads=2, engine="posix") as store:
        store.put("k0", big, big_meta).result()
        store.put("x", small, meta).result()
        store.put("z", small, meta).result()
        gate = threading.Event()
        real = store.engine.write_header
        k0 = key_digest("k0").hex()

        def fail_k0(path, *a, **kw):
            if k0 in os.path.basename(path):
                gate.wait(10)
                raise OSError(errno.EIO, "injected: k0's overwrite fails")
            return real(path, *a, **kw)

        monkeypatch.setattr(store.engine, "write_header", fail_k0)
        f0 = store.put("k0", small, meta)  # smaller than the version it replaces
        _wait_reserved(store, s)
        store.put("y", small, meta).result(timeout=10)
        gate.set()
        with pytest.raises(OSError, match="injected"):
            f0.result(timeout=10)
        st = store.stats()
        assert st["bytes_used"] <= b + 2 * s and st["evictions"] == 1 and store.contains("k0")
        assert (store._reserved, store._credit, store._credits) == (0, 0, {})

def test_a_put_that_cannot_fit_for_pinned_entries_evicts_nothing(tmp_path):
    # the put evicted every unpinned entry, then failed with ENOSPC all the same
    _, buf, meta = staged()
    _, big, big_meta = staged(ids=(3, 9, 1, 4, 5, 6))  # two entries' worth
    size = 4096 + buf.numel()
    with KVStore(tmp_path, capacity_bytes=3 * size) as store:
        for k in "abc":
            store.put(k, buf, meta).result()
        assert store.pin("a") and store.pin("b")
        with pytest.raises(OSError, match="pinned") as ei:
            store.put("big", big, big_meta).result(timeout=10)
        assert ei.value.errno == errno.ENOSPC
        assert [store.contains(k) for k in "abc"] == [True] * 3 and store.stats()["evictions"] == 0
        assert store.unpin("a")
        store.put("big", big, big_meta).result(timeout=10)  # now it fits: "a" and "c" (LRU, unpinned) go
        assert [store.contains(k) for k in ("a", "b", "c", "big")] == [False, True, False, True]


def test_entries_evicted_for_a_put_the_disk_then_refuses_stay_evicted(tmp_path, monkeypatch):
    # docs/store.md: eviction runs before the write (the disk's ENOSPC comes later); nothing of the
    # failed put is indexed, and the store's accounting is given back
    _, buf, meta = staged()
    size = 4096 + buf.numel()
    with KVStore(tmp_path, capacity_bytes=2 * size, engine="posix") as store:
        store.put("a", buf, meta).result()
        store.put("b", buf, meta).result()

        def full(fd, bufs, offset, *a):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "pwritev", full)
        err = store.put("c", buf, meta).exception(timeout=10)
        monkeypatch.undo()
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC
        assert [store.contains(k) for k in "abc"] == [False, True, False] and store.stats()["evictions"] == 1
        assert store._reserved == 0 and store.stats()["bytes_used"] == size and len(files(tmp_path)) == 1


def test_reopening_with_a_smaller_capacity_evicts_down_to_it(tmp_path):
    _, buf, meta = staged()
    size = 4096 + buf.numel()
    with KVStore(tmp_path) as store:
        for i, k in enumerate("abcd"):
            store.put(k, buf, meta).result()
            t = 1_000_000_000 + i  # recovery orders entries by mtime: a is the oldest
            os.utime(store._index[key_digest(k)].path, (t, t))
    with KVStore(tmp_path, capacity_bytes=2 * size) as store:
        st = store.stats()
        assert st["bytes_used"] == 2 * size and st["evictions"] == 2 and st["recovery"]["entries"] == 2
        assert [store.contains(k) for k in "abcd"] == [False, False, True, True] and len(files(tmp_path)) == 2


def test_meta_fields_are_checked_by_type_and_as_ascii(tmp_path):
    _, buf, meta = staged()
    for num_kv, exc in ((2.0, TypeError), (True, TypeError), (3, ValueError), (0, ValueError)):
        with pytest.raises(exc, match="meta.num_kv"):  # 2.0 passed `in (1, 2)`
            EntryMeta(**{**meta.__dict__, "num_kv": num_kv}).validate()
    for name in ("dtype", "scheme", "codec"):  # a raw UnicodeEncodeError named no field
        with pytest.raises(ValueError, match=f"meta.{name}"):
            EntryMeta(**{**meta.__dict__, name: "bfloat16\u00e9"}).validate()
    with KVStore(tmp_path) as store:
        with pytest.raises(TypeError, match="meta.num_kv"):
            store.put("k", buf, EntryMeta(**{**meta.__dict__, "num_kv": 2.0}))
        assert len(store) == 0


@pytest.mark.parametrize("name", ["read_priority", "verify", "fsync"])
def test_store_flags_must_be_bools(tmp_path, name):
    # bool(): verify=None turned checksums off, fsync="no" left fsync on
    for bad in (None, 0, 1, "no"):
        with pytest.raises(TypeError, match=f"`{name}`"):
            KVStore(tmp_path / "new", **{name: bad})
    assert not (tmp_path / "new").exists()  # refused before a folder is made
    with KVStore(tmp_path, **{name: False}) as store:
        assert getattr(store, name) is False


# ------------------------------------------------ regressions found by review (2026-11-24, 22nd session)
def test_puts_take_their_in_flight_bytes_in_arrival_order(tmp_path):
    """A put that did not fit the in-flight bound waited while smaller puts arriving after it kept
    fitting (8-16 s beside two busy writers): the bytes are taken first come, first served."""
    with KVStore(tmp_path, max_inflight_bytes=3) as store:
        store._acquire_inflight(2)  # a put in flight
        got: list[str] = []

        def take(name, n):
            store._acquire_inflight(n)
            got.append(name)

        big = threading.Thread(target=take, args=("big", 3))
        big.start()
        deadline = time.monotonic() + 10
        while store._ticket_next < 2 and time.monotonic() < deadline:  # big holds ticket 1
            time.sleep(0.01)
        small = threading.Thread(target=take, args=("small", 1))
        small.start()
        time.sleep(0.3)
        assert got == []  # small fits (2 + 1 <= 3) but arrived after big: it waits its turn
        store._release_inflight(2)
        big.join(10)
        assert got == ["big"]  # alone now (a put larger than the room runs with nothing else)
        store._release_inflight(3)
        small.join(10)
        assert got == ["big", "small"] and store._inflight == 1
        store._release_inflight(1)


def test_a_put_interrupted_while_waiting_its_turn_passes_the_turn_on(tmp_path, monkeypatch):
    with KVStore(tmp_path, max_inflight_bytes=3) as store:
        store._acquire_inflight(3)
        real_wait = store._inflight_cv.wait
        calls = []

        def interrupted(*a, **kw):
            if not calls:
                calls.append(1)
                raise KeyboardInterrupt
            return real_wait(*a, **kw)

        monkeypatch.setattr(store._inflight_cv, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            store._acquire_inflight(1)  # ticket 1 gives up
        store._release_inflight(3)
        done = threading.Event()
        t = threading.Thread(target=lambda: (store._acquire_inflight(2), done.set()))
        t.start()
        assert done.wait(10), "a later put waited forever for the abandoned turn"
        t.join()
        store._release_inflight(2)
        assert store._inflight == 0 and not store._tickets_abandoned


def test_entry_meta_refuses_a_scheme_or_dtype_its_bytes_cannot_be(tmp_path):
    """Found by review (2026-11-25): any short ASCII scheme was accepted, so scheme="fp8" (the
    quant= name) was written without a word and refused only at restore, its granularity lost;
    a dtype contradicting element_size too. An FP8 staging passed as one buffer (at least the
    raw size: a reused scratch buffer) was cut at the raw format's offsets and stored wrong."""
    import dataclasses

    lay, buf, meta = staged()
    with KVStore(tmp_path) as store:
        for bad, match in ((dict(scheme="fp8"), r"`meta.scheme`: expected one of \('raw', 'shuffle', 'fp8-token'"),
                           (dict(dtype="bfloat16", element_size=4), r"`meta.element_size`: expected 2, the size of"),
                           (dict(dtype="float32"), r"`meta.element_size`: expected 4, the size of")):
            with pytest.raises(ValueError, match=match):
                store.put("k", buf, dataclasses.replace(meta, **bad))
        with pytest.raises(ValueError, match=r"`staging`: expected per-region buffers for scheme 'fp8-token'"):
            store.put("k", buf, dataclasses.replace(meta, scheme="fp8-token"))
        assert not store.contains("k") and files(tmp_path) == []
        opaque = dataclasses.replace(meta, dtype="fp8_e4m3+scales")  # not a torch dtype: the caller's own name
        store.put("k", buf, opaque).result()
        assert store.header("k").meta.dtype == "fp8_e4m3+scales"


# ------------------------------------------------ found by mutation testing (thirty-second session)
def test_a_header_of_another_format_version_is_refused_even_with_a_good_checksum():
    import struct

    from kvkernels.io.format import checksum

    _, _, meta = staged()
    h = Header(b"\x01" * 16, meta, Header.layout_regions(meta, [meta.fmt.region_nbytes] * L, [1, 2, 3]))
    body = bytearray(h.pack())
    body[8:12] = struct.pack("<I", 2)
    body[16:24] = b"\x00" * 8
    body[16:24] = struct.pack("<Q", checksum(bytes(body)))
    with pytest.raises(CorruptEntryError, match="unsupported format version 2"):
        Header.unpack(bytes(body))


def test_a_file_whose_last_region_is_not_a_4k_multiple_still_ends_on_4k():
    _, _, meta = staged()
    h = Header(b"\x01" * 16, meta, Header.layout_regions(meta, [5000] * L, [1, 2, 3]))
    last = h.regions[-1]
    assert h.file_nbytes % 4096 == 0 and h.file_nbytes >= last.offset + last.stored > h.file_nbytes - 4096


def test_a_layer_equal_to_the_layer_count_is_refused_by_entrymeta():
    _, _, meta = staged()
    with pytest.raises(ValueError, match="meta.layers"):
        EntryMeta(**{**meta.__dict__, "layers": (0, meta.num_layers)}).validate()


@pytest.mark.parametrize("fsync", [True, False])
def test_each_put_syncs_its_file_before_the_rename_that_publishes_it(tmp_path, monkeypatch, fsync):
    """docs/store.md: a put is durable once acknowledged (its data synced, then renamed into place,
    then the folder synced); with fsync=False nothing is synced."""
    events = []
    real_sync, real_replace, real_fsync = os.fdatasync, os.replace, os.fsync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (events.append(("sync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                     real_sync(fd))[1])
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("sync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.fspath(a))), real_replace(a, b))[1])
    _, buf, meta = staged()
    with KVStore(tmp_path / "s", fsync=fsync, engine="posix") as store:
        events.clear()
        store.put("k", buf, meta).result()
        store.put("k2", buf, meta).result()
    renames = [p for kind, p in events if kind == "replace" and ".kvk.tmp." in p]
    assert len(renames) == 2
    synced = [p for kind, p in events if kind == "sync"]
    if fsync:
        for tmp in renames:
            i = events.index(("replace", tmp))
            assert ("sync", tmp) in events[:i], events
    else:
        assert not any(".kvk" in p for p in synced), synced


def test_kvikio_short_read_errors_map_to_eof_whatever_the_message(tmp_path):
    """A GDS/cuFile read error on a file shorter than the read is an EOFError (as the POSIX engine
    raises), not an OSError(EIO), whatever kvikio's text says."""
    from kvkernels.io.engines import KvikioEngine

    path = tmp_path / "f"
    path.write_bytes(b"x" * 4096)
    pieces = [(0, torch.empty(8192, dtype=torch.uint8))]
    exc = KvikioEngine._posix_error(RuntimeError("cuFile read failed: internal error 5030"), str(path), pieces,
                                    write=False)
    assert isinstance(exc, EOFError)
    exc = KvikioEngine._posix_error(RuntimeError("cuFile read failed: internal error 5030"), str(path),
                                    [(0, torch.empty(4096, dtype=torch.uint8))], write=False)
    assert isinstance(exc, OSError) and exc.errno == errno.EIO


def test_recovery_removes_only_its_own_temporaries(tmp_path):
    _, buf, meta = staged()
    with KVStore(tmp_path) as store:
        store.put("k", buf, meta).result()
    (entry,) = [p for p in files(tmp_path) if p.endswith(".kvk")]
    mine, other = entry + ".tmp.123.4", entry + ".tmp.123.4.keep"
    for p in (mine, other):
        with open(p, "wb") as f:
            f.write(b"x")
    with KVStore(tmp_path) as store:
        assert store.recovery["removed_temporaries"] == 1
    assert not os.path.exists(mine) and os.path.exists(other)


def test_a_pinned_key_put_again_stays_pinned(tmp_path):
    _, buf, meta = staged()
    size = 4096 + buf.numel()
    with KVStore(tmp_path, capacity_bytes=2 * size) as store:
        store.put("a", buf, meta).result()
        assert store.pin("a")
        store.put("a", buf.flip(0), meta).result()  # a new version of a pinned key
        store.put("b", buf, meta).result()
        store.put("c", buf, meta).result()  # "a" is the oldest, but still pinned: "b" goes
        assert store.contains("a") and store.pin_count("a") == 1 and not store.contains("b")
        assert torch.equal(store.get("a").result(), buf.flip(0))
