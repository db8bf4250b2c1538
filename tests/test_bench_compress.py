"""bench/bench_compress.py: a failing or byte-wrong variant is dropped and named, the others stand.

Tiny mode (as tests/test_cli.py's compress test), one repetition: each test is a second or two."""

from __future__ import annotations

import json
import sys
import types
import weakref

import pytest
import torch

import kvkernels.compress as kc
from kvkernels.bench import bench_compress as bc
from kvtest import HAS_CUDA


def _main(tmp_path, monkeypatch, *extra) -> int:
    monkeypatch.setenv("KVKERNELS_BENCH_DIR", str(tmp_path / "scratch"))
    return bc.main(["--tiny", "--no-plot", "--reps", "1", "--codecs", "zstd", *extra, "--out", str(tmp_path / "o")])


def _results(tmp_path, stem):
    d = json.loads((tmp_path / "o" / f"{stem}.json").read_text())
    return [r["method"] for r in d["rows"]], d["meta"]


def _tile_on_cpu_too(monkeypatch):
    """The timed input tiled (2x) as on a GPU, also on a CPU: the timed decode then reads packs of
    its own, apart from the sample's round trip (on a CPU without this they are the same object)."""
    real = bc._tiled

    def tiled(buf, fmt, device, min_nbytes=None):
        per = fmt.num_regions * fmt.payload_nbytes
        return real(buf, fmt, types.SimpleNamespace(type="cuda"), min_nbytes=2 * per)

    monkeypatch.setattr(bc, "_tiled", tiled)


@pytest.mark.parametrize("fault", ["writes nothing", "one wrong byte"])
def test_codec_variant_with_a_wrong_timed_decode_is_dropped_and_named(tmp_path, monkeypatch, fault):
    # the timed decode's output and the tiled packs were never compared: its row was published
    _tile_on_cpu_too(monkeypatch)
    real_c, real_d = bc.compress_regions, bc.decompress_regions
    tiled_packs = []  # (kept alive: ids stay theirs)

    def compress(buf, fmt, codec, **kw):
        packed = real_c(buf, fmt, codec, **kw)
        if fmt.num_blocks > 8 and kw.get("byteshuffle"):  # the tiled shuffled input
            tiled_packs.append(packed)
        return packed

    def decompress(packed, out=None, **kw):
        if out is not None and any(packed is p for p in tiled_packs):
            if fault == "writes nothing":
                return out
            real_d(packed, out=out, **kw)
            out[123] ^= 1
            return out
        return real_d(packed, out=out, **kw)

    monkeypatch.setattr(bc, "compress_regions", compress)
    monkeypatch.setattr(bc, "decompress_regions", decompress)
    assert _main(tmp_path, monkeypatch) == 3
    assert tiled_packs
    rows, meta = _results(tmp_path, "compress")
    assert "shuffled+zstd" not in rows and {"raw+zstd", "fp8+zstd", "raw", "shuffled", "fp8"} <= set(rows)
    assert [f for f in meta["failed_variants"] if f.startswith("shuffled+zstd: ")], meta
    assert "timed decode" in " ".join(meta["failed_variants"])
    ssd, smeta = _results(tmp_path, "compress_ssd")
    assert "ssd-restore:shuffled+zstd" not in ssd
    assert {"ssd-restore:raw+none", "ssd-restore:raw+zstd", "ssd-restore:fp8+zstd"} <= set(ssd)
    assert any(s.startswith("ssd-restore:shuffled+zstd: ") for s in smeta["skipped_variants"])
    assert smeta["failed_variants"] == meta["failed_variants"]


def test_ssd_restore_writing_nothing_into_a_reused_buffer_is_caught(tmp_path, monkeypatch):
    # as a caching allocator does: a freed same-size buffer handed back as it was (holding the raw
    # variant's bytes, which the shuffled variant's restore must produce too) -- a restore that wrote
    # nothing passed the comparison and was published
    bench_mod = bc.__name__
    real_empty = torch.empty
    pool, reused = [], []  # [memory, weak reference to the tensor handed out on it]

    def empty(*a, **k):
        if (a and isinstance(a[0], int) and k.get("dtype") is torch.uint8
                and sys._getframe(1).f_globals.get("__name__") == bench_mod):
            for entry in pool:
                mem, handed = entry
                if mem.numel() == a[0] and mem.device == torch.device(k.get("device") or "cpu") \
                        and handed() is None:  # the last tensor on it is gone: "freed", handed back as it is
                    t = mem.view(-1)
                    entry[1] = weakref.ref(t)
                    reused.append(t.data_ptr())
                    return t
            mem = real_empty(*a, **k)
            t = mem.view(-1)
            pool.append([mem, weakref.ref(t)])
            return t
        return real_empty(*a, **k)

    monkeypatch.setattr(torch, "empty", empty)
    restored = []
    real_fb = kc.CompressedStaging.from_buffer

    def from_buffer(got, vf, stored, c, byteshuffle=False):
        o = real_fb(got, vf, stored, c, byteshuffle=byteshuffle)
        if byteshuffle:
            restored.append(o)
        return o

    monkeypatch.setattr(kc.CompressedStaging, "from_buffer", staticmethod(from_buffer))
    real_d = bc.decompress_regions

    def decompress(packed, out=None, **kw):
        if out is not None and any(packed is p for p in restored):
            return out  # the shuffled variant's SSD restore writes nothing
        return real_d(packed, out=out, **kw)

    monkeypatch.setattr(bc, "decompress_regions", decompress)
    assert _main(tmp_path, monkeypatch) == 3
    assert restored and reused
    ssd, meta = _results(tmp_path, "compress_ssd")
    assert "ssd-restore:shuffled+zstd" not in ssd
    assert {"ssd-restore:raw+none", "ssd-restore:raw+zstd", "ssd-restore:fp8+none", "ssd-restore:fp8+zstd"} <= set(ssd)
    assert [f for f in meta["failed_variants"] if f.startswith("ssd-restore:shuffled+zstd: ")], meta
    rows, _ = _results(tmp_path, "compress")
    assert {"raw+zstd", "shuffled+zstd", "fp8+zstd"} <= set(rows)


