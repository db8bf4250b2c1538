"""Benchmark: per-kernel microbenchmarks under pytest-benchmark, for regression tracking between commits.

One benchmark per (shape, op, backend): the paged ``gather`` and ``scatter``, the FP8 quantizing
gather / dequantizing scatter (per token-head scales) and the byte-plane shuffle, each for every
backend that runs here — ``torch`` (:mod:`kvkernels.reference`, the index-and-copy a user would
write instead: the baseline), ``triton`` and, on a GPU where it builds, ``cuda`` (when it does not,
the reason is printed and ``--compare`` counts its missing rows). Shapes: vLLM's layouts, block
size 16, ``--blocks`` random blocks (default 2048) of a pool of twice as many: llama3-8b NHD and HND
(32 KB chunks, 8 heads: other strides), llama3-70b-tp8 NHD (4 KB), deepseek-v3 MLA (18 KB); on a
CPU (or ``--tiny``) the same four cut to 2 layers, 2 heads, block size 4, 8 of 16 blocks (their
numbers prove that the kernels run, nothing more).

Timing is pytest-benchmark's: rounds of one call each, wall clock, ``torch.cuda.synchronize()``
ending every round on a GPU, so a round is the kernel plus the op's host path (argument checks,
launch: tens of µs) plus one sync — at 2048 blocks a few percent of the kernel's time;
``kvkernels bench gather`` has the CUDA-event figures, the ones to quote against the peak. Each
benchmark first runs its op once (JIT compile, first-use build); after the timed rounds it poisons
what the op writes (the staging buffer, the destination blocks), runs the op once more and checks
the result: bit-exact against the torch backend (the FP8 codes too), the torch FP8 scatter within
e4m3's rounding of the source. Under pytest a benchmark that fails its check is a failed test
(marked ``verified: false`` in pytest-benchmark's JSON); ``kvkernels bench micro`` drops its row,
names every failed or erroring benchmark in the results' ``failed_variants`` and exits 3, as the
other benches do, and lists the backends that cannot run here in ``skipped_variants``.

Two ways to run it:

    pytest bench/bench_micro.py --benchmark-only                # pytest-benchmark's table; all of
    pytest bench/bench_micro.py --benchmark-autosave            # its options apply (save, compare,
    pytest bench/bench_micro.py --benchmark-compare --benchmark-compare-fail=median:10%   # gate, ...)

    kvkernels bench micro --out bench_results/h100              # + % of the measured copy peak,
    kvkernels bench micro --compare OLD/micro.json --fail-slower 10   # x torch, CSV/JSON/PNG

The second runs the first in a child process, then writes ``micro.csv`` / ``micro.json`` (rows with
the median, min, rounds, GB/s = bytes read + written over the median, % of the device-copy peak
measured in the same run, speed-up over the torch backend; GPU, versions, date), ``micro.png`` and
pytest-benchmark's own JSON (``micro-pytest-benchmark.json``, readable by ``pytest-benchmark
compare``; its saved runs, with ``-- --benchmark-autosave``, go to ``--out``/pytest-benchmark).
``--compare`` puts an earlier ``micro.json`` beside it (same device and sizes only, every row of it
verified) and ``--fail-slower PCT`` exits 1 when a median got more than PCT % slower or a row of the
earlier run is missing (unless ``-k``, or a selection passed to pytest after ``--``, chose a subset).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch

try:  # run as a script or a pytest file (bench/ on sys.path) or as kvkernels.bench.bench_micro
    from . import common
except ImportError:  # pragma: no cover
    import common  # type: ignore

import kvkernels
from kvkernels import QuantStagingFormat, StagingFormat
from kvkernels.models import get_model, make_cache
from kvkernels.quant import gather_quant, scatter_quant

TINY_ENV = "KVK_MICRO_TINY"  # "1": the tiny CPU-sized shapes on any device (set by --tiny)
BLOCKS_ENV = "KVK_MICRO_BLOCKS"  # blocks per benchmark on the full shapes (set by --blocks)

# (name, model, layout): the registry's chunk classes (bytes per block at block size 16, bf16)
FULL_CASES = (("llama3-8b-nhd", "llama3-8b", "vllm-nhd"),  # 32 KB chunks
              ("llama3-8b-hnd", "llama3-8b", "vllm-hnd"),  # 32 KB, heads outside the tokens
              ("llama3-70b-tp8-nhd", "llama3-70b-tp8", "vllm-nhd"),  # 4 KB (one head: HND is the same bytes)
              ("deepseek-v3-mla", "deepseek-v3-mla", "mla"))  # 18 KB
# op name -> gather_quant / scatter_quant keywords
OPS: dict[str, tuple[str, dict[str, Any]]] = {"gather": ("gather", {}), "scatter": ("scatter", {}),
       "gather-fp8": ("gather", {"quant": "fp8"}), "scatter-fp8": ("scatter", {"quant": "fp8"}),
       "gather-shuffle": ("gather", {"shuffle": True}), "scatter-shuffle": ("scatter", {"shuffle": True})}
POISON = 0x5A  # written over the outputs before the checked call


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _tiny() -> bool:
    return os.environ.get(TINY_ENV, "0") == "1" or not torch.cuda.is_available()


def _blocks() -> int:
    text = os.environ.get(BLOCKS_ENV, "").strip() or "2048"
    try:
        return common.positive_int(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{BLOCKS_ENV}: {exc}") from None


def _left_out() -> list[str]:
    """The backends that do not run here, each with why (``skipped_variants`` of a run)."""
    dev = _device()
    out = []
    if not kvkernels.backends.triton_available(dev):
        why = kvkernels.backends.triton_unavailable_reason(dev) if dev.type == "cuda" else common.NO_TRITON_ON_CPU
        out.append(f"*[triton]: {why}")
    if dev.type != "cuda":
        out.append(f"*[cuda]: {common.NO_CUDA_BACKEND_ON_CPU}")
    elif not kvkernels.backends.cuda_ext_available():
        from kvkernels import _cuda

        out.append(f"*[cuda]: {_cuda.reason()}")
    return out


def _failed_tests(junit_path: str) -> list[str]:
    """``name: first line of the message`` of every failed or erroring test in a JUnit XML report."""
    import xml.etree.ElementTree as ET  # noqa: PLC0415, S405 - pytest's own report, written just now

    try:
        root = ET.parse(junit_path).getroot()
    except (OSError, ET.ParseError):
        return []
    out = []
    for tc in root.iter("testcase"):
        for bad in list(tc.findall("failure")) + list(tc.findall("error")):
            msg = (bad.get("message") or bad.tag).strip().splitlines()
            out.append(f"{tc.get('name')}: {msg[0][:200] if msg else bad.tag}")
    return out


def _backends(say: bool = False) -> list[str]:
    """Every backend that runs here: torch always, triton on a GPU or under TRITON_INTERPRET=1, cuda
    on a GPU where the csrc library builds (the build happens here, once). ``say``: print why
    triton or cuda is left out on a GPU."""
    dev = _device()
    out = ["torch"]
    if kvkernels.backends.triton_available(dev):
        out.append("triton")
    elif say and dev.type == "cuda":
        print("[bench] triton left out: it does not run here")
    if dev.type == "cuda":
        if kvkernels.backends.cuda_ext_available():
            out.append("cuda")
        elif say:
            from kvkernels import _cuda

            print(f"[bench] cuda backend left out: {_cuda.reason()}")
    return out


class Case:
    """A paged cache of one shape with normal(0, 1) values (real KV's range: FP8 scales stay
    meaningful, no NaN), a source block set and a disjoint destination set."""

    def __init__(self, name: str, model: str, layout: str):
        self.device = _device()
        tiny = _tiny()
        shape = get_model(model)
        if tiny:
            shape = shape.scaled(num_layers=2, num_kv_heads=2)
        block_size = 4 if tiny else 16
        self.blocks = 8 if tiny else _blocks()
        pool = 2 * self.blocks
        self.name, self.model, self.layout_name = name, model, layout
        self.layout = make_cache(layout, num_layers=shape.num_layers, num_blocks=pool, block_size=block_size,
                                 num_heads=shape.num_kv_heads, head_dim=shape.head_dim, device=self.device,
                                 fill="zero")
        gen = torch.Generator(device=self.device).manual_seed(0)
        for views in self.layout.views:
            for v in views:
                v.normal_(generator=gen)
        perm = torch.randperm(pool, generator=torch.Generator().manual_seed(1))
        self.ids = perm[: self.blocks].to(self.device)
        self.dst_ids = perm[self.blocks: 2 * self.blocks].to(self.device)
        fmt = StagingFormat.for_layout(self.layout, self.blocks)
        self.payload = fmt.num_regions * fmt.payload_nbytes
        self.poison = torch.full((fmt.nbytes,), POISON, dtype=torch.uint8, device=self.device)
        qf = QuantStagingFormat.for_layout(self.layout, self.blocks, granularity="token")
        self.fp8_moved = common.fp8_moved(qf, self.payload)
        self.sources: dict[str, torch.Tensor] = {}  # op keywords -> the torch backend's staging of ids

    def info(self) -> dict:
        lay = self.layout
        return {"model": self.model, "layout": self.layout_name, "chunk_kb": round(lay.chunk_nbytes / 1024, 2),
                "blocks": self.blocks, "layers": lay.num_layers, "payload_mb": round(self.payload / 1e6, 3),
                "device": str(self.device)}

    def moved(self, kw: dict) -> int:
        """Bytes the op must read + write: payload + codes + scales for FP8, else twice the payload."""
        return self.fp8_moved if kw.get("quant") else 2 * self.payload

    def source(self, kw: dict) -> torch.Tensor:
        key = json.dumps(kw, sort_keys=True)
        if key not in self.sources:
            self.sources[key] = gather_quant(self.layout, self.ids, backend="torch", **kw)
        return self.sources[key]

    def poison_destination(self) -> None:
        """Every byte of the destination blocks set to POISON (a scatter that writes nothing is seen)."""
        kvkernels.scatter(self.poison, self.layout, self.dst_ids, backend="torch")


_CASE: dict[str, Case] = {}  # the one case alive (the case is the outermost parameter)


def _case(name: str) -> Case:
    """The cache of shape ``name``, built once; the previous shape's is dropped (and its memory
    handed back) before the new one is allocated."""
    if name not in _CASE:
        spec = next((c for c in FULL_CASES if c[0] == name), None)
        if spec is None:
            raise KeyError(name)
        _CASE.clear()
        gc.collect()
        if _device().type == "cuda":
            torch.cuda.empty_cache()
        _CASE[name] = Case(*spec)
    return _CASE[name]


_case.cache_clear = _CASE.clear  # type: ignore[attr-defined]


def _cases() -> list[str]:
    return [c[0] for c in FULL_CASES]


def _timed(fn, device: torch.device):
    if device.type != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize(device)

    return run


def _plain(case: Case, ids: torch.Tensor) -> torch.Tensor:
    return kvkernels.gather(case.layout, ids, backend="torch")


def pytest_generate_tests(metafunc):
    """Parametrized at collection, not import: the CLI imports this module without building anything."""
    if metafunc.definition.name == "test_kernel":
        metafunc.parametrize("case_name", _cases())
        metafunc.parametrize("op", list(OPS))
        metafunc.parametrize("backend", _backends())


def test_kernel(benchmark, case_name, op, backend):
    case = _case(case_name)
    kind, kw = OPS[op]
    if kind == "gather":
        out = torch.empty_like(case.source(kw))

        def fn():
            gather_quant(case.layout, case.ids, out=out, backend=backend, validate=False, **kw)
    else:
        staging = case.source(kw)

        def fn():
            scatter_quant(staging, case.layout, case.dst_ids, backend=backend, validate=False, **kw)

    fn()  # warm-up: JIT compile / first-use build, outside the timed rounds
    benchmark.group = f"{case_name} {op}"
    benchmark.extra_info.update(case.info(), op=op, backend=backend, moved_bytes=case.moved(kw), verified=False)
    benchmark(_timed(fn, case.device))
    stats = getattr(benchmark, "stats", None)  # None under --benchmark-disable
    if stats is not None:
        benchmark.extra_info["gbps"] = common.gbps(case.moved(kw), stats.stats.median * 1e3)

    # what the op writes, poisoned first, then one more call checked: a kernel that writes nothing
    # (or part) would otherwise pass on the bytes an earlier call or backend left there
    if kind == "gather":
        out.fill_(POISON)
        fn()
        assert torch.equal(out, case.source(kw)), f"{op}[{backend}] wrote other bytes than the torch backend"
        benchmark.extra_info["verified"] = True
        return
    case.poison_destination()
    fn()
    got = _plain(case, case.dst_ids)
    want = _plain(case, case.ids)
    if not kw.get("quant"):  # lossless: the destination holds the source blocks' bytes
        assert torch.equal(got, want), f"{op}[{backend}]: the destination blocks differ from the source's"
    elif backend != "torch":  # FP8: the same dequantized bytes as the torch backend's scatter
        case.poison_destination()
        scatter_quant(staging, case.layout, case.dst_ids, backend="torch", **kw)
        assert torch.equal(got, _plain(case, case.dst_ids)), f"{op}[{backend}] dequantized otherwise than torch"
    else:  # the torch FP8 round trip itself: within e4m3's rounding (3 mantissa bits: 2^-4 relative)
        a = got.view(case.layout.dtype).float()
        b = want.view(case.layout.dtype).float()
        assert torch.allclose(a, b, rtol=2 ** -4 + 2 ** -8, atol=1e-3), \
            f"{op}[torch]: round trip off by {(a - b).abs().max().item():.3g}"
    benchmark.extra_info["verified"] = True


# ------------------------------------------------------------------------------------ CLI wrapper


def _rows(report: dict, peaks: dict) -> list[dict]:
    """pytest-benchmark's JSON -> one row per benchmark (times in µs), % of peak, x the torch backend."""
    rows = []
    for b in report.get("benchmarks", []):
        x, s = b.get("extra_info", {}), b["stats"]
        row = {k: x.get(k) for k in ("model", "layout", "chunk_kb", "blocks", "layers", "payload_mb", "op",
                                     "backend")}
        row["method"] = f"{x.get('op')}[{x.get('backend')}]"
        row["verified"] = bool(x.get("verified"))  # False: the op's check after the rounds failed
        row.update(median_us=s["median"] * 1e6, min_us=s["min"] * 1e6, iqr_us=s["iqr"] * 1e6, rounds=s["rounds"],
                   gbps=common.gbps(x.get("moved_bytes", 0), s["median"] * 1e3))
        peak = peaks.get("d2d_gbps")
        row["pct_peak"] = 100.0 * row["gbps"] / peak if peak else None
        rows.append(row)
    torch_us = {(r["model"], r["layout"], r["op"]): r["median_us"] for r in rows if r["backend"] == "torch"}
    for r in rows:
        t = torch_us.get((r["model"], r["layout"], r["op"]))
        r["x_torch"] = t / r["median_us"] if t and r["median_us"] > 0 else None
    return rows


