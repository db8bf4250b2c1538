"""The CUDA C++ backend (csrc/) compiles warning-free for sm_80 / sm_90 / sm_90a on a GPU-less
machine and exports its C ABI; on a GPU the same gather/scatter tests run it (kvtest.BACKENDS).

The FP8 arithmetic of the kernels (csrc/kernels/fp8.cuh: e4m3 encode / decode, the bf16 / fp16
roundings, the per-row amax / scale / codes) is ``__host__ __device__`` integer code, so it is built
into a host-only library (csrc/tests/fp8_host.cu) and checked against torch on this CPU machine."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess

import ctypes
import ctypes.util

import pytest
import torch

import kvkernels
from kvkernels.backends import _version_tuple
from kvkernels.models import make_cache, random_fill_
from kvkernels.quant import (
    dequantize_rows,
    fp8_codes,
    gather_quant,
    quantize_rows,
    scatter_quant,
)
from kvtest import DEVICE, bytes_equal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("kvk_csrc_build", os.path.join(ROOT, "csrc", "build.py"))
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)

needs_nvcc = pytest.mark.skipif(build.nvcc() is None, reason="nvcc not installed (CI has it)")


def test_concurrent_builds_into_one_folder_each_rename_a_complete_file(tmp_path, monkeypatch):
    """Two first uses building at once (two threads, or two containers whose processes share a
    pid and the cache folder) write separate temporaries: each rename puts a whole library in
    place (one temporary per pid let one build move the other's half-written file). A failed build
    leaves no temporary behind. The compiler is stood in for by a slow two-part writer."""
    import sys
    import threading

    writer = ("import sys, time; f = open(sys.argv[1], 'wb'); f.write(b'a' * 1000); f.flush(); time.sleep(0.3); "
              "f.write(b'b' * 1000); f.close(); sys.exit(int(sys.argv[2]))")
    code = {"rc": "0"}
    monkeypatch.setattr(build, "command", lambda out, archs=(), extra=(), cutlass_inc=None: [sys.executable, "-c", writer, out, code["rc"]])
    sizes, errors = [], []

    def one():
        try:
            path = build.build(str(tmp_path), lib_name="libx.so")
            sizes.append(os.path.getsize(path))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    ts = [threading.Thread(target=one) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == [] and sizes == [2000, 2000]
    assert os.listdir(tmp_path) == ["libx.so"]
    code["rc"] = "1"
    with pytest.raises(RuntimeError, match="nvcc failed"):
        build.build(str(tmp_path), lib_name="liby.so")
    assert os.listdir(tmp_path) == ["libx.so"]


@needs_nvcc
def test_compiles_for_all_targets_with_warnings_as_errors(tmp_path):
    lib = build.build(str(tmp_path))
    nm = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True, check=True).stdout
    syms = set(re.findall(r"\bkvk_\w+", nm))
    assert {"kvk_abi_version", "kvk_last_error", "kvk_paged_copy", "kvk_quant_gather", "kvk_dequant_scatter",
            "kvk_shuffle_copy", "kvk_bulk_copy", "kvk_features", "kvk_probe"} <= syms
    # no C++ symbol (and so no torch ABI) crosses the boundary
    assert not [s for s in re.findall(r" T (\S+)", nm) if s.startswith("_Z") and "kvk" not in s and "paged" in s]


@pytest.mark.parametrize("raw, want", [("1", True), ("true", True), (" YES ", True), ("on", True), ("", False),
                                       ("0", False), ("False", False), ("no", False), ("off", False), ("2", None),
                                       ("ture", None)])
def test_setup_reads_build_cuda_like_every_boolean_variable(monkeypatch, raw, want):
    # setup.py runs setup() at import, so only its parser is taken out and run; before, any value
    # but exactly "1" (``true``, `` 1``) silently gave a pure-Python install
    import ast

    src = open(os.path.join(ROOT, "setup.py")).read()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_build_cuda_requested")
    ns = {"os": os}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "setup.py", "exec"), ns)
    monkeypatch.setenv("KVKERNELS_BUILD_CUDA", raw)
    if want is None:
        with pytest.raises(RuntimeError, match="KVKERNELS_BUILD_CUDA"):
            ns["_build_cuda_requested"]()
    else:
        assert ns["_build_cuda_requested"]() is want
    monkeypatch.delenv("KVKERNELS_BUILD_CUDA")
    assert ns["_build_cuda_requested"]() is False


def _setup_namespace(monkeypatch) -> dict:
    """setup.py's namespace with setuptools.setup() a no-op (it runs at import)."""
    import runpy

    import setuptools

    monkeypatch.setattr(setuptools, "setup", lambda **kw: None)
    return runpy.run_path(os.path.join(ROOT, "setup.py"))


class _StandInBuild:
    """csrc/build.py as setup.py uses it, without nvcc."""

    def __init__(self, cutlass):
        self.cutlass, self.built = cutlass, []

    def nvcc(self):
        return "/stand-in/nvcc"

    def cutlass_include(self):
        return self.cutlass

    def build(self, out_dir, verbose=False):
        self.built.append(out_dir)


@pytest.mark.parametrize("editable, cutlass, require", [(True, None, ""), (False, None, ""), (False, None, "1"),
                                                        (False, "/inc", "1")])
def test_setup_builds_cuda_only_where_it_lands_and_says_what_it_left_out(monkeypatch, capsys, tmp_path, editable,
                                                                       cutlass, require):
    """An editable install compiled the library (~20 s) into a temporary folder and threw it away;
    under pip's build isolation no CUTLASS headers are found and the library shipped without the
    SM90 bulk path, silently (and it is loaded before any just-in-time build)."""
    from setuptools.command.build_py import build_py

    ns = _setup_namespace(monkeypatch)
    stand_in = _StandInBuild(cutlass)
    monkeypatch.setattr(build_py, "run", lambda self: None)  # (the Python files' copy)
    # setup.py loads csrc/build.py by path: the stand-in instead (no nvcc run, no 20 s build)
    spec = type("Spec", (), {"loader": type("Loader", (), {"exec_module": staticmethod(lambda mod: None)})()})()
    monkeypatch.setattr(importlib.util, "spec_from_file_location", lambda *a, **k: spec)
    monkeypatch.setattr(importlib.util, "module_from_spec", lambda s: stand_in)
    monkeypatch.setenv("KVKERNELS_BUILD_CUDA", "1")
    monkeypatch.setenv("KVKERNELS_REQUIRE_CUTLASS", require)
    cmd = ns["BuildPyWithCuda"].__new__(ns["BuildPyWithCuda"])
    cmd.editable_mode, cmd.build_lib = editable, str(tmp_path)
    if require == "1" and cutlass is None:
        with pytest.raises(RuntimeError, match="no CUTLASS headers.*KVKERNELS_REQUIRE_CUTLASS=1"):
            cmd.run()
        assert stand_in.built == []
        return
    cmd.run()
    err = capsys.readouterr().err
    if editable:
        assert stand_in.built == [] and "does nothing for an editable install" in err
    else:
        assert stand_in.built == [os.path.join(str(tmp_path), "kvkernels", "_lib")]
        assert ("WARNING" in err and "without the SM90 bulk path" in err) == (cutlass is None)


def test_a_wheel_with_the_compiled_library_is_not_tagged_pure(monkeypatch):
    ns = _setup_namespace(monkeypatch)
    monkeypatch.setenv("KVKERNELS_BUILD_CUDA", "1")
    assert ns["CudaAwareDistribution"]().has_ext_modules() is True
    monkeypatch.setenv("KVKERNELS_BUILD_CUDA", "0")
    assert ns["CudaAwareDistribution"]().has_ext_modules() is False


@needs_nvcc
def test_bench_memcpy_baselines_compile(tmp_path):
    # the per-chunk cudaMemcpyAsync and cudaMemcpyBatchAsync baselines are built on the GPU machine
    # (torch.utils.cpp_extension); a compile error there costs device time, so compile them here
    # against this machine's CUDA headers (host code only, nothing is run), in C++20 as
    # cpp_extension builds it (torch 2.15's headers no longer compile as C++17)
    import sysconfig

    from torch.utils import cpp_extension

    inc = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    cmd = [build.nvcc(), "-std=c++20", "-Xcompiler", "-fsyntax-only", "-c", os.path.join(ROOT, "bench", "_memcpy_loop.cpp"),
           *inc, "-DTORCH_EXTENSION_NAME=kvk_bench_memcpy", "-o", str(tmp_path / "x.o")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


# sm_80 only: ptxas spills 20 B (48 B loads, 16 B stack) in the per-block FP8 gather's scalar
# instances (one per dtype: unaligned caches with granularity="block", a rare path), at 48 registers;
# A100 speed only, never measured (docs/csrc.md). Any other spill, on any arch, fails the test.
_SM80_KNOWN_SPILLS = {f"_ZN3kvk19quant_gather_kernelILi{k}ELb1ELb0ELi2ELi0EEEvNS_15QuantCopyParamsE" for k in range(3)}


@needs_nvcc
@pytest.mark.parametrize("arch", ["80", "90a"])
def test_no_register_spills_on_the_other_archs(tmp_path, arch):
    cmd = build.command(str(tmp_path / "x.so"), archs=(arch,), extra=("--resource-usage",))
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    spills = {name: (int(st), int(ld)) for name, st, ld in re.findall(
        r"Function properties for (\w+)\s+\d+ bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", out)}
    assert len(spills) == len(re.findall(r"Compiling entry function", out)) > 40
    spilling = {k for k, v in spills.items() if v != (0, 0)}
    allowed = _SM80_KNOWN_SPILLS if arch == "80" else set()
    assert spilling <= allowed, sorted(spilling - allowed)
    assert all(sum(spills[k]) <= 128 for k in spilling), {k: spills[k] for k in spilling}


@needs_nvcc
def test_resource_usage_report(tmp_path, capsys):
    cmd = build.command(str(tmp_path / "x.so"), archs=("90",), extra=("--resource-usage",))
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    # ptxas: "Compiling entry function '<name>'" ... "Used N registers", per kernel
    per = dict(re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", out, re.S))
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", out)]
    assert len(per) == len(regs)
    # paged copy: 5 word widths x gather/scatter; fp8 gather: 3 dtypes x 2 granularities x vec/scalar,
    # plus the per-token 16-byte instance for rows of 65-96 vectors (3 dtypes) and the per-token
    # instances with the row length fixed at compile time (16, 32, 72 vectors; 3 dtypes); fp8
    # scatter: 3 dtypes x vec/scalar; shuffle: gather/scatter x vec/scalar; bulk copy (with the
    # CUTLASS headers): 3 stage counts x gather/scatter
    assert len(regs) == 10 + 12 + 3 + 9 + 6 + 4 + (6 if build.cutlass_include() else 0)
    # the 3-vector instances (kRV = 3: the run-time one and the 72-vector one), per dtype
    long_rows = {k: int(v) for k, v in per.items()
                 if "quant_gather_kernel" in k and re.search(r"Li3ELi\d+EEEvNS_15QuantCopyParamsE$", k)}
    assert len(long_rows) == 6
    # a copy kernel has no business spilling or limiting occupancy: <= 64 registers (8 warps of 256
    # threads, 4 CTAs per SM); the long-row instance holds 3 vectors per lane: <= 80 (3 CTAs per SM)
    assert max(int(v) for k, v in per.items() if k not in long_rows) <= 64
    assert max(long_rows.values()) <= 80
    assert "spill stores" in r.stdout + r.stderr and not re.search(r"[1-9]\d* bytes spill", r.stdout + r.stderr)
    with capsys.disabled():
        print(f"\ncsrc sm_90 registers per kernel: {regs}")


@needs_nvcc
def test_cutlass_headers_found_where_required():
    # CI installs nvidia-cutlass (README test command) and sets KVKERNELS_REQUIRE_CUTLASS=1, so the bulk
    # path is compiled and checked there instead of silently left out
    if os.environ.get("KVKERNELS_REQUIRE_CUTLASS") == "1":
        assert build.cutlass_include() is not None, "pip install --no-deps nvidia-cutlass"
    elif build.cutlass_include() is None:
        pytest.skip("CUTLASS headers not installed: the bulk path is not built")


@needs_nvcc
@needs_nvcc
@pytest.mark.skipif(build.cutlass_include() is None, reason="CUTLASS headers not installed")
def test_cutlass_subset_is_what_the_build_reads_and_its_check_sees_a_missing_header(tmp_path, monkeypatch, capsys):
    # .ci/fetch_wheels.sh carries these headers to the GPU machine instead of the 6.4 MB wheel; the
    # cut proves itself by building every target against them, and .ci/gpu-env.sh's check must
    # fail when a later source includes a header the cut does not hold
    monkeypatch.delenv("KVKERNELS_CUTLASS_INCLUDE", raising=False)
    src, sub = build.cutlass_include(), str(tmp_path / "sub")
    files = build.cutlass_subset(src, sub)
    assert "cute/arch/copy_sm90_tma.hpp" in files and "cutlass/arch/barrier.h" in files and "cutlass/version.h" in files
    on_disk = sorted(os.path.relpath(os.path.join(d, f), sub) for d, _, fs in os.walk(sub) for f in fs)
    assert on_disk == sorted(files + [build.SUBSET_MANIFEST])  # no build left behind
    for rel in files:
        with open(os.path.join(src, rel), "rb") as a, open(os.path.join(sub, rel), "rb") as b:
            assert a.read() == b.read()
    manifest = open(os.path.join(sub, build.SUBSET_MANIFEST)).read()
    assert f"sources: {build.source_key()}" in manifest and f"files: {len(files)}" in manifest
    read = build.cutlass_headers(src)  # version.h is copied for the toolchain key, not read by the build
    assert build.cutlass_headers(sub) == read and set(files) == set(read) | {"cutlass/version.h"}
    assert len(files) < 200  # a cut, not the 26 MB folder
    assert build.main(["--check-cutlass", sub]) == 0
    with pytest.raises(RuntimeError, match="exists"):
        build.cutlass_subset(src, sub)
    os.unlink(os.path.join(sub, "cutlass", "arch", "barrier.h"))
    with pytest.raises(RuntimeError, match="barrier.h"):
        build.cutlass_headers(sub)
    assert build.main(["--check-cutlass", sub]) == 1 and "No such file" in capsys.readouterr().err
    assert build.main(["--cutlass-subset", src]) == 2 and "usage" in capsys.readouterr().err
    assert "KVKERNELS_CUTLASS_INCLUDE" not in os.environ  # the cut's own build set it back


@pytest.mark.skipif(build.cutlass_include() is None, reason="CUTLASS headers not installed")
def test_bulk_kernels_are_sm90_bulk_copies(tmp_path):
    # the sm_90 code of every bulk kernel loads with cp.async.bulk completing on an mbarrier, waits
    # on it, stores in bulk groups, and has no per-thread global load of the data (the only global
    # loads are the pointer table and the ids); the sm_80 code of the same kernels is empty
    def ptx(arch):
        out = str(tmp_path / f"capi_{arch}.ptx")
        cmd = [build.nvcc(), "-std=c++17", "-O3", "-ptx", f"-arch=compute_{arch}", "-isystem",
               build.cutlass_include(), "-DKVK_HAVE_CUTE=1", build.SOURCES[0], "-o", out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        with open(out) as f:
            text = f.read()
        # one section per function: from its `// .globl` line to the next one
        return {m.group(1): sec for sec in text.split("// .globl")[1:]
                if (m := re.search(r"\.entry (_ZN3kvk16bulk_copy_kernel\w+)\(", sec))}

    sm90, sm80 = ptx("90"), ptx("80")
    assert len(sm90) == 6 and sorted(sm90) == sorted(sm80)
    for name, body in sm90.items():
        assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in body, name
        assert "mbarrier.arrive.expect_tx" in body and "mbarrier.try_wait.parity" in body, name
        assert "cp.async.bulk.global.shared::cta.bulk_group" in body and "cp.async.bulk.commit_group" in body, name
        assert "cp.async.bulk.wait_group.read" in body and re.search(r"cp\.async\.bulk\.wait_group\s+0", body), name
        assert not re.search(r"ld\.global\.v", body), name  # no vector loads: the data never enters registers
    for name, body in sm80.items():
        assert "cp.async" not in body and "ld.global" not in body, name


# ----------------------------------------------------------- fp8.cuh on the host, against torch
HOST_SRC = os.path.join(ROOT, "csrc", "tests", "fp8_host.cu")


@pytest.fixture(scope="module")
def fp8_host(tmp_path_factory):
    """csrc/tests/fp8_host.cu built host-only (nvcc, same warning flags as the library)."""
    out = str(tmp_path_factory.mktemp("fp8host") / "libkvk_fp8_host.so")
    cmd = [build.nvcc(), "-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-Wall,-Wextra,-Werror",
           "-Werror", "all-warnings", HOST_SRC, "-o", out]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    lib = ctypes.CDLL(out)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kvk_host_e4m3_encode.argtypes = [p, p, i64]
    lib.kvk_host_e4m3_decode.argtypes = [p, p, i64]
    lib.kvk_host_f32_to_16.argtypes = [p, p, i64, ctypes.c_int]
    lib.kvk_host_quantize_rows.argtypes = [p, ctypes.c_int, i64, i64, p, p]
    lib.kvk_host_quantize_rows.restype = ctypes.c_int
    lib.kvk_host_dequantize_rows.argtypes = [p, p, ctypes.c_int, i64, i64, p]
    return lib


def _f32(bits) -> torch.Tensor:
    return torch.as_tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _encoder_inputs() -> torch.Tensor:
    """Every bf16 and fp16 value, every e4m3 rounding boundary (midpoints and their fp32
    neighbours) in [-480, 480], the saturation range, ~1M random fp32, signed zeros, subnormals,
    inf and NaNs (several payloads, both signs)."""
    g = torch.Generator().manual_seed(0)
    parts = [
        (torch.arange(65536, dtype=torch.int32) << 16).view(torch.float32),  # every bf16
        torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float(),  # every fp16
    ]
    grid = torch.arange(0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    grid = torch.cat([grid, torch.tensor([480.0])])  # 448 .. 480: saturation midpoint 464
    mids = (grid[:-1] + grid[1:]) / 2  # exact in fp32 (e4m3 has 3 mantissa bits)
    pts = torch.cat([grid, mids])
    b = pts.view(torch.int32)
    near = torch.cat([b, b + 1, b - 1, b + 2, b - 2]).clamp_min(0).view(torch.float32)
    parts += [near, -near]
    parts.append(_f32(torch.randint(0, 2**32, (1 << 20,), generator=g)))  # random bit patterns
    parts.append((torch.rand(1 << 18, generator=g) * 960 - 480))  # uniform in [-480, 480]
    mag = torch.exp2(torch.randint(-20, 10, (1 << 18,), generator=g).float())
    parts.append(torch.randn(1 << 18, generator=g) * mag)  # normals over many binades
    sub = torch.randint(1, 0x800000, (4096,), generator=g)  # fp32 subnormals
    parts += [_f32(sub), -_f32(sub)]
    special = [0.0, -0.0, float("inf"), -float("inf"), 448.0, -448.0, 449.0, 1e30, -1e30, 2.0**-149, -(2.0**-149),
               2.0**-126, 2.0**-6, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-10 + 2.0**-30]
    parts.append(torch.tensor(special))
    nans = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000])
    parts.append(_f32(nans))
    return torch.cat([x.float().reshape(-1) for x in parts]).contiguous()


@needs_nvcc
def test_fp8_host_encoder_matches_torch_cast(fp8_host):
    x = _encoder_inputs()
    got = torch.empty(x.numel(), dtype=torch.uint8)
    fp8_host.kvk_host_e4m3_encode(x.data_ptr(), got.data_ptr(), x.numel())
    nan = torch.isnan(x)
    exp = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (got != exp) & ~nan
    assert int(bad.sum()) == 0, [(hex(int(v)), int(a), int(b)) for v, a, b in
                                  zip(x.view(torch.int32)[bad][:8], got[bad][:8], exp[bad][:8])]
    assert bool((got[nan] == 0x7F).all())  # docs/quant.md: every NaN -> 0x7F
    assert torch.equal(got, fp8_codes(x))  # the Python/Triton integer encoder, NaN included
    assert x.numel() > 1_700_000 and int(nan.sum()) > 1000  # the sample is what it claims


@needs_nvcc
def test_fp8_host_decoder_and_16_bit_roundings_match_torch(fp8_host):
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    dec = torch.empty(256, dtype=torch.float32)
    fp8_host.kvk_host_e4m3_decode(q.data_ptr(), dec.data_ptr(), 256)
    ok = (q & 0x7F) != 0x7F
    assert torch.equal(dec[ok].view(torch.int32), q[ok].view(torch.float8_e4m3fn).float().view(torch.int32))
    g = torch.Generator().manual_seed(1)
    for kind, dt in ((0, torch.bfloat16), (1, torch.float16)):
        every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dt).float()
        fin = every[torch.isfinite(every)].sort().values.unique()
        mids = (fin[:-1].double() + fin[1:].double()) / 2  # ties: exact in fp32
        mids = mids.float()
        mb = mids.view(torch.int32)
        x = torch.cat([every, mids, (mb + 1).view(torch.float32), (mb - 1).view(torch.float32),
                       _f32(torch.randint(0, 2**32, (1 << 20,), generator=g)),
                       torch.tensor([65504.0, 65519.99, 65520.0, 65536.0, 1e-8, 2.0**-25, 2.0**-24, 3 * 2.0**-26])])
        x = x[~torch.isnan(x)].contiguous()
        got = torch.empty(x.numel(), dtype=torch.int16)
        fp8_host.kvk_host_f32_to_16(x.data_ptr(), got.data_ptr(), x.numel(), kind)
        exp = x.to(dt).view(torch.int16)
        bad = got != exp
        assert int(bad.sum()) == 0, (dt, x[bad][:8].tolist(), got[bad][:8].tolist(), exp[bad][:8].tolist())


def _random_rows(dt, rows, d, seed):
    """Random-byte rows (every NaN / inf / huge / subnormal class) plus crafted rows: zeros, -0.0,
    all non-finite, tiny (subnormal scales), one huge outlier."""
    x = torch.empty(rows, d, dtype=dt)
    random_fill_(x, torch.Generator().manual_seed(seed))
    x[0] = 0.0
    x[1] = -0.0
    x[2] = float("nan")
    x[3, ::2], x[3, 1::2] = float("inf"), -float("inf")
    ity = torch.int32 if dt == torch.float32 else torch.int16
    x[4] = torch.arange(d).to(ity).view(dt)  # smallest subnormals of the dtype
    x[5] = torch.linspace(-1, 1, d).to(dt)
    x[5, 7] = torch.finfo(dt).max
    return x


@needs_nvcc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fp8_host_row_quantize_dequantize_match_reference(fp8_host, dtype):
    """amax (finite values) / 448, zero rule, codes, and code * scale rounded into the dtype."""
    kind = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}[dtype]
    rows, d = 4096, 64
    x = _random_rows(dtype, rows, d, seed=kind)
    q = torch.empty(rows, d, dtype=torch.uint8)
    s = torch.empty(rows, dtype=torch.float32)
    assert fp8_host.kvk_host_quantize_rows(x.data_ptr(), kind, rows, d, q.data_ptr(), s.data_ptr()) == 0
    eq, es = quantize_rows(x.view(rows, 1, 1, d))
    assert torch.equal(s.view(torch.int32), es.reshape(-1).view(torch.int32))
    assert torch.equal(q, eq.view(rows, d))
    assert float(s[0]) == 1.0 and float(s[2]) == 1.0  # the zero rule
    # dequantize: every code against random scales (normal, subnormal, 1.0, huge)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(rows, 1)
    sc = _f32(torch.randint(1, 0x7F800000, (rows,), generator=torch.Generator().manual_seed(9)))
    sc[:4] = torch.tensor([1.0, 2.0**-140, 1e30, 448.0 / 3])
    out = torch.empty(rows, 256, dtype=dtype)
    fp8_host.kvk_host_dequantize_rows(codes.data_ptr(), sc.data_ptr(), kind, rows, 256, out.data_ptr())
    exp = dequantize_rows(codes.view(rows, 1, 1, 256), sc.view(rows, 1, 1), dtype)
    assert bytes_equal(out, exp.view(rows, 256))


# ------------------------------------- the kernels themselves, emulated on the CPU, against torch
EMU_SRC = os.path.join(ROOT, "csrc", "tests", "kernels_host.cpp")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
EMU_LAYOUTS = ["vllm-nhd", "vllm-hnd", "flashinfer-nhd", "mla", "sglang"]
EMU_IDS = [5, -1, 2, 2, 7, 99]  # unsorted, padding, duplicate, invalid (validate=False)
EMU_DST = [1, -1, 6, 0, 3, 99]


@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory):
    """csrc/kernels/quant_copy.cuh compiled as C++ (csrc/tests/kernels_host.cpp: one std::thread
    per CUDA thread, warp shuffles through a barrier), exporting the kernel entry points of the C ABI."""
    out = str(tmp_path_factory.mktemp("emu") / "libkvk_emu.so")
    cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wall", "-Wextra", "-Werror",
           "-Wno-unknown-pragmas", "-I" + os.path.join(ROOT, "csrc", "tests", "emu"), EMU_SRC, "-o", out]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture
