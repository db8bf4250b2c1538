"""The CUDA C++ backend (csrc/) compiles warning-free for sm_80 / sm_90 / sm_90a on a GPU-less
machine and exports its C ABI; on a GPU the same gather/scatter tests run it (kvtest.BACKENDS)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess

import pytest
import torch

import kvkernels
from kvkernels.models import make_cache
from kvtest import DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("kvk_csrc_build", os.path.join(ROOT, "csrc", "build.py"))
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)

needs_nvcc = pytest.mark.skipif(build.nvcc() is None, reason="nvcc not installed (CI has it)")


@needs_nvcc
def test_compiles_for_all_targets_with_warnings_as_errors(tmp_path):
    lib = build.build(str(tmp_path))
    nm = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True, check=True).stdout
    syms = set(re.findall(r"\bkvk_\w+", nm))
    assert {"kvk_abi_version", "kvk_last_error", "kvk_paged_copy"} <= syms
    # no C++ symbol (and so no torch ABI) crosses the boundary
    assert not [s for s in re.findall(r" T (\S+)", nm) if s.startswith("_Z") and "kvk" not in s and "paged" in s]


@needs_nvcc
def test_resource_usage_report(tmp_path, capsys):
    cmd = build.command(str(tmp_path / "x.so"), archs=("90",), extra=("--resource-usage",))
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", r.stdout + r.stderr)]
    assert len(regs) == 10  # 5 word widths x gather/scatter
    assert max(regs) <= 64  # a copy kernel has no business spilling or limiting occupancy
    with capsys.disabled():
        print(f"\ncsrc sm_90 registers per kernel: {regs}")


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
    assert exe is not None, "compute-sanitizer is part of the GPU image"
    script = tmp_path / "run.py"
    script.write_text(
        "import torch, kvkernels\n"
        "from kvkernels.models import make_cache\n"
        "for name in ('vllm-nhd', 'mla', 'vllm-packed'):\n"
        "    lay = make_cache(name, num_layers=2, num_blocks=64, block_size=16, num_heads=4, head_dim=128, device='cuda')\n"
        "    ids = torch.tensor([5, -1, 63, 0], device='cuda')\n"
        "    for b in ('cuda', 'triton'):\n"
        "        s = kvkernels.gather(lay, ids, backend=b)\n"
        "        kvkernels.scatter(s, lay, torch.tensor([1, -1, 2, 3], device='cuda'), backend=b)\n"
        "torch.cuda.synchronize()\n"
    )
    import sys

    r = subprocess.run([exe, "--tool", "memcheck", "--error-exitcode", "9", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
