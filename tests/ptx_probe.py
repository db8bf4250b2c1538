"""Compile the copy kernels to sm_90 PTX without a GPU and print the global memory instructions.

Run by tests/test_ptx.py in a subprocess (the tests themselves run the interpreter, whose
decorated functions cannot be compiled). Usage: python tests/ptx_probe.py gather|scatter [align16]
"""

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

op, align = sys.argv[1], (len(sys.argv) > 2 and sys.argv[2] == "align16")
if op == "gather":
    from kvkernels.triton_ops.gather import _gather_kernel as kern
    buf = "out_ptr"
else:
    from kvkernels.triton_ops.scatter import _scatter_kernel as kern
    buf = "stage_ptr"
names = ["ptr_tab", "block_ids", buf, "err_ptr", "n", "num_blocks", "num_items", "stride_b", "stride_n", "stride_h",
         "region_words", "entry_words"]
types = ["*i64", "*i64", "*i64", "*i32", "i32", "i32", "i32", "i64", "i64", "i64", "i64", "i64"]
sig = dict(zip(names, types))
consts = {"C": 2, "H": 8, "ROWS": 128, "ROW_WORDS": 32, "WORD": 8, "BLOCK_R": 64, "BLOCK_W": 32, "ALIGN16": align}
sig.update({k: "constexpr" for k in consts})
div16 = [0, 2, 7, 8, 9, 10, 11]  # pointers and strides the launcher sees 16-divisible (Triton specialises them)
attrs = {(i,): [["tt.divisibility", 16]] for i in div16}
k = triton.compile(ASTSource(kern, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
ptx = k.asm["ptx"]
print(json.dumps(sorted(set(re.findall(r"(?:ld|st)\.global[\w.]*", ptx)))))