def emulated_cuda(emu_lib, monkeypatch):
    """``backend="cuda"`` on CPU tensors runs kvkernels/_cuda.py's launchers (argument order, vec16
    choice, gap zeroing) against the emulated kernels. Not checked here: capi.cu's precondition
    checks (test_capi_* below), device guard and stream, and everything about real GPU execution."""
    from types import SimpleNamespace

    from kvkernels import _cuda, backends

    lib = ctypes.CDLL(emu_lib)
    _cuda._declare(lib)
    monkeypatch.setattr(_cuda, "_load", lambda: (lib, emu_lib))
    # CPU tensors posing as CUDA ones (resolve refuses "cuda" for a CPU cache)
    monkeypatch.setattr(backends, "resolve", lambda backend, device: "cuda" if backend == "cuda" else "torch")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    # a CUDA build of torch has the raw-stream call _cuda._raw_stream prefers, and it fails without a GPU
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda idx: 0, raising=False)
    try:
        kvkernels.check_errors()  # start from a zero counter (a failed test may leave counts)
    except ValueError:
        pass
    return lib


def _emu_cache(layout, dtype, head_dim, seed=0):
    return make_cache(layout, num_layers=2, num_blocks=8, block_size=4, num_heads=2, head_dim=head_dim, dtype=dtype,
                      seed=seed)


