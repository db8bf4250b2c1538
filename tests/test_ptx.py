"""The copy kernels compile for sm_90 on a GPU-less machine and use 16-byte vector accesses."""

import json
import os
import subprocess
import sys

import pytest

PROBE = os.path.join(os.path.dirname(__file__), "ptx_probe.py")


def _insns(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, PROBE, *args], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_aligned_case_uses_16_byte_loads_and_stores(op):
    insns = _insns(op, "align16")
    assert "ld.global.v2.b64" in insns  # cache side (gather) / staging side (scatter)
    assert "st.global.v2.b64" in insns


def test_unaligned_case_still_compiles():
    insns = _insns("gather")
    assert any(i.startswith("ld.global") for i in insns)


def test_kernels_fit_in_registers_without_spills():
    """Every Triton kernel variant compiled for sm_90 keeps its state in registers: no local
    memory, no stack (spills would put the copy's tiles through L1/L2), at most 128 registers
    per thread (four 128-thread CTAs per SM at the least) and little shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json; from kvkernels.bench.bench_resources import triton_rows; print(json.dumps(triton_rows()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len({row["kernel"] for row in rows}) == 13
    for row in rows:
        assert row["local"] == 0 and row["stack"] == 0, row
        assert row["registers"] <= 128 and row["shared"] <= 16384, row


def test_no_triton_kernel_multiplies_a_stride_or_size_in_32_bits():
    """Compiled for sm_90 with every integer scalar typed i32, the TTIR multiplies in i32 only
    the work-item counters (``n``, ``num_items``: bounded by num_items < 2^31). A product of a
    stride or a size in i32 (``h * stride_h`` in the per-block FP8 gather before e9b9dcd: an
    overflow past 2^31 elements the interpreter cannot show) fails here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = os.path.join(os.path.dirname(__file__), "i32_probe.py")
    r = subprocess.run([sys.executable, probe], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(found) == 16  # gather, scatter (x2 ALIGN16), fp8 gather (x8), dequant (x2), shuffle (x2)
    bounded = {"n", "num_items"}
    bad = {name: [p for p in prods if not set(p[1]) <= bounded] for name, prods in found.items()}
    assert not any(bad.values()), bad
    # the probe sees products at all (a parser that matched nothing would pass the check above)
    assert any(prods for prods in found.values())
