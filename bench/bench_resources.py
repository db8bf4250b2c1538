"""Registers, shared memory and spills of every Triton kernel for sm_90 — no GPU needed.

The kernels are compiled ahead of time for ``GPUTarget("cuda", 90, 32)`` with the argument
specialisations their launchers produce for an aligned llama3-8b-like cache (bf16, 8 KV heads,
head_dim 128, block size 16, 16-byte aligned pointers and strides) and read back with
``cuobjdump --dump-resource-usage`` (Triton's bundled copy). ``compile_triton_variants`` is also
what ``tests/test_quant.py`` and ``tests/test_ptx.py`` inspect in PTX. The CUDA backend's
figures come from nvcc (``tests/test_csrc.py::test_resource_usage_report``, docs/csrc.md).

    kvkernels bench resources [--out DIR]      # table + kernel_resources.json

Without ``TRITON_INTERPRET``: the interpreter's decorated kernels cannot be compiled, so with it
set the command re-runs itself in a subprocess without it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

COMMON = ["n", "num_blocks", "num_items", "stride_b", "stride_n", "stride_h"]
COMMON_T = ["i32", "i32", "i32", "i64", "i64", "i64"]


def _compile(kern, names, types, consts, div16, num_warps=4):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(zip(names, types))
    sig.update({k: "constexpr" for k in consts})
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div16}  # what Triton specialises
    return triton.compile(ASTSource(kern, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


def compile_triton_variants(align: bool = True, which=("copy", "quant", "shuffle")) -> dict:
    """``{name: compiled kernel}`` for sm_90: the paged copy (gather, scatter), FP8 quantizing
    gather (bf16/fp16/fp32 x token/block) and dequantizing scatter, byte-plane shuffle/unshuffle.
    ``align``: the 16-byte-aligned specialisation (ALIGN16 and divisible pointers/strides)."""
    os.environ.pop("TRITON_INTERPRET", None)
    out = {}
    if "copy" in which:
        from kvkernels.triton_ops.gather import _gather_kernel
        from kvkernels.triton_ops.scatter import _scatter_kernel

        for name, kern, buf in (("gather", _gather_kernel, "out_ptr"), ("scatter", _scatter_kernel, "stage_ptr")):
            names = ["ptr_tab", "block_ids", buf, "err_ptr"] + COMMON + ["region_words", "entry_words"]
            types = ["*i64", "*i64", "*i64", "*i32"] + COMMON_T + ["i64", "i64"]
            consts = {"C": 2, "H": 8, "ROWS": 128, "ROW_WORDS": 32, "WORD": 8, "BLOCK_R": 64, "BLOCK_W": 32,
                      "ALIGN16": align}
            div = ["ptr_tab", buf, "stride_b", "stride_n", "stride_h", "region_words", "entry_words"] if align else []
            out[name] = _compile(kern, names, types, consts, div)
    if "quant" in which:
        from kvkernels.triton_ops.dequant_scatter import _dequant_scatter_kernel
        from kvkernels.triton_ops.quant_gather import _quant_gather_kernel

        qn = ["ptr_tab", "block_ids", "q_ptr", "s_ptr", "err_ptr"] + COMMON + [
            "region_nbytes", "q_entry_nbytes", "scale_base_nbytes", "scale_entry_nbytes"]
        qt = ["*i64", "*i64", "*u8", "*i32", "*i32"] + COMMON_T + ["i64"] * 4
        div = ["ptr_tab", "q_ptr", "s_ptr", "stride_b", "stride_n", "stride_h"] + qn[-4:]
        for kind, dt in enumerate(("bf16", "fp16", "fp32")):
            for pb in (False, True):
                out[f"quant_gather_{dt}_{'block' if pb else 'token'}"] = _compile(_quant_gather_kernel, qn, qt, dict(
                    C=2, H=8, BS=16, D=128, IN_KIND=kind, PER_BLOCK=pb, BLOCK_R=32, BLOCK_D=128, ALIGN16=align,
                    HW_CVT=True, FMA_DIV=True, D_TAIL=0, ITEMS=1, TAIL_FIX=0), div)
            out[f"dequant_scatter_{dt}"] = _compile(_dequant_scatter_kernel, qn, qt[:3] + ["*fp32"] + qt[4:], dict(
                C=2, H=8, BS=16, D=128, OUT_KIND=kind, PER_BLOCK=False, BLOCK_R=32, BLOCK_D=128, ALIGN16=align), div)
    if "quant_split" in which:  # the split-D probe (bench/fp8_tuning.py): MLA's 576 = 512 + 64
        from kvkernels.triton_ops.quant_gather import _quant_gather_kernel

        qn = ["ptr_tab", "block_ids", "q_ptr", "s_ptr", "err_ptr"] + COMMON + [
            "region_nbytes", "q_entry_nbytes", "scale_base_nbytes", "scale_entry_nbytes"]
        qt = ["*i64", "*i64", "*u8", "*i32", "*i32"] + COMMON_T + ["i64"] * 4
        div = ["ptr_tab", "q_ptr", "s_ptr", "stride_b", "stride_n", "stride_h"] + qn[-4:]
        for pb in (False, True):
            out[f"quant_gather_split_bf16_{'block' if pb else 'token'}"] = _compile(_quant_gather_kernel, qn, qt, dict(
                C=1, H=1, BS=16, D=576, IN_KIND=0, PER_BLOCK=pb, BLOCK_R=8, BLOCK_D=512, ALIGN16=align,
                HW_CVT=True, FMA_DIV=True, D_TAIL=64, ITEMS=1, TAIL_FIX=0), div)
    if "quant_probes" in which:  # bench/fp8_tuning.py's twelfth-session variants (sm_90 static study)
        from kvkernels.triton_ops.quant_gather import _quant_gather_kernel

        qn = ["ptr_tab", "block_ids", "q_ptr", "s_ptr", "err_ptr"] + COMMON + [
            "region_nbytes", "q_entry_nbytes", "scale_base_nbytes", "scale_entry_nbytes"]
        qt = ["*i64", "*i64", "*u8", "*i32", "*i32"] + COMMON_T + ["i64"] * 4
        div = ["ptr_tab", "q_ptr", "s_ptr", "stride_b", "stride_n", "stride_h"] + qn[-4:]
        base4k = dict(C=2, H=1, BS=16, D=128, IN_KIND=0, BLOCK_R=16, BLOCK_D=128, ALIGN16=align, HW_CVT=True,
                      D_TAIL=0, TAIL_FIX=0)
        mla = dict(C=1, H=1, BS=16, D=576, IN_KIND=0, BLOCK_R=8, BLOCK_D=512, ALIGN16=align, HW_CVT=True,
                   D_TAIL=64, ITEMS=1)
        for pb in (False, True):
            g = "block" if pb else "token"
            out[f"quant_gather_4k_items4_fma2_{g}"] = _compile(_quant_gather_kernel, qn, qt, dict(
                base4k, PER_BLOCK=pb, ITEMS=4, FMA_DIV=2), div)
            out[f"quant_gather_mla_tailfix_fma2_{g}"] = _compile(_quant_gather_kernel, qn, qt, dict(
                mla, PER_BLOCK=pb, TAIL_FIX=2, FMA_DIV=2), div)
    if "shuffle" in which:
        from kvkernels.triton_ops.shuffle_gather import _shuffle_gather_kernel
        from kvkernels.triton_ops.unshuffle_scatter import _unshuffle_scatter_kernel

        for name, kern, buf in (("shuffle_gather", _shuffle_gather_kernel, "out_ptr"),
                                ("unshuffle_scatter", _unshuffle_scatter_kernel, "stage_ptr")):
            sn = ["ptr_tab", "block_ids", buf, "err_ptr"] + COMMON + ["region_nbytes", "entry_nbytes", "plane_nbytes"]
            st = ["*i64", "*i64", "*u8", "*i32"] + COMMON_T + ["i64"] * 3
            div = ["ptr_tab", buf, "stride_b", "stride_n", "stride_h"] + sn[-3:]
            out[name] = _compile(kern, sn, st, dict(C=2, H=8, ROWS=128, D=128, BLOCK_R=32, BLOCK_D=128,
                                                    ALIGN16=align), div)
    return out


def _cuobjdump() -> str | None:
    try:
        import triton

        p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.path.exists(p):
            return p
    except ImportError:
        pass
    return shutil.which("cuobjdump")


_FUNC = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_ARCH = re.compile(r"arch = (sm_\w+)")


def resource_usage(binary: str, arch: str | None = None) -> list[dict]:
    """``cuobjdump --dump-resource-usage`` of a cubin (``arch``: its target, which a bare cubin's
    dump does not name) or of a fatbin-carrying library, parsed:
    ``[{arch, function, registers, stack, shared, local}]``."""
    exe = _cuobjdump()
    if exe is None:
        raise RuntimeError("cuobjdump not found (it ships with triton's NVIDIA backend and with the CUDA toolkit)")
    text = subprocess.run([exe, "--dump-resource-usage", binary], capture_output=True, text=True, check=True).stdout
    rows = []
    for block in re.split(r"(?=arch = sm_)", text):
        m = _ARCH.search(block)
        arch = m.group(1) if m else arch
        for f in _FUNC.finditer(block):
            rows.append({"arch": arch, "function": _demangle(f.group(1)), "registers": int(f.group(2)),
                         "stack": int(f.group(3)), "shared": int(f.group(4)), "local": int(f.group(5))})
    return rows


def _demangle(name: str) -> str:
    exe = shutil.which("c++filt")
    if exe is None or not name.startswith("_Z"):
        return name
    return subprocess.run([exe, name], capture_output=True, text=True).stdout.strip() or name


def triton_rows(align: bool = True) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, k in compile_triton_variants(align).items():
            path = os.path.join(d, name + ".cubin")
            with open(path, "wb") as f:
                f.write(k.asm["cubin"])
            for r in resource_usage(path, arch="sm_90"):
                rows.append({"backend": "triton", "kernel": name, **r, "triton_shared": k.metadata.shared})
    return rows


def main(argv=None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="directory for kernel_resources.json")
    a = p.parse_args(argv)
    if a.out is not None:
        try:
            from kvkernels.bench import common
        except ImportError:  # pragma: no cover - run as a script
            import common  # type: ignore
        common.bench_paths(p, out=a.out)
    if os.environ.get("TRITON_INTERPRET"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run([sys.executable, "-m", "kvkernels.bench.bench_resources", *(sys.argv[1:] if argv is None else argv)],
                              env=env).returncode
    rows = triton_rows()
    print(f"{'backend':7s} {'arch':7s} {'regs':>4s} {'smem':>6s} {'stack':>5s} {'local':>5s}  kernel")
    for r in rows:
        print(f"{r['backend']:7s} {r['arch']:7s} {r['registers']:4d} {r['shared']:6d} {r['stack']:5d} {r['local']:5d}  "
              f"{r['kernel']}")
    if a.out:
        import torch
        import triton

        os.makedirs(a.out, exist_ok=True)
        from kvkernels.bench import common

        meta = {**common.env_record(), "triton": triton.__version__, "torch": torch.__version__, "target": "sm_90",
                "note": "compiled ahead of time on a CPU host; cuobjdump --dump-resource-usage"}
        with open(os.path.join(a.out, "kernel_resources.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