def _cache_bytes(lay):
    return [v.contiguous().view(-1).view(torch.uint8) for row in lay.views for v in row]


def _emu_round_trip(lay, dst_a, dst_b, max_ctas, **mode):
    # the invalid id is counted once (in the first region's first entry), as in Triton and torch
    per_id = r"`block_ids`: 1 id\(s\)"
    ref = gather_quant(lay, EMU_IDS, backend="torch", validate=False, **mode)
    with pytest.raises(ValueError, match=r"`block_ids`: 1 id\(s\)"):
        kvkernels.check_errors()
    out = torch.full((ref.numel() + 32,), 0xAB, dtype=torch.uint8)
    got = gather_quant(lay, EMU_IDS, backend="cuda", validate=False, out=out, max_ctas=max_ctas, **mode)
    assert got is out and bool((out[ref.numel():] == 0xAB).all())
    assert torch.equal(out[: ref.numel()], ref), mode
    with pytest.raises(ValueError, match=per_id):
        kvkernels.check_errors()
    scatter_quant(ref, dst_a, EMU_DST, backend="torch", validate=False, **mode)
    with pytest.raises(ValueError, match=r"`block_ids`: 1 id\(s\)"):
        kvkernels.check_errors()
    scatter_quant(ref, dst_b, EMU_DST, backend="cuda", validate=False, max_ctas=max_ctas, **mode)
    with pytest.raises(ValueError, match=per_id):
        kvkernels.check_errors()
    assert all(torch.equal(x, y) for x, y in zip(_cache_bytes(dst_a), _cache_bytes(dst_b))), mode


@needs_gxx
@pytest.mark.parametrize("head_dim", [64, 40, 128], ids=["vec16", "scalar", "vec16-fixed"])  # 128: the compile-time
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)  # row instances
@pytest.mark.parametrize("layout", EMU_LAYOUTS)
def test_emulated_fp8_kernels_match_reference(emulated_cuda, layout, dtype, head_dim):
    lay = _emu_cache(layout, dtype, head_dim)  # random bytes: NaN, inf, huge, subnormal values
    for k, granularity in enumerate(("token", "block")):
        dst_a, dst_b = _emu_cache(layout, dtype, head_dim, seed=1), _emu_cache(layout, dtype, head_dim, seed=1)
        _emu_round_trip(lay, dst_a, dst_b, max_ctas=3 * k, quant="fp8", granularity=granularity)


@needs_gxx
@pytest.mark.parametrize("head_dim", [16, 48, 128, 256, 288, 512, 576, 768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", ["vllm-hnd", "vllm-nhd", "mla"])  # rows through (t, h); evenly spaced; one head
def test_emulated_fp8_register_rows_cover_every_group_shape(emulated_cuda, layout, dtype, head_dim):
    """The token path that holds rows in registers (quant_rows_token_vec), by 16-byte vectors per
    row (bf16: head_dim / 8, fp32: head_dim / 4): lanes per row 1-32, 1-4 row steps per warp,
    partial groups (48 bf16: 6 of 8 lanes); 2 vectors per lane (512 / 288 bf16, 256 fp32); the
    3-vector instance for rows of 65-96 vectors (576 / 768 bf16 — MLA's rows —, 288 fp32);
    and the warp-per-row fallback beyond (512 / 576 / 768 fp32). The instances with the row
    geometry fixed at compile time (16, 32 and 72 vectors: 128 / 256 / 576 bf16, 128 / 288 fp32)
    beside the run-time ones."""
    lay = _emu_cache(layout, dtype, head_dim)
    dst_a, dst_b = _emu_cache(layout, dtype, head_dim, seed=1), _emu_cache(layout, dtype, head_dim, seed=1)
    _emu_round_trip(lay, dst_a, dst_b, max_ctas=0, quant="fp8", granularity="token")


# (MLA has one head: its other head counts are no layout)
_FIXED_ROW_CASES = [(layout, bs, h) for layout in ("vllm-nhd", "vllm-hnd", "mla")
                    for bs, h in ((1, 1), (1, 3), (3, 1), (4, 2)) if layout != "mla" or h == 1]


@needs_gxx
@pytest.mark.parametrize("max_ctas", [1, 3, 0])
@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 128), (torch.float32, 128), (torch.bfloat16, 576)],
                         ids=["bfloat16-16vec", "float32-32vec", "bfloat16-72vec"])