def _key(r: dict) -> tuple:
    return (r.get("model"), r.get("layout"), r.get("blocks"), r.get("layers"), r.get("op"), r.get("backend"))


def load_baseline(old_path: str) -> tuple[dict, list[dict]]:
    """An earlier run's (meta, rows), or ``ValueError`` saying why it is no baseline (unreadable,
    not a micro.json, its pytest run failed, a row failed its check). ``main`` calls it before
    measuring: a bad ``--compare`` file is refused at once, not after the whole run."""
    try:
        with open(old_path) as f:
            old = json.load(f)
        old_meta, old_rows = old["meta"], old["rows"]
        if not isinstance(old_meta, dict) or not isinstance(old_rows, list) or \
                not all(isinstance(r, dict) for r in old_rows):
            raise TypeError("meta must be an object and rows a list of objects")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--compare {old_path}: not a micro.json of this bench ({type(exc).__name__}: {exc})") from None
    if old_meta.get("pytest_rc") not in (0, None):
        raise ValueError(f"--compare {old_path}: not a baseline, its pytest run exited {old_meta.get('pytest_rc')}")
    bad = [f"{r.get('model')}/{r.get('layout')} {r.get('method')}" for r in old_rows if r.get("verified") is False]
    if bad:
        raise ValueError(f"--compare {old_path}: not a baseline, its checks failed for " + "; ".join(bad))
    return old_meta, old_rows


