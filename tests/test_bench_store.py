"""bench_store: a failing variant loses only its own rows, reads are checked byte for byte (a read
that writes nothing cannot pass on stale bytes), and results are written as the run goes."""

import json
from concurrent.futures import Future

import pytest

from kvkernels.bench import bench_store
from kvkernels.io import KVStore, engines


def _args(tmp_path):
    return ["--tiny", "--no-plot", "--dir", str(tmp_path / "d"), "--out", str(tmp_path / "out")]


def _results(tmp_path):
    return json.loads((tmp_path / "out" / "store.json").read_text())


def test_failing_variant_keeps_the_other_rows_and_exits_3(tmp_path, monkeypatch, capsys):
    class Full(KVStore):  # the last variant's store cannot be made (an OSError lost all 17 rows before)
        def __init__(self, *a, read_priority=True, **k):
            if read_priority is False:
                raise OSError(28, "No space left on device")
            super().__init__(*a, read_priority=read_priority, **k)

    monkeypatch.setattr(bench_store, "KVStore", Full)
    assert bench_store.main(_args(tmp_path)) == 3
    doc = _results(tmp_path)
    methods = [r["method"] for r in doc["rows"]]
    assert {"put[posix]", "get[posix]", "restore[posix]", "get-1-layer[posix]", "qd-sweep-get[qd=8]",
            "read-while-write[read_priority=True]"} <= set(methods)
    assert "read-while-write[read_priority=False]" not in methods
    (failed,) = doc["meta"]["failed_variants"]
    assert failed.startswith("read-while-write[read_priority=False]: OSError")
    assert "partial" not in doc["meta"] and doc["meta"]["ceiling"]["dd_read_gbps"] > 0
    if "kvikio" not in doc["meta"]["engines"]:  # a variant the machine cannot run is listed, not only printed
        assert any(s.startswith("engine[kvikio]: ") for s in doc["meta"]["skipped_variants"])
    out = capsys.readouterr()
    assert "1 variant(s) failed" in out.out and "Traceback" in out.err


def test_posix_read_that_writes_nothing_drops_the_variant(tmp_path, monkeypatch):
    # as /tmp/benchaudit2/s1.py: the second get rep's reads write nothing (the destinations still
    # held the entries' bytes from the first rep, and get[posix] / restore[posix] were published)
    state = {"drops": 0}
    real_drop, real_read = bench_store._drop_tree, engines.PosixEngine.read_into

    def drop(root):
        state["drops"] += 1
        return real_drop(root)

    def read_into(self, path, pieces):
        if state["drops"] == 2:
            return None
        return real_read(self, path, pieces)

    monkeypatch.setattr(bench_store, "_drop_tree", drop)
    monkeypatch.setattr(engines.PosixEngine, "read_into", read_into)
    res = bench_store.run(directory=str(tmp_path / "d"), out_dir=str(tmp_path / "out"), tiny=True, plot=False)
    methods = {r["method"] for r in res["rows"]}
    assert not {"put[posix]", "get[posix]", "restore[posix]", "get-1-layer[posix]"} & methods
    assert {"qd-sweep-get[qd=1]", "read-while-write[read_priority=False]"} <= methods  # later variants stand
    assert [f.split(":")[0] for f in res["meta"]["failed_variants"]] == ["engine[posix]"]
    assert _results(tmp_path)["meta"]["failed_variants"] == res["meta"]["failed_variants"]


def test_get_that_reads_nothing_fails_the_byte_check(tmp_path, monkeypatch):
    # a get that completes without reading (no store checksum involved): only the bench's own
    # compare of the bytes read with the entry's can see it
    real_get = KVStore.get
    calls = {"e0": 0}

    def get(self, key, out=None, layers=None, **kw):
        if key == "e0" and layers is None:
            calls["e0"] += 1
            if calls["e0"] == 2:
                fut = Future()
                fut.set_result(out)
                return fut
        return real_get(self, key, out=out, layers=layers, **kw)

    monkeypatch.setattr(KVStore, "get", get)
    res = bench_store.run(directory=str(tmp_path / "d"), out_dir=str(tmp_path / "out"), tiny=True, plot=False)
    methods = {r["method"] for r in res["rows"]}
    assert "get[posix]" not in methods and "restore[posix]" not in methods and "qd-sweep-get[qd=1]" in methods
    (failed,) = res["meta"]["failed_variants"]
    assert failed.startswith("engine[posix]: RuntimeError") and "read wrong bytes" in failed


def test_partial_results_are_written_as_the_run_goes(tmp_path, monkeypatch):
    class Killed(KVStore):  # a time cap stopping the run in its last variant
        def __init__(self, *a, read_priority=True, **k):
            if read_priority is False:
                raise KeyboardInterrupt
            super().__init__(*a, read_priority=read_priority, **k)

    monkeypatch.setattr(bench_store, "KVStore", Killed)
    with pytest.raises(KeyboardInterrupt):
        bench_store.main(_args(tmp_path))
    doc = _results(tmp_path)
    assert doc["meta"]["partial"] is True and doc["meta"]["failed_variants"] == []
    assert doc["meta"]["ceiling"]["dd_read_gbps"] > 0
    methods = [r["method"] for r in doc["rows"]]
    assert "get[posix]" in methods and "read-while-write[read_priority=True]" in methods
    assert "read-while-write[read_priority=False]" not in methods

    def stopped(*a, **k):  # stopped right after the ceiling: the ceiling is kept
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_store, "_entry", stopped)
    (tmp_path / "out" / "store.json").unlink()
    with pytest.raises(KeyboardInterrupt):
        bench_store.main(_args(tmp_path))
    doc = _results(tmp_path)
    assert doc["meta"]["partial"] is True and doc["rows"] == [] and doc["meta"]["ceiling"]["dd_write_gbps"] > 0


def test_read_while_write_puts_are_read_back(tmp_path, monkeypatch):
    # the entries written beside the timed reads were never read back: a put storing wrong bytes
    # left both read-while-write rows (and their mixed_total_gbps) standing
    real_put = KVStore.put

    def put(self, key, src, meta, *a, **k):
        if key == "new1":
            src = src.clone()
            src[5] ^= 0xFF
        return real_put(self, key, src, meta, *a, **k)

    monkeypatch.setattr(KVStore, "put", put)
    res = bench_store.run(directory=str(tmp_path / "d"), out_dir=str(tmp_path / "out"), tiny=True, plot=False)
    methods = {r["method"] for r in res["rows"]}
    assert not any(m.startswith("read-while-write") for m in methods) and "get[posix]" in methods
    failed = res["meta"]["failed_variants"]
    assert [f.split(":")[0] for f in failed] == ["read-while-write[read_priority=True]",
                                                 "read-while-write[read_priority=False]"]
    assert all("new1: read wrong bytes: 1 of" in f for f in failed)