@pytest.mark.parametrize("layout, block_size, heads", _FIXED_ROW_CASES)
def test_emulated_fp8_fixed_row_instances_on_capped_grids(emulated_cuda, layout, dtype, head_dim, block_size, heads,
                                                          max_ctas):
    """The token instances with the row length fixed at compile time take several work items per
    CTA (a group of warps each) when an item has few rows: every item exactly once on grids capped
    below the item count (the grid-stride wrap), one-token blocks (token stride reported as 0),
    one head (rows evenly spaced through the token stride) and HND (rows through (t, h))."""
    def mk(seed):
        return make_cache(layout, num_layers=2, num_blocks=8, block_size=block_size, num_heads=heads,
                          head_dim=head_dim, dtype=dtype, seed=seed)

    lay = mk(0)
    _emu_round_trip(lay, mk(1), mk(1), max_ctas=max_ctas, quant="fp8", granularity="token")


@needs_gxx
@pytest.mark.parametrize("heads", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("head_dim", [64, 40], ids=["vec16", "scalar"])
def test_emulated_fp8_per_block_shares_heads_across_warps(emulated_cuda, heads, head_dim):
    """Per-block scales with fewer heads than warps: kWarps // H warps per head, partial maxima
    through shared memory (3 and 5 heads leave warps idle; 8 heads: one warp per head)."""
    def mk(seed):
        return make_cache("vllm-hnd", num_layers=2, num_blocks=8, block_size=5, num_heads=heads, head_dim=head_dim,
                          dtype=torch.bfloat16, seed=seed)

    _emu_round_trip(mk(0), mk(1), mk(1), max_ctas=2, quant="fp8", granularity="block")


@needs_gxx
@pytest.mark.parametrize("head_dim", [64, 40], ids=["vec16", "scalar"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", EMU_LAYOUTS)
def test_emulated_shuffle_kernels_match_reference(emulated_cuda, layout, dtype, head_dim):
    lay = _emu_cache(layout, dtype, head_dim)
    dst_a, dst_b = _emu_cache(layout, dtype, head_dim, seed=1), _emu_cache(layout, dtype, head_dim, seed=1)
    _emu_round_trip(lay, dst_a, dst_b, max_ctas=2, shuffle=True)


@needs_gxx
def test_emulated_vec16_choice_and_strided_views(emulated_cuda):
    from kvkernels import _cuda

    big = torch.zeros(2, 13, 4, 2, 88, dtype=torch.bfloat16)
    random_fill_(big, torch.Generator().manual_seed(3))
    aligned = kvkernels.PagedLayout.from_vllm([big[:, 3:11, :, :, 8:72]])  # 16-byte offset: vectorized
    odd = kvkernels.PagedLayout.from_vllm([big[:, 3:11, :, :, 1:65]])  # 2-byte offset: scalar
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    assert _cuda._vec16(aligned, buf.data_ptr()) == 1 and _cuda._vec16(odd, buf.data_ptr()) == 0
    for lay in (aligned, odd):
        for mode in (dict(quant="fp8"), dict(quant="fp8", granularity="block"), dict(shuffle=True)):
            dst = [kvkernels.PagedLayout.from_vllm([big.clone()[:, 3:11, :, :, 8:72]]) for _ in range(2)]
            _emu_round_trip(lay, dst[0], dst[1], max_ctas=0, **mode)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the backend is available (test_gather runs it)")
def test_cuda_backend_reports_why_it_is_missing():
    lay = make_cache("vllm-nhd", num_layers=1, num_blocks=4, block_size=2, num_heads=1, head_dim=8)
    with pytest.raises(RuntimeError, match="'cuda' is not available: no CUDA device"):
        kvkernels.gather(lay, [1], backend="cuda")


@pytest.mark.gpu
def test_c_abi_rejects_bad_arguments():
    from kvkernels import _cuda

    lib, _ = _cuda._load()
    assert lib is not None, _cuda.reason()
    t = torch.zeros(64, dtype=torch.int64, device=DEVICE)
    rc = lib.kvk_paged_copy(1, t.data_ptr(), t.data_ptr(), 1, t.data_ptr(), t.data_ptr(), 1, 1, 2, 1, 1, 1, 16,
                            16, 16, 16, 4096, 16, 3, 0, 0, 0)  # word = 3
    assert rc != 0 and b"word" in lib.kvk_last_error()
    rc = lib.kvk_paged_copy(1, 0, t.data_ptr(), 1, t.data_ptr(), t.data_ptr(), 1, 1, 2, 1, 1, 1, 16,
                            16, 16, 16, 4096, 16, 16, 0, 0, 0)  # NULL table
    assert rc != 0 and b"ptr_tab" in lib.kvk_last_error()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["vllm-nhd", "vllm-hnd", "mla", "sglang", "vllm-packed"])
def test_cuda_matches_triton_and_reference_large(layout):
    lay = make_cache(layout, num_layers=4, num_blocks=512, block_size=16, num_heads=8, head_dim=128, device=DEVICE)
    ids = torch.randperm(512, device=DEVICE)[:300]
    a = kvkernels.gather(lay, ids, backend="cuda", max_ctas=64)
    assert torch.equal(a, kvkernels.gather(lay, ids, backend="torch"))
    assert torch.equal(a, kvkernels.gather(lay, ids, backend="triton"))


@pytest.mark.gpu
def test_compute_sanitizer_memcheck_clean(tmp_path):
    exe = shutil.which("compute-sanitizer")
    if exe is None and build.nvcc():  # not on PATH: it ships beside nvcc in the toolkit
        cand = os.path.join(os.path.dirname(os.path.realpath(build.nvcc())), "compute-sanitizer")
        exe = cand if os.path.isfile(cand) else None
    assert exe is not None, "compute-sanitizer is part of the CUDA toolkit on the GPU image"
    script = tmp_path / "run.py"
    script.write_text(
        "import torch, kvkernels\n"
        "from kvkernels.models import make_cache\n"
        "import os\n"
        "for name in ('vllm-nhd', 'mla', 'vllm-packed'):\n"
        "    lay = make_cache(name, num_layers=2, num_blocks=64, block_size=16, num_heads=4, head_dim=128, device='cuda')\n"
        "    ids = torch.tensor([5, -1, 63, 0], device='cuda')\n"
        "    for b, bulk in (('cuda', '0'), ('cuda', '1'), ('triton', '0')):\n"
        "        os.environ['KVKERNELS_CUDA_BULK'] = bulk  # the SM90 bulk path for the contiguous layouts\n"
        "        s = kvkernels.gather(lay, ids, backend=b)\n"
        "        kvkernels.scatter(s, lay, torch.tensor([1, -1, 2, 3], device='cuda'), backend=b)\n"
        "torch.cuda.synchronize()\n"
    )
    import sys

    r = subprocess.run([exe, "--tool", "memcheck", "--error-exitcode", "9", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


# ------------------------------------------------------- SM90 bulk copy on a GPU (not run yet)
def _bulk_or_skip():
    from kvkernels import _cuda

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cp.async.bulk needs compute capability 9.0")
    if not _cuda.bulk_supported():
        pytest.skip("the CUDA backend was built without the CUTLASS headers (pip install --no-deps nvidia-cutlass)")
    return _cuda


@pytest.mark.gpu
@pytest.mark.parametrize("max_ctas", [0, 1, 7])
@pytest.mark.parametrize("shape", [("vllm-nhd", 8, 128), ("flashinfer-nhd", 8, 128), ("sglang", 8, 128),
                                   ("cross-layer", 8, 128), ("mla", 1, 576), ("vllm-hnd", 1, 128),
                                   ("vllm-nhd", 8, 256)],
                         ids=["vllm-nhd", "flashinfer-nhd", "sglang", "cross-layer", "mla", "hnd-1head", "64K-chunk"])
def test_cuda_bulk_copy_matches_reference(monkeypatch, shape, max_ctas):
    _cuda = _bulk_or_skip()
    calls = []
    lib = _cuda._load()[0]
    real = lib.kvk_bulk_copy
    monkeypatch.setattr(lib, "kvk_bulk_copy", lambda *a: (calls.append(1), real(*a))[1], raising=False)
    monkeypatch.setenv("KVKERNELS_CUDA_BULK", "1")
    name, h, d = shape
    mk = lambda seed: make_cache(name, num_layers=3, num_blocks=256, block_size=16, num_heads=h,
                                 head_dim=d, device=DEVICE, seed=seed)
    lay = mk(0)
    ids = torch.cat([torch.randperm(256, device=DEVICE)[:150], torch.tensor([-1, 7, 7, 300], device=DEVICE)])
    ref = kvkernels.gather(lay, ids, backend="torch", validate=False)
    with pytest.raises(ValueError, match=r"1 id\(s\)"):
        kvkernels.check_errors()
    got = kvkernels.gather(lay, ids, backend="cuda", validate=False, max_ctas=max_ctas)
    assert torch.equal(got, ref)
    with pytest.raises(ValueError, match=r"1 id\(s\)"):
        kvkernels.check_errors()
    dst = torch.randperm(256, device=DEVICE)[: ids.numel()]  # distinct: duplicate destinations have no defined winner
    dst[150] = -1
    a, b = mk(1), mk(1)
    kvkernels.scatter(ref, a, dst, backend="torch")
    kvkernels.scatter(ref, b, dst, backend="cuda", max_ctas=max_ctas)
    assert all(torch.equal(x, y) for x, y in zip(_cache_bytes(a), _cache_bytes(b)))
    assert len(calls) == 2  # both went through the bulk path


@pytest.mark.gpu
def test_cuda_bulk_copy_rejects_what_it_cannot_do(monkeypatch):
    _cuda = _bulk_or_skip()
    lib = _cuda._load()[0]
    # real buffers: the accepted call launches (a 16 KiB chunk of block 0 of both entries: 32
    # tokens x 2 heads = 64 rows of 256 bytes)
    src = torch.arange(1 << 14, device=DEVICE).to(torch.uint8)
    tab = torch.full((2,), src.data_ptr(), dtype=torch.int64, device=DEVICE)
    bids = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    err = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    stg = torch.zeros(1 << 15, dtype=torch.uint8, device=DEVICE)
    args = lambda staging, sn, sh: (1, tab.data_ptr(), bids.data_ptr(), 1, staging, err.data_ptr(), 1, 1, 2, 1, 2,
                                    64, 256, 1 << 14, sn, sh, 1 << 15, 1 << 14, 0, 0, 0)
    host = torch.zeros(1 << 15, dtype=torch.uint8, pin_memory=True)
    assert lib.kvk_bulk_copy(*args(stg.data_ptr(), 512, 256)) == 0  # contiguous NHD chunk, device staging
    torch.cuda.synchronize()
    assert torch.equal(stg[: 1 << 14], src) and torch.equal(stg[1 << 14:], src)  # K and V entries
    assert lib.kvk_bulk_copy(*args(stg.data_ptr(), 256, 4096)) != 0 and b"contiguous" in lib.kvk_last_error()
    assert lib.kvk_bulk_copy(*args(host.data_ptr(), 512, 256)) != 0 and b"device memory" in lib.kvk_last_error()
    assert lib.kvk_bulk_copy(*args(stg.data_ptr() + 8, 512, 256)) != 0 and b"multiples of 16" in lib.kvk_last_error()
    # pinned host staging through the Python launcher falls back to the 16-byte paged copy
    monkeypatch.setenv("KVKERNELS_CUDA_BULK", "1")
    lay = make_cache("vllm-nhd", num_layers=2, num_blocks=8, block_size=16, num_heads=2, head_dim=128, device=DEVICE)
    out = torch.zeros(kvkernels.gather(lay, [1, 2], backend="torch").numel(), dtype=torch.uint8, pin_memory=True)
    assert not _cuda._staging_on_device(lay, out)
    kvkernels.gather(lay, [1, 2], backend="cuda", out=out)
    torch.cuda.synchronize()
    assert torch.equal(out, kvkernels.gather(lay, [1, 2], backend="torch").cpu())


# ------------------------------------------------------- fp8 / shuffle kernels on a GPU (not run yet)
GPU_LAYOUTS = ["vllm-nhd", "vllm-hnd", "flashinfer-nhd", "mla", "sglang", "vllm-packed"]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 576, 40])
@pytest.mark.parametrize("granularity", ["token", "block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
def test_cuda_fp8_matches_triton_and_reference(layout, dtype, granularity, head_dim):
    lay = make_cache(layout, num_layers=3, num_blocks=64, block_size=16, num_heads=4, head_dim=head_dim, dtype=dtype,
                     device=DEVICE)  # random bytes: NaN, inf, huge, subnormal values
    ids = torch.tensor([5, -1, 63, 0, 7, 7, 12], device=DEVICE)
    kw = dict(quant="fp8", granularity=granularity)
    ref = gather_quant(lay, ids, backend="torch", **kw)
    got = gather_quant(lay, ids, backend="cuda", max_ctas=5, **kw)
    assert torch.equal(got, ref)
    assert torch.equal(got, gather_quant(lay, ids, backend="triton", **kw))
    dst = torch.tensor([1, -1, 2, 3, 60, 61, 62], device=DEVICE)
    outs = []
    for b in ("torch", "triton", "cuda"):
        d = make_cache(layout, num_layers=3, num_blocks=64, block_size=16, num_heads=4, head_dim=head_dim,
                       dtype=dtype, device=DEVICE, seed=1)
        scatter_quant(ref, d, dst, backend=b, **kw)
        outs.append(_cache_bytes(d))
    assert all(torch.equal(x, y) for x, y in zip(outs[0], outs[2]))
    assert all(torch.equal(x, y) for x, y in zip(outs[1], outs[2]))


@pytest.mark.gpu
@pytest.mark.parametrize("max_ctas", [0, 3])
@pytest.mark.parametrize("block_size, heads", [(16, 1), (4, 1), (1, 2), (4, 2)])
@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 128), (torch.float32, 128), (torch.bfloat16, 576)],
                         ids=["bfloat16-16vec", "float32-32vec", "bfloat16-72vec"])
@pytest.mark.parametrize("layout", ["vllm-nhd", "vllm-hnd"])
def test_cuda_fp8_fixed_rows_with_several_items_per_cta(layout, dtype, head_dim, block_size, heads, max_ctas):
    """Short chunks (a 4 KB llama3-70b TP8 chunk: 16 rows of 16 vectors) put several work items on
    one CTA, a group of warps each, in the compile-time row instances: bit-exact against torch
    and Triton on full and capped grids."""
    lay = make_cache(layout, num_layers=2, num_blocks=64, block_size=block_size, num_heads=heads, head_dim=head_dim,
                     dtype=dtype, device=DEVICE)
    ids = torch.tensor([5, -1, 63, 0, 7, 7, 12, 40, 41, 42, 43], device=DEVICE)
    kw = dict(quant="fp8", granularity="token")
    ref = gather_quant(lay, ids, backend="torch", **kw)
    got = gather_quant(lay, ids, backend="cuda", max_ctas=max_ctas, **kw)
    assert torch.equal(got, ref)
    assert torch.equal(got, gather_quant(lay, ids, backend="triton", **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
def test_cuda_shuffle_matches_triton_and_reference(layout, dtype, head_dim):
    lay = make_cache(layout, num_layers=3, num_blocks=64, block_size=16, num_heads=4, head_dim=head_dim, dtype=dtype,
                     device=DEVICE)
    ids = torch.tensor([5, -1, 63, 0, 7, 7, 12], device=DEVICE)
    ref = gather_quant(lay, ids, shuffle=True, backend="torch")
    got = gather_quant(lay, ids, shuffle=True, backend="cuda", max_ctas=5)
    assert torch.equal(got, ref)
    assert torch.equal(got, gather_quant(lay, ids, shuffle=True, backend="triton"))
    dst = torch.tensor([1, -1, 2, 3, 60, 61, 62], device=DEVICE)
    outs = []
    for b in ("torch", "cuda"):
        d = make_cache(layout, num_layers=3, num_blocks=64, block_size=16, num_heads=4, head_dim=head_dim,
                       dtype=dtype, device=DEVICE, seed=1)
        scatter_quant(ref, d, dst, shuffle=True, backend=b)
        outs.append(_cache_bytes(d))
    assert all(torch.equal(x, y) for x, y in zip(outs[0], outs[1]))


@pytest.mark.gpu
def test_cuda_fp8_pinned_staging_and_invalid_ids_counted():
    lay = make_cache("vllm-nhd", num_layers=2, num_blocks=16, block_size=16, num_heads=8, head_dim=128, device=DEVICE)
    ref = gather_quant(lay, [3, -1, 9], quant="fp8", backend="torch")
    pinned = torch.empty(ref.numel(), dtype=torch.uint8).pin_memory()
    gather_quant(lay, [3, 99, 9], quant="fp8", backend="cuda", out=pinned, validate=False)
    torch.cuda.synchronize()
    assert torch.equal(pinned, ref.cpu())
    with pytest.raises(ValueError, match="validate=False"):
        kvkernels.check_errors()


@pytest.mark.gpu
def test_c_abi_fp8_and_shuffle_reject_bad_arguments():
    from kvkernels import _cuda

    lib, _ = _cuda._load()
    assert lib is not None, _cuda.reason()
    t = torch.zeros(4096, dtype=torch.int64, device=DEVICE)
    p = t.data_ptr()
    # tab ids ids_64 staging err | n num_blocks C R H bs D sb sn sh | region q_e sc_base sc_e |
    # kind per_block vec16 max_ctas device stream
    ok = [p, p, 1, p, p, 1, 1, 2, 1, 1, 1, 16, 64, 32, 32, 4096, 16, 32, 16, 0, 0, 0, 0, 0, 0]
    bad_kind = list(ok)
    bad_kind[19] = 7
    assert lib.kvk_quant_gather(*bad_kind) != 0 and b"kind" in lib.kvk_last_error()
    null_tab = list(ok)
    null_tab[0] = 0
    assert lib.kvk_dequant_scatter(*null_tab) != 0 and b"ptr_tab" in lib.kvk_last_error()
    small = list(ok)
    small[16] = 0  # q_entry_bytes below the payload
    assert lib.kvk_quant_gather(*small) != 0 and b"q_entry_bytes" in lib.kvk_last_error()
    rc = lib.kvk_shuffle_copy(1, p, p, 1, p, p, 1, 1, 2, 1, 1, 1, 16, 64, 32, 32, 4096, 31, 0, 0, 0, 0)
    assert rc != 0 and b"entry_bytes" in lib.kvk_last_error()


# ------------------------------- the plain paged copy and the SM90 bulk copy, emulated on the CPU
# Layouts whose (block, entry) chunk is one contiguous run in the cache at 2 KV heads: the bulk path
# takes them, the others fall back to the 16-byte paged copy.
BULK_LAYOUTS = {"vllm-nhd", "flashinfer-nhd", "cross-layer", "sglang", "mla", "mla-cross-layer"}


@pytest.fixture
def emulated_copy(emulated_cuda, monkeypatch):
    """``emulated_cuda`` plus a record of which entry point (paged / bulk) each copy used; the bulk
    path's device checks (device staging, compute capability 9.0) pass on CPU tensors."""
    from kvkernels import _cuda

    calls = []
    lib = emulated_cuda

    class Spy:
        def __getattr__(self, name):
            fn = getattr(lib, name)
            if name in ("kvk_paged_copy", "kvk_bulk_copy"):
                return lambda *a: (calls.append(name), fn(*a))[1]
            return fn

    spy = Spy()
    monkeypatch.setattr(_cuda, "_load", lambda: (spy, "emulated"))
    monkeypatch.setattr(_cuda, "_staging_on_device", lambda layout, staging: True)
    return calls


def _copy_round_trip(lay, dst_a, dst_b, max_ctas):
    per_id = r"`block_ids`: 1 id\(s\)"
    ref = kvkernels.gather(lay, EMU_IDS, backend="torch", validate=False)
    with pytest.raises(ValueError, match=per_id):
        kvkernels.check_errors()
    out = torch.full((ref.numel() + 48,), 0xAB, dtype=torch.uint8)
    got = kvkernels.gather(lay, EMU_IDS, backend="cuda", validate=False, out=out, max_ctas=max_ctas)
    assert got is out and bool((out[ref.numel():] == 0xAB).all())
    assert torch.equal(out[: ref.numel()], ref)
    with pytest.raises(ValueError, match=per_id):
        kvkernels.check_errors()
    kvkernels.scatter(ref, dst_a, EMU_DST, backend="torch", validate=False)
    with pytest.raises(ValueError, match=per_id):
        kvkernels.check_errors()
    kvkernels.scatter(ref, dst_b, EMU_DST, backend="cuda", validate=False, max_ctas=max_ctas)
    with pytest.raises(ValueError, match=per_id):
        kvkernels.check_errors()
    assert all(torch.equal(x, y) for x, y in zip(_cache_bytes(dst_a), _cache_bytes(dst_b)))


@needs_gxx
@pytest.mark.parametrize("bulk", [False, True], ids=["paged", "bulk"])
@pytest.mark.parametrize("head_dim", [64, 36], ids=["hd64", "hd36"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("layout", sorted(kvkernels.models.LAYOUTS))
def test_emulated_copy_kernels_match_reference(emulated_copy, monkeypatch, layout, dtype, head_dim, bulk):
    from kvkernels import _cuda

    monkeypatch.setenv("KVKERNELS_CUDA_BULK", "1" if bulk else "0")
    lay = _emu_cache(layout, dtype, head_dim)
    dst = [_emu_cache(layout, dtype, head_dim, seed=1) for _ in range(2)]
    _copy_round_trip(lay, dst[0], dst[1], max_ctas=1 if bulk else 0)  # 1 CTA: the stage ring wraps
    word16 = lay.access_width(0) == 16
    expect = "kvk_bulk_copy" if bulk and layout in BULK_LAYOUTS and word16 else "kvk_paged_copy"
    assert emulated_copy == [expect] * 2


@needs_gxx
@pytest.mark.parametrize("max_ctas", [0, 1, 2, 5])
@pytest.mark.parametrize("shape", [("vllm-nhd", 16, 2, 288, 4), ("vllm-hnd", 1, 1, 64, 2), ("vllm-hnd", 8, 1, 128, 2)],
                         ids=["36K-3pieces", "bs1", "one-head-hnd"])
def test_emulated_bulk_copy_pieces_and_grids(emulated_copy, monkeypatch, shape, max_ctas):
    # chunks over the 16 KB piece (36 KiB: three 12 KiB pieces, 4 stages), one token per block,
    # and HND with one KV head (llama3-70b at TP8: contiguous, so the bulk path takes it)
    monkeypatch.setenv("KVKERNELS_CUDA_BULK", "1")
    name, bs, h, d, e = shape
    dtype = {4: torch.float32, 2: torch.bfloat16}[e]
    mk = lambda seed: make_cache(name, num_layers=3, num_blocks=8, block_size=bs, num_heads=h,
                                 head_dim=d, dtype=dtype, seed=seed)
    lay, dst = mk(0), [mk(1), mk(1)]
    _copy_round_trip(lay, dst[0], dst[1], max_ctas=max_ctas)
    assert emulated_copy == ["kvk_bulk_copy"] * 2


@needs_gxx
def test_emulated_bulk_copy_default_off_and_layer_subsets(emulated_copy, monkeypatch):
    lay = _emu_cache("vllm-nhd", torch.bfloat16, 64)
    monkeypatch.delenv("KVKERNELS_CUDA_BULK", raising=False)
    kvkernels.gather(lay, [1, 2], backend="cuda")
    assert emulated_copy == ["kvk_paged_copy"]  # off unless asked for (not yet measured on a GPU)
    monkeypatch.setenv("KVKERNELS_CUDA_BULK", "1")
    ref = kvkernels.gather(lay, [3, 0, 3], layers=[1], backend="torch")
    assert torch.equal(kvkernels.gather(lay, [3, 0, 3], layers=[1], backend="cuda"), ref)
    assert emulated_copy[-1] == "kvk_bulk_copy"


# ---------------------------------- capi.cu's precondition checks, on the real library, without a GPU
# Every entry point checks its arguments before its first CUDA call, so the library built here
# (it loads: libcudart is part of the toolkit) answers them on a machine with no device. With
# valid arguments the first thing to fail is the device query, which proves the checks passed.
@pytest.fixture(scope="module")
def capi(tmp_path_factory):
    from kvkernels import _cuda

    path = build.build(str(tmp_path_factory.mktemp("capi")))
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        pytest.skip(f"the built library does not load here: {exc}")
    _cuda._declare(lib)
    return lib


#            to_st ptr_tab block_ids ids64 staging  err    n  nb  C  R  H  rows row   sb    sn   sh   region entry
_COPY_OK = [1, 4096, 8192, 1, 1 << 20, 12288, 2, 8, 2, 1, 2, 32, 256, 8192, 512, 256, 32768, 16384]
_COPY_IDX = {name: i for i, name in enumerate(["to_staging", "ptr_tab", "block_ids", "ids_64", "staging", "err", "n",
                                               "num_blocks", "C", "num_regions", "H", "rows", "row_bytes",
                                               "stride_b", "stride_n", "stride_h", "region_bytes", "entry_bytes"])}
_COMMON_BAD = [({"ptr_tab": 0}, "ptr_tab"), ({"block_ids": 0}, "block_ids"), ({"staging": 0}, "staging"),
               ({"err": 0}, "err"), ({"n": 0}, "n, num_regions"), ({"C": 3}, "C: expected 1 or 2"),
               ({"rows": 33}, "rows: expected a positive multiple of H"), ({"row_bytes": 0}, "row_bytes"),
               ({"entry_bytes": 8192}, "smaller than the payload")]


def _copy_args(**changes):
    args = list(_COPY_OK)
    for k, v in changes.items():
        args[_COPY_IDX[k]] = v
    return args


def _last_error(lib) -> str:
    return lib.kvk_last_error().decode()


@needs_nvcc
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less answers (on a GPU the device query passes)")
@pytest.mark.parametrize("changes, match", _COMMON_BAD + [({"staging": (1 << 20) + 8}, "does not divide"),
                                                          ({"stride_n": 520}, "does not divide")])
def test_capi_paged_copy_rejects_each_bad_argument(capi, changes, match):
    assert capi.kvk_paged_copy(*_copy_args(), 16, 0, 0, 0) != 0
    assert _last_error(capi).startswith("cudaGetDevice")  # valid arguments reach the device query
    assert capi.kvk_paged_copy(*_copy_args(**changes), 16, 0, 0, 0) != 0
    assert match in _last_error(capi)
    assert capi.kvk_paged_copy(*_copy_args(), 3, 0, 0, 0) != 0 and "word: expected" in _last_error(capi)
    assert capi.kvk_paged_copy(*_copy_args(), 16, -1, 0, 0) != 0 and "max_ctas" in _last_error(capi)


@needs_nvcc
@pytest.mark.skipif(build.cutlass_include() is None, reason="CUTLASS headers not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less answers (on a GPU the device query passes)")
@pytest.mark.parametrize("changes, match", _COMMON_BAD + [
    ({"staging": (1 << 20) + 8}, "multiples of 16"), ({"row_bytes": 248, "stride_h": 248}, "multiples of 16"),
    ({"stride_h": 4096}, "not contiguous"), ({"stride_n": 1024}, "not contiguous")])
def test_capi_bulk_copy_rejects_each_bad_argument(capi, changes, match):
    assert capi.kvk_features() & 1
    assert capi.kvk_bulk_copy(*_copy_args(), 0, 0, 0) != 0
    assert _last_error(capi).startswith("cudaGetDevice")  # valid arguments reach the device query
    assert capi.kvk_bulk_copy(*_copy_args(**changes), 0, 0, 0) != 0
    assert match in _last_error(capi)
    assert capi.kvk_bulk_copy(*_copy_args(), -1, 0, 0) != 0 and "max_ctas" in _last_error(capi)
    # one KV head or one token per block: contiguous whatever those strides say
    one_head = _copy_args(H=1, rows=16, stride_h=0, stride_n=256, stride_b=4096, entry_bytes=8192, region_bytes=16384)
    assert capi.kvk_bulk_copy(*one_head, 0, 0, 0) != 0 and _last_error(capi).startswith("cudaGetDevice")


#            ptr_tab block_ids ids64 staging err    n  nb C  R  H  bs  D    sb    sn   sh   region q_entry s_base s_entry
_FP8_OK = [4096, 8192, 1, 1 << 20, 12288, 2, 8, 2, 1, 2, 16, 128, 8192, 512, 256, 20480, 8192, 16384, 256]
_FP8_IDX = {k: i for i, k in enumerate(["ptr_tab", "block_ids", "ids_64", "staging", "err", "n", "num_blocks", "C",
                                        "num_regions", "H", "block_size", "head_dim", "stride_b", "stride_n",
                                        "stride_h", "region_bytes", "q_entry_bytes", "scale_base_bytes",
                                        "scale_entry_bytes"])}


@needs_nvcc
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less answers (on a GPU the device query passes)")
@pytest.mark.parametrize("changes, tail, match", [
    ({}, (5, 0, 1, 0), "kind: expected"),
    ({"head_dim": 0}, (0, 0, 1, 0), "H, block_size, head_dim"),
    ({"block_size": 1 << 20, "head_dim": 1 << 10}, (0, 0, 1, 0), "< 2^31 elements in one block"),
    ({"H": 1 << 31}, (0, 0, 1, 0), "< 2^31 elements in one block"),
    ({"head_dim": 1 << 62}, (0, 0, 1, 0), "< 2^31 elements in one block"),  # the product would wrap
    ({"stride_n": 513}, (0, 0, 0, 0), "multiples of the element size"),
    ({"stride_n": 520}, (0, 0, 1, 0), "vec16"),
    ({"staging": (1 << 20) + 8}, (0, 0, 0, 0), "16-byte aligned"),
    ({"q_entry_bytes": 4096}, (0, 0, 1, 0), "q_entry_bytes"),
    ({"scale_entry_bytes": 128}, (0, 0, 1, 0), "scale_entry_bytes"),
    ({"scale_base_bytes": 8192}, (0, 0, 1, 0), "scale_base_bytes"),
    ({"region_bytes": 16384}, (0, 0, 1, 0), "region_bytes: smaller"),
    ({}, (0, 0, 1, -1), "max_ctas"),
])
def test_capi_fp8_rejects_each_bad_argument(capi, changes, tail, match):
    def args(**ch):
        a = list(_FP8_OK)
        for k, v in ch.items():
            a[_FP8_IDX[k]] = v
        return a

    for fn in (capi.kvk_quant_gather, capi.kvk_dequant_scatter):
        assert fn(*args(), 0, 0, 1, 0, 0, 0) != 0 and _last_error(capi).startswith("cudaGetDevice")
        assert fn(*args(**changes), *tail, 0, 0) != 0
        assert match in _last_error(capi)


@needs_nvcc
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less answers (on a GPU the device query passes)")
def test_capi_shuffle_rejects_bad_sections(capi):
    base = [1, 4096, 8192, 1, 1 << 20, 12288, 2, 8, 2, 1, 2, 16, 128, 8192, 512, 256]
    assert capi.kvk_shuffle_copy(*base, 32768, 16384, 1, 0, 0, 0) != 0
    assert _last_error(capi).startswith("cudaGetDevice")
    assert capi.kvk_shuffle_copy(*base, 32768, 16000, 1, 0, 0, 0) != 0 and "two byte planes" in _last_error(capi)
    assert capi.kvk_shuffle_copy(*base, 16384, 16384, 1, 0, 0, 0) != 0 and "C * entry_bytes" in _last_error(capi)
    assert capi.kvk_shuffle_copy(*base, 32768, 16384, 1, -2, 0, 0) != 0 and "max_ctas" in _last_error(capi)


# ------------------------------------------------ review fixes (2026-11-23, 13th session)
@needs_nvcc
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less answers (on a GPU the device query passes)")
def test_capi_size_checks_do_not_wrap(capi):
    # n = 2^41 chunks of 2^23 bytes: the product 2^64 wraps to 0 in int64, which passed the check
    big = _copy_args(n=1 << 41, H=1, rows=1, row_bytes=1 << 23, entry_bytes=16, region_bytes=32,
                     stride_b=1 << 23, stride_n=16, stride_h=16)
    assert capi.kvk_paged_copy(*big, 16, 0, 0, 0) != 0 and "smaller than the payload" in _last_error(capi)
    assert capi.kvk_bulk_copy(*big, 0, 0, 0) != 0
    assert "smaller than the payload" in _last_error(capi) or "CUTLASS" in _last_error(capi)
    # the fp8 sections: 4 * n * scales wraps for n = 2^61 (the work-item count 2 * n does not)
    fp8 = list(_FP8_OK)
    fp8[_FP8_IDX["n"]] = 1 << 61
    assert capi.kvk_quant_gather(*fp8, 0, 0, 1, 0, 0, 0) != 0 and "smaller than" in _last_error(capi)
    # 14th review: the work-item count num_regions * C * n wrapped (2^62+1 regions x 2 x 2 = 4 items)
    # and negative strides passed the "multiple of the word" checks
    wrap = _copy_args(num_regions=(1 << 62) + 1)
    assert capi.kvk_paged_copy(*wrap, 16, 0, 0, 0) != 0 and "expected < 2^63 work items" in _last_error(capi)
    assert capi.kvk_paged_copy(*_copy_args(stride_b=-8192), 16, 0, 0, 0) != 0
    assert "expected >= 0" in _last_error(capi)
    if capi.kvk_features() & 1:
        assert capi.kvk_bulk_copy(*wrap, 0, 0, 0) != 0 and "work items" in _last_error(capi)
        assert capi.kvk_bulk_copy(*_copy_args(stride_n=-512), 0, 0, 0) != 0 and ">= 0" in _last_error(capi)
    fp8 = list(_FP8_OK)
    fp8[_FP8_IDX["num_regions"]] = (1 << 62) + 1
    assert capi.kvk_quant_gather(*fp8, 0, 0, 1, 0, 0, 0) != 0 and "work items" in _last_error(capi)
    fp8 = list(_FP8_OK)
    fp8[_FP8_IDX["stride_h"]] = -256
    assert capi.kvk_dequant_scatter(*fp8, 0, 0, 1, 0, 0, 0) != 0 and ">= 0" in _last_error(capi)
    base = [1, 4096, 8192, 1, 1 << 20, 12288, 2, 8, 2, (1 << 62) + 1, 2, 16, 128, 8192, 512, 256]
    assert capi.kvk_shuffle_copy(*base, 32768, 16384, 1, 0, 0, 0) != 0 and "work items" in _last_error(capi)


def _cudart_of(lib_path: str):
    """The libcudart the library at ``lib_path`` resolved to: its symbols looked up through the
    library's own handle (dlsym searches it and its dependencies; a process may map more than one
    libcudart, e.g. another soname from a wheel, and the first path of /proc/self/maps in sorted
    order could be the other one)."""
    return ctypes.CDLL(lib_path)


@needs_nvcc
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less answers (on a GPU the device query passes)")
def test_capi_probe_explains_why_the_runtime_cannot_run(capi):
    # (without a driver every runtime call, cudaGetLastError too, answers "insufficient driver":
    # the clearing of a stale error is checked on the GPU, test_capi_clears_a_failed_call_on_the_gpu)
    assert capi.kvk_probe() != 0 and _last_error(capi).startswith("cudaGetDeviceCount")


@pytest.mark.gpu
def test_capi_clears_a_failed_call_on_the_gpu():
    """A failed runtime call inside the library (an invalid device ordinal) is reported and cleared
    from the thread's last error: the runtime instance is shared, so torch's next launch check and
    the library's next launch (which reads cudaGetLastError) would otherwise fail on it."""
    from kvkernels import _cuda

    lib, _ = _cuda._load()
    assert lib is not None, _cuda.reason()
    assert lib.kvk_probe() == 0
    t = torch.zeros(64, dtype=torch.int64, device=DEVICE)
    rc = lib.kvk_paged_copy(1, t.data_ptr(), t.data_ptr(), 1, t.data_ptr(), t.data_ptr(), 1, 1, 2, 1, 1, 1, 16,
                            16, 16, 16, 4096, 16, 16, 0, 999, 0)  # device 999
    assert rc != 0 and b"cudaSetDevice" in lib.kvk_last_error()
    rt = _cudart_of(lib._name)
    rt.cudaGetLastError.restype = ctypes.c_int
    assert rt.cudaGetLastError() == 0
    lay = make_cache("vllm-nhd", num_layers=2, num_blocks=8, block_size=4, num_heads=2, head_dim=64, device=DEVICE)
    ref = kvkernels.gather(lay, [3, 1], backend="torch")
    assert torch.equal(kvkernels.gather(lay, [3, 1], backend="cuda"), ref)


def test_cuda_loader_reports_instead_of_raising_or_substituting(monkeypatch, tmp_path):
    from kvkernels import _cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _cuda._load.cache_clear()
    try:
        monkeypatch.setenv("KVKERNELS_CUDA_LIB", str(tmp_path / "missing.so"))
        assert not _cuda.available() and "is not a file" in _cuda.reason()  # no other library tried
        _cuda._load.cache_clear()
        libm = ctypes.util.find_library("m")
        if libm:
            import glob

            path = next(iter(glob.glob(f"/lib/x86_64-linux-gnu/{libm}") + glob.glob(f"/usr/lib*/{libm}")), None)
            if path:
                monkeypatch.setenv("KVKERNELS_CUDA_LIB", path)
                assert not _cuda.available() and "not a kvkernels CUDA library" in _cuda.reason()
                _cuda._load.cache_clear()
        if build.nvcc() is not None and DEVICE.type == "cpu":  # a real build whose runtime cannot run on this GPU-less host
            monkeypatch.setenv("KVKERNELS_CUDA_LIB", build.build(str(tmp_path / "lib")))
            assert not _cuda.available() and "cannot run here" in _cuda.reason()
    finally:
        _cuda._load.cache_clear()


def test_jit_cache_folder_follows_the_sources(tmp_path, monkeypatch):
    import shutil

    tree = tmp_path / "csrc"
    shutil.copytree(os.path.join(ROOT, "csrc"), tree, ignore=shutil.ignore_patterns("__pycache__", "tests"))

    def key():
        spec_ = importlib.util.spec_from_file_location("kvk_csrc_build_copy", tree / "build.py")
        mod = importlib.util.module_from_spec(spec_)
        spec_.loader.exec_module(mod)
        return mod.source_key()

    k0 = key()
    assert k0 == key() and k0 == build.source_key()  # the same sources, the same folder
    with open(tree / "kernels" / "paged_copy.cuh", "a") as f:
        f.write("// changed\n")
    assert key() != k0  # a changed kernel never loads an older build
    from kvkernels import _cuda

    assert _cuda._jit_dir().endswith(f"cuda-abi{_cuda.ABI_VERSION}-{build.source_key()}")
    tool = build.toolchain_key()
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "runtime-only"))
    assert build.nvcc() is None  # a CUDA_HOME without bin/nvcc is no nvcc
    # a process without nvcc looks in the same folder as the one that built (the toolchain names
    # the file in it, not the folder)
    assert build.source_key() == k0 and build.toolchain_key() != tool


def test_an_in_place_cutlass_upgrade_changes_the_toolchain_key(tmp_path, monkeypatch):
    """The just-in-time build is named after the toolchain: CUTLASS headers rewritten at the same
    path (pip install -U nvidia-cutlass) must not load the build made against the old ones."""
    inc = tmp_path / "include"
    for h in ("cute/arch/copy_sm90_tma.hpp", "cutlass/version.h"):
        (inc / h).parent.mkdir(parents=True, exist_ok=True)
        (inc / h).write_text("// v1\n")
    monkeypatch.setenv("KVKERNELS_CUTLASS_INCLUDE", str(inc))
    k1 = build.toolchain_key()
    assert build.toolchain_key() == k1 and str(inc) in k1
    (inc / "cutlass" / "version.h").write_text("// v2, a longer header\n")
    k2 = build.toolchain_key()
    assert k2 != k1
    os.utime(inc / "cute" / "arch" / "copy_sm90_tma.hpp", ns=(1, 1))  # same size, another time
    assert build.toolchain_key() != k2


def _elf_stub(path: str) -> None:
    """A whole (if useless) 64-bit ELF header with no tables: passes the loader's size check, then
    dlopen refuses it (a stand-in for a build)."""
    with open(path, "wb") as f:
        f.write(b"\x7fELF\x02\x01\x01" + bytes(57))


def _a_real_library() -> str:
    import glob

    libm = ctypes.util.find_library("m")
    path = next(iter(glob.glob(f"/lib/x86_64-linux-gnu/{libm}") + glob.glob(f"/usr/lib*/{libm}")), None) if libm else None
    if path is None:
        pytest.skip("no libm file to stand in for a library")
    return os.path.realpath(path)


def test_a_truncated_library_is_refused_before_dlopen_maps_it(tmp_path, monkeypatch):
    """A library cut short (a crash after the build's rename reached the disk before its data) was
    handed to dlopen, which maps it: the process died of SIGBUS (a cached build cut to 1-3.4 of its
    3.5 MB). Its ELF tables say how long it must be; one shorter is refused, naming what to do."""
    import shutil

    from kvkernels import _cuda

    real = _a_real_library()
    assert _cuda._incomplete(real) is None
    cut = tmp_path / "libcut.so"
    shutil.copyfile(real, cut)
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(real) // 2)
    assert "truncated" in _cuda._incomplete(str(cut))
    (tmp_path / "text.so").write_text("not a library")
    assert "not a 64-bit little-endian ELF" in _cuda._incomplete(str(tmp_path / "text.so"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("KVKERNELS_CUDA_LIB", str(cut))
    _cuda._load.cache_clear()
    try:
        assert not _cuda.available()
        assert "truncated: " in _cuda.reason() and "delete it, or rebuild" in _cuda.reason()
    finally:
        _cuda._load.cache_clear()


def test_a_truncated_jit_build_of_this_toolchain_is_built_again(tmp_path, monkeypatch):
    from kvkernels import _cuda, config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("KVKERNELS_CUDA_LIB", raising=False)
    monkeypatch.setattr(config, "cache_dir", lambda: str(tmp_path))
    mod = _cuda._build_module()
    (tmp_path / "nvcc").write_text("")  # a stand-in toolchain (never run: build is replaced below)
    monkeypatch.setattr(mod, "nvcc", lambda: str(tmp_path / "nvcc"))
    monkeypatch.setattr(mod, "_nvcc_version", lambda exe: "stand-in")
    jit = _cuda._jit_dir()
    os.makedirs(jit)
    own = os.path.join(jit, mod.jit_lib_name())
    with open(own, "wb") as f:  # cut after its header: the tables it names are missing
        f.write(open(_a_real_library(), "rb").read(4096))
    built = []

    def stand_in(out_dir, *a, lib_name=build.LIB, **k):
        built.append(lib_name)
        _elf_stub(os.path.join(out_dir, lib_name))
        return os.path.join(out_dir, lib_name)

    monkeypatch.setattr(mod, "build", stand_in)
    _cuda._load.cache_clear()
    try:
        why = _cuda.reason()
        # built anew, then that one tried (the stand-in: refused by dlopen, not by the size check)
        assert built == [os.path.basename(own)] and "cannot load" in why and "tables end" not in why
    finally:
        _cuda._load.cache_clear()


def test_a_relative_cuda_lib_path_loads_that_file(tmp_path, monkeypatch):
    """``KVKERNELS_CUDA_LIB=libx.so`` passed the isfile check in the working directory, then dlopen
    looked the name up on LD_LIBRARY_PATH instead (another library of that name loaded)."""
    import shutil

    from kvkernels import _cuda

    shutil.copyfile(_a_real_library(), tmp_path / "libx.so")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("KVKERNELS_CUDA_LIB", "libx.so")
    _cuda._load.cache_clear()
    try:
        assert not _cuda.available()
        assert _cuda.reason().startswith(f"{tmp_path / 'libx.so'}: not a kvkernels CUDA library"), _cuda.reason()
    finally:
        _cuda._load.cache_clear()


def test_the_toolchain_key_follows_the_toolkit_behind_an_nvcc_wrapper(tmp_path, monkeypatch):
    """The CPU CI machine's nvcc is a 50-byte ``exec /usr/local/cuda-13.0/bin/nvcc`` script: its
    size and time stay the same when the toolkit it calls changes, and a build of the old toolkit
    was loaded. NVCC_APPEND_FLAGS / NVCC_PREPEND_FLAGS change a build too."""
    ver = tmp_path / "version.txt"
    ver.write_text("Cuda compilation tools, release 13.0\n")
    wrapper = tmp_path / "nvcc"
    wrapper.write_text(f"#!/bin/sh\ncat {ver}\n")
    wrapper.chmod(0o755)
    monkeypatch.setattr(build, "nvcc", lambda: str(wrapper))
    for v in build.NVCC_ENV_FLAGS:
        monkeypatch.delenv(v, raising=False)
    k1 = build.toolchain_key()
    assert "release 13.0" in k1
    ver.write_text("Cuda compilation tools, release 12.4\n")
    k2 = build.toolchain_key()
    assert k2 != k1
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-DKVK_SOMETHING=1")
    assert build.toolchain_key() != k2


def test_an_installed_package_builds_from_its_own_csrc(tmp_path):
    """``site-packages/csrc/build.py`` (another project's) was looked at before
    ``site-packages/kvkernels/csrc`` and would have been run."""
    from kvkernels import _cuda

    sp = tmp_path / "site-packages"
    for d in (sp / "csrc", sp / "kvkernels" / "csrc"):
        d.mkdir(parents=True)
        (d / "build.py").write_text("")
    assert _cuda._csrc_dir(str(sp / "kvkernels")) == str(sp / "kvkernels" / "csrc")
    (sp / "kvkernels" / "csrc" / "build.py").unlink()
    assert _cuda._csrc_dir(str(sp / "kvkernels")) is None  # not the other project's
    # the imported package's own: an installed one's kvkernels/csrc, a checkout's csrc/ (beside
    # pyproject.toml; the tests of an unpacked sdist may import another checkout's package)
    pkg = os.path.dirname(os.path.abspath(_cuda.__file__))
    own = os.path.join(pkg, "csrc")
    assert _cuda._csrc_dir() == (own if os.path.isdir(own) else os.path.join(os.path.dirname(pkg), "csrc"))


@needs_nvcc
def test_jit_builds_one_file_per_toolchain_and_loads_without_nvcc(tmp_path, monkeypatch):
    """Processes with different toolchains sharing a cache each build their own file once (they
    rebuilt each other's when one stamp decided); a process without nvcc loads the newest."""
    from kvkernels import _cuda, config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("KVKERNELS_CUDA_LIB", raising=False)
    monkeypatch.setattr(config, "cache_dir", lambda: str(tmp_path))
    jit = _cuda._jit_dir()
    built = []

    def stand_in(out_dir, *a, lib_name=build.LIB, **k):  # what build() leaves: one library file
        built.append(lib_name)
        os.makedirs(out_dir, exist_ok=True)
        _elf_stub(os.path.join(out_dir, lib_name))
        return os.path.join(out_dir, lib_name)

    mod = _cuda._build_module()
    monkeypatch.setattr(mod, "build", stand_in)

    def load():
        _cuda._load.cache_clear()
        return _cuda._load()[1]

    try:
        a = mod.jit_lib_name()
        load()  # first use: built (an empty stand-in library: it does not load)
        assert built == [a] and os.path.isfile(os.path.join(jit, a))
        load()  # the same toolchain: reused
        assert built == [a]
        monkeypatch.setenv("KVKERNELS_CUTLASS_INCLUDE", str(tmp_path / "other"))  # another toolchain
        os.makedirs(tmp_path / "other" / "cute" / "arch")
        (tmp_path / "other" / "cute" / "arch" / "copy_sm90_tma.hpp").write_text("")
        b = mod.jit_lib_name()
        assert b != a
        load()
        load()
        assert built == [a, b]  # built once, and a's build left alone
        monkeypatch.delenv("KVKERNELS_CUTLASS_INCLUDE")
        load()
        assert built == [a, b] and os.path.isfile(os.path.join(jit, a))
        monkeypatch.setattr(mod, "nvcc", lambda: None)  # no nvcc: the newest build there
        os.utime(os.path.join(jit, a), (1, 1))
        assert os.path.basename(load().split(":")[0]) == b and built == [a, b]
    finally:
        _cuda._load.cache_clear()



def test_cuda_backend_refuses_cpu_tensors_even_when_the_library_loads(monkeypatch):
    # with the library built, backend="cuda" (or KVKERNELS_BACKEND=cuda) on a CPU cache handed
    # host pointers to the C kernels
    from kvkernels import backends, ops
    from kvkernels.models import make_cache

    monkeypatch.setattr(backends, "cuda_ext_available", lambda: True)
    lay = make_cache("vllm-nhd", num_layers=2, num_blocks=8, block_size=4, num_heads=2, head_dim=8)
    with pytest.raises(RuntimeError, match="'cuda' runs on CUDA tensors only, got tensors on cpu$"):
        ops.gather(lay, [1, 2], backend="cuda")
    # chosen for every call by the environment: CPU tensors (LMCache's host chunks) take torch
    monkeypatch.setenv("KVKERNELS_BACKEND", "cuda")
    assert backends.resolve("auto", lay.device) == "torch"
    assert torch.equal(ops.gather(lay, [1, 2]), ops.gather(lay, [1, 2], backend="torch"))


def test_the_wheel_ships_what_a_just_in_time_build_compiles_and_builds_without_setuptools_warnings(tmp_path):
    """A non-editable install (``pip install kvkernels``, a wheel) builds the CUDA backend on
    first use from the sources shipped inside the package: the wheel must carry every file the
    build hashes and compiles (its ``source_key`` equals the tree's), plus the license. The build
    itself must not lean on what setuptools deprecates: the TOML-table ``license`` is refused by
    setuptools releases after 2027-02-18, and data in unlisted package folders "would be ignored"."""
    import sys
    import zipfile

    setuptools = pytest.importorskip("setuptools")
    if _version_tuple(setuptools.__version__)[:2] < (77, 0):
        pytest.skip(f"setuptools {setuptools.__version__}: the build needs >= 77 (torch >= 2.13 requires it)")
    src = tmp_path / "src"  # a copy: an in-tree build would leave build/ and egg-info in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", ".whl", "build", "dist", "*.egg-info",
                                                             "__pycache__", "bench_results", ".hypothesis", "*.so"))
    env = {**os.environ, "KVKERNELS_BUILD_CUDA": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, env=env, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "SetuptoolsDeprecationWarning" not in out and "would be ignored" not in out, out[-4000:]
    (whl,) = (tmp_path / "dist").glob("kvkernels-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        z.extractall(tmp_path / "site")
    assert "License-Expression: Apache-2.0" in meta
    assert f"\nVersion: {kvkernels.__version__}\n" in meta  # (pyproject takes it from kvkernels.__version__)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    spec = importlib.util.spec_from_file_location("kvk_csrc_build_wheel", tmp_path / "site" / "kvkernels" / "csrc" / "build.py")
    shipped = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shipped)
    assert all(os.path.isfile(s) for s in shipped.SOURCES)
    assert shipped.source_key() == build.source_key()
    assert any(n.startswith("kvkernels/bench/") and n.endswith(".cpp") for n in names)  # the memcpy-loop bench
    assert "kvkernels/py.typed" in names  # (PEP 561: type checkers use the annotations)