def compare(rows: list[dict], meta: dict, old_path: str, fail_slower: float | None,
            subset: bool = False) -> tuple[int, str]:
    """Put an earlier run's medians beside these (``was_us``, ``change_pct``: + is slower). Returns
    (exit code, message): 2 when the runs cannot be compared (other device or sizes, an unreadable
    file, an earlier run with a row that failed its check), 1 when ``fail_slower`` is given and a
    median got more than that many % slower or a row of the earlier run is missing here (a backend
    that no longer builds must not pass the gate by its absence; ``subset``: this run chose its
    benchmarks with -k, missing rows are only listed), else 0. A baseline whose pytest run failed
    (its failed benchmarks may have left no row to compare) is refused."""
    try:
        old_meta, old_rows = load_baseline(old_path)
    except ValueError as exc:
        return 2, str(exc)
    for k in ("device", "tiny"):
        if old_meta.get(k) != meta.get(k):
            return 2, (f"--compare {old_path}: measured with {k}={old_meta.get(k)!r}, this run {k}={meta.get(k)!r}; "
                       "timings compare only on the same device and sizes")
    before = {_key(r): r for r in old_rows}
    mine = {_key(r) for r in rows}
    missing = [f"{k[0]}/{k[1]} {k[4]}[{k[5]}]" for k in before if k not in mine]
    matched, worse = 0, []
    for r in rows:
        o = before.get(_key(r))
        if o is None or not o.get("median_us"):
            continue
        matched += 1
        r["was_us"] = o["median_us"]
        r["change_pct"] = 100.0 * (r["median_us"] / o["median_us"] - 1.0)
        if fail_slower is not None and r["change_pct"] > fail_slower:
            worse.append(f"{r['model']}/{r['layout']} {r['method']} {r['change_pct']:+.1f} %")
    if matched == 0:
        return 2, f"--compare {old_path}: no benchmark in common with this run"
    msg = f"compared {matched} of {len(rows)} benchmarks with {old_path} (commit {old_meta.get('commit')})"
    if missing:
        msg += (f"; {len(missing)} of its benchmarks not run here" + (" (-k or pytest's own selection chose them)" if subset else "") + ": "
                + "; ".join(missing))
    if worse:
        msg += f"; more than {fail_slower:g} % slower: " + "; ".join(worse)
    return (1 if fail_slower is not None and (worse or (missing and not subset)) else 0), msg


