"""Every i32 multiply in each Triton kernel's TTIR that depends on a scalar kernel argument.

Run by tests/test_ptx.py in a subprocess (without TRITON_INTERPRET). Compiles each kvkernels
Triton kernel for sm_90 (no GPU) with every integer scalar typed i32 (what Triton's launcher gives
a Python int < 2^31) and prints, as JSON, the i32 ``arith.muli`` whose operands derive from a
scalar argument, with the argument names they depend on. A stride or size that is small in the
tests and > 2^31 in production (cross-layer caches, heads-outermost layouts) keeps such a
product's i32 type: the interpreter (numpy int64) never shows the overflow.
"""
import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
from kvkernels.bench.bench_resources import _compile, COMMON  # noqa: E402

PTRS = {"ptr_tab", "block_ids", "err_ptr", "out_ptr", "stage_ptr", "q_ptr", "s_ptr"}


def i32_products(ttir: str, scalars):
    deps = {}  # ssa value -> set of scalar arg names it depends on
    out = []
    for line in ttir.splitlines():
        line = re.sub(r" loc\(.*$", "", line)
        m = re.match(r"^\s*(%[\w\-#]+)(?::(\d+))? = ([\w.]+)\s*(.*)$", line)
        if not m:
            # scf.for induction variables depend on their bounds
            f = re.match(r"^\s*(?:%[\w\-#:]+ = )?scf\.for (%[\w\-#]+) = (%[\w\-#]+) to (%[\w\-#]+) step (%[\w\-#]+)", line)
            if f:
                d = set()
                for v in f.groups()[1:]:
                    d |= deps.get(v, {v[1:]} if v[1:] in scalars else set())
                deps[f.group(1)] = d
            continue
        res, _, op, rest = m.groups()
        operands = re.findall(r"%[\w\-#]+", rest.split(" : ")[0])
        d = set()
        for v in operands:
            d |= deps.get(v, {v[1:]} if v[1:] in scalars else set())
        deps[res] = d
        if op == "arith.muli" and d and re.search(r": (i32|tensor<[\dx]+xi32>)\s*$", rest):
            out.append((res, sorted(d), rest.strip()))
    return out

def kernels(ids="*i32"):
    from kvkernels.triton_ops.gather import _gather_kernel
    from kvkernels.triton_ops.scatter import _scatter_kernel
    from kvkernels.triton_ops.quant_gather import _quant_gather_kernel
    from kvkernels.triton_ops.dequant_scatter import _dequant_scatter_kernel
    from kvkernels.triton_ops.shuffle_gather import _shuffle_gather_kernel
    from kvkernels.triton_ops.unshuffle_scatter import _unshuffle_scatter_kernel
    T32 = ["i32"] * 6
    for name, kern, buf in (("gather", _gather_kernel, "out_ptr"), ("scatter", _scatter_kernel, "stage_ptr")):
        names = ["ptr_tab", "block_ids", buf, "err_ptr"] + COMMON + ["region_words", "entry_words"]
        types = ["*i64", ids, "*i64", "*i32"] + T32 + ["i32", "i32"]
        for al in (False, True):
            yield f"{name}_a{int(al)}", names, _compile(kern, names, types, dict(C=2, H=8, ROWS=128, ROW_WORDS=32, WORD=8, BLOCK_R=64, BLOCK_W=32, ALIGN16=al), [])
    qn = ["ptr_tab", "block_ids", "q_ptr", "s_ptr", "err_ptr"] + COMMON + ["region_nbytes", "q_entry_nbytes", "scale_base_nbytes", "scale_entry_nbytes"]
    qt = ["*i64", ids, "*u8", "*i32", "*i32"] + T32 + ["i32"] * 4
    for pb in (False, True):
        for items, dt, tf in ((1, 0, 0), (4, 0, 0), (1, 64, 0), (1, 64, 2)):
            D, BD = (576, 512) if dt else (128, 128)
            yield f"quant_gather_pb{int(pb)}_items{items}_tail{dt}_fix{tf}", qn, _compile(_quant_gather_kernel, qn, qt, dict(
                C=2, H=8, BS=16, D=D, IN_KIND=0, PER_BLOCK=pb, BLOCK_R=8, BLOCK_D=BD, ALIGN16=True, HW_CVT=True,
                FMA_DIV=True, D_TAIL=dt, ITEMS=items, TAIL_FIX=tf), [])
        yield f"dequant_scatter_pb{int(pb)}", qn, _compile(_dequant_scatter_kernel, qn, qt[:3] + ["*fp32"] + qt[4:], dict(
            C=2, H=8, BS=16, D=128, OUT_KIND=0, PER_BLOCK=pb, BLOCK_R=32, BLOCK_D=128, ALIGN16=True), [])
    for name, kern, buf in (("shuffle_gather", _shuffle_gather_kernel, "out_ptr"), ("unshuffle_scatter", _unshuffle_scatter_kernel, "stage_ptr")):
        sn = ["ptr_tab", "block_ids", buf, "err_ptr"] + COMMON + ["region_nbytes", "entry_nbytes", "plane_nbytes"]
        st = ["*i64", ids, "*u8", "*i32"] + T32 + ["i32"] * 3
        yield name, sn, _compile(kern, sn, st, dict(C=2, H=8, ROWS=128, D=128, BLOCK_R=32, BLOCK_D=128, ALIGN16=True), [])

if __name__ == "__main__":
    print(json.dumps({name: i32_products(k.asm["ttir"], set(names) - PTRS) for name, names, k in kernels()}))
