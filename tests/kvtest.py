"""Shared test constants and helpers (importable from tests: pytest's ``pythonpath = tests``).

Importing this module decides the Triton mode: without CUDA, ``TRITON_INTERPRET=1`` is set before
anything imports triton (this is the one place it is set; conftest imports this module first).
"""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# Backends that run on DEVICE here; one test body runs for each. The CUDA C++ backend joins on a GPU
# (built just in time from csrc/ when needed).
BACKENDS = ["torch", "triton"]
if HAS_CUDA:
    from kvkernels import _cuda

    if _cuda.available():
        BACKENDS.append("cuda")


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact comparison of two tensors of the same shape and dtype (NaN-safe, fp8-safe)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


DAMAGE_OPS = ("flip", "set", "cut", "extend", "zero")


def damage(data: bytes, op: str, where: float, val: int, n: int, *, min_len: int = 0) -> bytearray:
    """``data`` with one kind of damage at fraction ``where`` of its length: ``flip`` xors the
    byte with ``val``, ``set`` overwrites it, ``cut`` truncates there (keeping ``min_len`` bytes
    at least), ``extend`` appends ``n`` bytes of ``val``, ``zero`` clears ``n`` bytes (the
    corruption property tests of the codec and the store)."""
    out = bytearray(data)
    p = int(where * len(out))
    if op == "flip":
        out[p] ^= val
    elif op == "set":
        out[p] = val
    elif op == "cut":
        out = out[: max(min_len, p)]
    elif op == "extend":
        out += bytes([val]) * n
    elif op == "zero":
        out[p: p + n] = bytes(len(out[p: p + n]))
    else:
        raise ValueError(f"unknown damage {op!r}")
    return out