def selects(pytest_args) -> bool:
    """True when arguments passed through to pytest (after ``--``) choose a subset of the
    benchmarks (``-k``, ``-m``, node ids, ``--deselect``, ``--lf``...): ``--compare`` then lists
    the baseline's rows missing here without failing the gate, as for this script's own ``-k``."""
    for arg in pytest_args:
        a = str(arg)
        if a.startswith(("-k", "-m", "--deselect", "--ignore", "--lf", "--last-failed", "--sw", "--stepwise",
                         "--keyword", "--markers-expr")) or "::" in a or a.endswith(".py"):
            return True
    return False


MAX_TIME_S = 3600  # --max-time's ceiling: an hour per benchmark (pytest-benchmark overflows on inf or 1e308)


def run(*, out_dir: str = "bench_results", tiny: bool = False, blocks: int = 2048, max_time: float = 0.5,
        min_rounds: int = 5, select: str | None = None, plot: bool = True, compare_to: str | None = None,
        fail_slower: float | None = None, pytest_args: list[str] | tuple = ()) -> dict:
    device, tiny, meta = common.start(tiny)
    peaks = meta["peaks"]
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the peaks' buffers: the child process needs the memory
    _backends(say=True)  # (the child finds the same, the CUDA build cached)
    with tempfile.TemporaryDirectory(prefix="kvk-micro-") as tmp:
        raw = os.path.join(tmp, "report.json")
        junit = os.path.join(tmp, "junit.xml")  # which benchmarks failed (their check, or raised)
        ini = os.path.join(tmp, "pytest.ini")  # this file's own settings, not the repository's
        with open(ini, "w") as f:
            f.write("[pytest]\n")
        cmd = [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-c", ini, "--rootdir", tmp,
               "-p", "no:cacheprovider", "-q", "--disable-warnings", "--benchmark-only", f"--benchmark-json={raw}",
               f"--junitxml={junit}",
               f"--benchmark-max-time={max_time}", f"--benchmark-min-rounds={min_rounds}",
               "--benchmark-columns=min,median,iqr,rounds", "--benchmark-sort=name",
               # its storage (made on every run, used by --benchmark-autosave): under --out, not the cwd
               f"--benchmark-storage=file://{os.path.abspath(os.path.join(out_dir, 'pytest-benchmark'))}"]
        if select:
            cmd += ["-k", select]
        cmd += list(pytest_args)
        child_env = dict(os.environ, **{TINY_ENV: "1" if tiny else "0", BLOCKS_ENV: str(blocks)})
        print("[bench] " + " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, env=child_env)
        if not os.path.exists(raw):
            why = f" (-k {select!r} chose no benchmark?)" if rc == 5 and select else (" (no benchmark collected)" if rc == 5 else "")
            print(f"[bench] pytest exited {rc} without a report{why}", file=sys.stderr)
            return {"rows": [], "meta": meta, "paths": {}, "rc": rc or 1}
        with open(raw) as f:
            report = json.load(f)
        failed = _failed_tests(junit)
    rows = _rows(report, peaks)
    meta["pytest_rc"] = rc
    # a benchmark whose check failed is timed all the same: its row is dropped (its numbers are
    # of a kernel that wrote other bytes) and named, with those that raised before a row existed
    dropped = [r for r in rows if not r["verified"]]
    rows = [r for r in rows if r["verified"]]
    if failed or dropped:
        meta["failed_variants"] = failed or [f"{r['model']}/{r['layout']} {r['method']}: not verified" for r in dropped]
    left_out = _left_out()
    if left_out:
        meta["skipped_variants"] = left_out
    cmp_rc, cmp_msg = 0, None
    if compare_to:
        cmp_rc, cmp_msg = compare(rows, meta, compare_to, fail_slower, subset=bool(select) or selects(pytest_args))
    paths = common.write_results(rows, meta, out_dir, "micro")
    paths["pytest-benchmark"] = os.path.join(out_dir, "micro-pytest-benchmark.json")
    with open(paths["pytest-benchmark"], "w") as f:
        json.dump(report, f, indent=1)
    print(f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  {meta['date']}")
    print(f"# measured device-copy peak: {peaks['d2d_gbps']:.3g} GB/s (read + write)")
    cols = ["model", "layout", "chunk_kb", "method", "median_us", "gbps", "pct_peak", "x_torch", "verified"]
    if any("change_pct" in r for r in rows):
        cols += ["was_us", "change_pct"]
    print(common.format_table(rows, cols))
    if cmp_msg:
        print(("# " if cmp_rc == 0 else "# FAIL: ") + cmp_msg)
    res = common.finish(rows, meta, paths, out_dir=out_dir, stem="micro", plot=plot,
                        case=lambda r: f"{r['model']}/{r['layout']}\n{r['op']}", value="pct_peak",
                        ylabel="% of measured device-copy peak", title="kernel microbenchmarks", series="backend")
    # 3: variants failed (named in the meta), as every bench; pytest's own code for anything else
    res["rc"] = 3 if (rc in (0, 1) and meta.get("failed_variants")) else (rc if rc else cmp_rc)
    return res


def main(argv=None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="arguments after -- go to pytest and pytest-benchmark, e.g.\n"
                                       "  -- --benchmark-autosave\n"
                                       "  -- --benchmark-compare --benchmark-compare-fail=median:10%\n"
                                       "(--benchmark-only is always on)")
    p.add_argument("--out", default="bench_results", help=common.OUT_HELP)
    p.add_argument("--tiny", action="store_true", help="tiny CPU-sized shapes, also on a GPU")
    p.add_argument("--blocks", type=common.positive_int, default=2048, help="blocks per benchmark (full shapes; "
                   "the pool holds twice as many)")
    p.add_argument("--max-time", type=float, default=0.5, help="seconds per benchmark (pytest-benchmark)")
    p.add_argument("--min-rounds", type=common.positive_int, default=5, help="rounds per benchmark, at least")
    p.add_argument("-k", dest="select", metavar="EXPR", help="pytest -k expression (e.g. 'gather and triton')")
    p.add_argument("--compare", metavar="MICRO_JSON", help="micro.json of an earlier run on the same device")
    p.add_argument("--fail-slower", type=float, metavar="PCT", help="with --compare: exit 1 when a median is "
                   "more than PCT %% slower")
    p.add_argument("--no-plot", action="store_true")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    a = p.parse_args(argv)
    if not 0 < a.max_time <= MAX_TIME_S:  # inf (or 1e308) crashed pytest-benchmark in the child
        p.error(f"argument --max-time: expected seconds in (0, {MAX_TIME_S}], got {a.max_time}")
    if a.fail_slower is not None and a.compare is None:
        p.error("argument --fail-slower: needs --compare")
    if a.fail_slower is not None and not 0 <= a.fail_slower < float("inf"):
        p.error(f"argument --fail-slower: expected a percentage >= 0, got {a.fail_slower}")
    if importlib.util.find_spec("pytest_benchmark") is None:
        p.error("needs pytest-benchmark: pip install 'kvkernels[bench]'")
    if a.compare is not None and not os.path.isfile(a.compare):
        p.error(f"argument --compare: no file {a.compare!r}")
    if a.compare is not None:
        try:
            load_baseline(a.compare)
        except ValueError as exc:
            p.error(f"argument {exc}")
    if a.tiny and a.blocks != p.get_default("blocks"):
        print("[bench] tiny shapes: 8 blocks (--blocks does not apply)", flush=True)
    common.bench_paths(p, out=a.out)
    res = run(out_dir=a.out, tiny=a.tiny, blocks=a.blocks, max_time=a.max_time, min_rounds=a.min_rounds,
              select=a.select, plot=not a.no_plot, compare_to=a.compare, fail_slower=a.fail_slower,
              pytest_args=extra)
    return res["rc"]


if __name__ == "__main__":
    sys.exit(main())
