"""Compile the copy kernels to sm_90 PTX without a GPU and print the global memory instructions.

Run by tests/test_ptx.py in a subprocess (the tests themselves run the interpreter, whose
decorated functions cannot be compiled). Usage: python tests/ptx_probe.py gather|scatter [align16]
The kernels are compiled by ``kvkernels.bench.bench_resources`` (the launchers' specialisations).
"""

import json
import re
import sys

from kvkernels.bench.bench_resources import compile_triton_variants

op, align = sys.argv[1], (len(sys.argv) > 2 and sys.argv[2] == "align16")
ptx = compile_triton_variants(align, which=("copy",))[op].asm["ptx"]
print(json.dumps(sorted(set(re.findall(r"(?:ld|st)\.global[\w.]*", ptx)))))
