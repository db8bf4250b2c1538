"""bench/bench_lmcache.py: its checks cannot pass on stale data, and one backend's failure loses
only that backend's rows (named in the results' ``failed_variants``, exit code 3). Tiny sizes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lmcache")

from kvkernels.bench import bench_lmcache as bl  # noqa: E402

MODES = {"run": ("bench_lmcache", []), "run_restore": ("bench_lmcache_restore", ["--restore"]),
         "run_layerwise": ("bench_lmcache_layerwise", ["--layerwise"])}


def _results(out, stem):
    with open(out / f"{stem}.json") as f:
        got = json.load(f)
    return got["rows"], got["meta"]


def _call(mode, tmp_path, backends):
    kw = {"plot": False} if mode == "run" else {}
    return getattr(bl, mode)(directory=str(tmp_path / "d"), out_dir=str(tmp_path / "out"), tiny=True,
                             backends=backends, **kw)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_plugin_read_that_writes_nothing_drops_its_rows(tmp_path, monkeypatch, mode):
    # the check read element 0 only, and LMCache's allocator hands the freed put buffers back for
    # the reads: a read that wrote nothing (and said it did) passed and its GB/s were published
    from kvkernels.integrations.lmcache.backend import KVKernelsBackend

    monkeypatch.setattr(KVKernelsBackend, "_read_many", lambda self, kss, objs, orders: [o is not None for o in objs])
    (tmp_path / "d").mkdir()
    rows = _call(mode, tmp_path, ("kvkernels", "LocalDiskBackend"))
    assert [r["backend"] for r in rows] == ["LocalDiskBackend"]
    saved, meta = _results(tmp_path / "out", MODES[mode][0])
    assert [r["backend"] for r in saved] == ["LocalDiskBackend"]
    assert meta["tiny"] is True  # (review, 2026-11-25: not recorded, a smoke run's file read as a measurement)
    assert [v.split(":")[0] for v in meta["failed_variants"]] == ["kvkernels"]
    assert "came back wrong or missing" in meta["failed_variants"][0]


def test_plugin_get_blocking_returning_nothing_drops_its_rows(tmp_path, monkeypatch):
    # get_blocking's object was not checked: None escaped as an AttributeError (and lost every row)
    from kvkernels.integrations.lmcache.backend import KVKernelsBackend

    monkeypatch.setattr(KVKernelsBackend, "get_blocking", lambda self, key: None)
    (tmp_path / "d").mkdir()
    rows = _call("run", tmp_path, ("kvkernels", "LocalDiskBackend"))
    assert [r["backend"] for r in rows] == ["LocalDiskBackend"]
    _, meta = _results(tmp_path / "out", "bench_lmcache")
    assert [v.split(":")[0] for v in meta["failed_variants"]] == ["kvkernels"]
    assert "get_blocking" in meta["failed_variants"][0]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_one_backend_raising_keeps_the_others_rows_and_exits_3(tmp_path, monkeypatch, mode, capsys):
    # an exception in one backend (e.g. O_DIRECT refused by the filesystem) lost every backend's rows
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    def boom(self, keys):
        raise OSError(22, "Invalid argument (O_DIRECT refused)")

    monkeypatch.setattr(LocalDiskBackend, "batched_get_blocking", boom)
    (tmp_path / "d").mkdir()
    stem, flags = MODES[mode]
    rc = bl.main(["--tiny", "--no-plot", "--dir", str(tmp_path / "d"), "--out", str(tmp_path / "out"), *flags])
    assert rc == 3
    rows, meta = _results(tmp_path / "out", stem)
    kept = {r["backend"] for r in rows}
    assert {"kvkernels", "kvkernels-nofsync"} <= kept and not any(k.startswith("LocalDiskBackend") for k in kept)
    assert sorted(v.split(":")[0] for v in meta["failed_variants"]) == ["LocalDiskBackend", "LocalDiskBackend-odirect"]
    assert all("OSError" in v for v in meta["failed_variants"])
    if mode == "run" and not bl.torch.cuda.is_available():
        assert meta["skipped_variants"] == ["GdsBackend: needs CUDA and cuFile"]
    assert "backend(s) failed" in capsys.readouterr().out
    assert list((tmp_path / "d").iterdir()) == []  # the bench's folder is removed all the same