@pytest.mark.parametrize("where", ["codec", "ssd"])
def test_a_raising_variant_keeps_the_others_and_exits_3(tmp_path, monkeypatch, where):
    # one raise lost every row of both files
    if where == "codec":
        real_c = bc.compress_regions

        def compress(buf, fmt, codec, **kw):
            if kw.get("byteshuffle"):
                raise RuntimeError("injected codec failure")
            return real_c(buf, fmt, codec, **kw)

        monkeypatch.setattr(bc, "compress_regions", compress)
    else:
        real_fb = kc.CompressedStaging.from_buffer

        def from_buffer(got, vf, stored, c, byteshuffle=False):
            if vf.element_size == 1:  # the fp8 variant (one opaque byte payload per region)
                raise RuntimeError("injected restore failure")
            return real_fb(got, vf, stored, c, byteshuffle=byteshuffle)

        monkeypatch.setattr(kc.CompressedStaging, "from_buffer", staticmethod(from_buffer))
    assert _main(tmp_path, monkeypatch) == 3
    rows, meta = _results(tmp_path, "compress")
    ssd, smeta = _results(tmp_path, "compress_ssd")
    failed = "shuffled+zstd" if where == "codec" else "ssd-restore:fp8+zstd"
    assert [f for f in meta["failed_variants"] if f.startswith(f"{failed}: RuntimeError: injected")], meta
    assert smeta["failed_variants"] == meta["failed_variants"]
    assert {"raw+zstd", "fp8+zstd"} <= set(rows)
    assert ("shuffled+zstd" in rows) == (where == "ssd")
    assert {"ssd-restore:raw+none", "ssd-restore:raw+zstd", "ssd-restore:fp8+none"} <= set(ssd)
    assert ("ssd-restore:fp8+zstd" in ssd) == (where == "codec")
    assert ("ssd-restore:shuffled+zstd" in ssd) == (where == "ssd")


def test_codec_results_are_written_before_the_ssd_leg(tmp_path, monkeypatch):
    # compress.json was written after the SSD leg: a cut there lost the codec rows too
    def cut(*a, **k):
        raise KeyboardInterrupt("cut during the SSD leg")

    monkeypatch.setattr(bc, "ssd_restore_rows", cut)
    with pytest.raises(KeyboardInterrupt):
        _main(tmp_path, monkeypatch)
    rows, _ = _results(tmp_path, "compress")
    assert {"raw+zstd", "shuffled+zstd", "fp8+zstd"} <= set(rows)


def test_codecs_left_out_are_named_in_the_meta(tmp_path, monkeypatch, capsys):
    if HAS_CUDA:
        pytest.skip("every codec may be available on a GPU")
    assert _main(tmp_path, monkeypatch, "ans", "lz4") == 0
    for stem in ("compress", "compress_ssd"):
        _, meta = _results(tmp_path, stem)
        assert "failed_variants" not in meta
        assert [s.split(":")[0] for s in meta["skipped_variants"]] == ["ans", "lz4"]
        assert "needs nvCOMP" in meta["skipped_variants"][0]
    assert "# skipped (not available on cpu): ans, lz4 (need nvCOMP" in capsys.readouterr().out


def test_the_default_sample_is_the_checkouts_or_made_under_out_from_a_wheel(tmp_path, monkeypatch):
    """From an installed wheel this module's grandparent is ``site-packages/kvkernels``: the
    default sample pointed there (no sample ships in the wheel), and a missing one was then
    written into site-packages."""
    import os

    repo = os.path.dirname(os.path.dirname(os.path.abspath(bc.__file__)))
    assert bc.default_sample("anywhere") == os.path.join(repo, "bench_results", bc.SAMPLE_NAME)  # this checkout
    wheel = tmp_path / "site-packages" / "kvkernels"
    (wheel / "bench").mkdir(parents=True)
    out = str(tmp_path / "o")
    assert bc.default_sample(out, checkout=str(wheel)) == os.path.join(out, bc.SAMPLE_NAME)
    made = []
    monkeypatch.setattr(bc, "_CHECKOUT", str(wheel))
    monkeypatch.setattr(bc, "_real_kv", lambda: types.SimpleNamespace(
        dump_sample=made.append, load_sample=lambda path: bc.synthetic()))
    _, name = bc.load_input(None, False, out)
    assert made == [os.path.join(out, bc.SAMPLE_NAME)] and name == bc.SAMPLE_NAME
    assert not any(p.is_file() for p in wheel.rglob("*"))


def test_a_codec_named_twice_is_measured_once(tmp_path, monkeypatch):
    """``--codecs zstd zstd`` measured zstd twice: rows with the same method and other numbers."""
    monkeypatch.setenv("KVKERNELS_BENCH_DIR", str(tmp_path / "scratch"))
    assert bc.main(["--tiny", "--no-plot", "--reps", "1", "--codecs", "zstd", "zstd", "--out", str(tmp_path / "o")]) == 0
    for stem in ("compress", "compress_ssd"):
        methods, _ = _results(tmp_path, stem)
        assert methods and len(methods) == len(set(methods)), methods
    from kvkernels.bench import common

    assert common.distinct(["nhd", "hnd", "nhd"]) == ["nhd", "hnd"] and common.distinct(None) is None
