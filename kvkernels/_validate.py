"""One validation helper for the whole package.

Every public entry point checks its inputs here *before* any kernel runs, and raises
``TypeError`` / ``ValueError`` with the message shape ```name`: expected X, got Y``.
No ``assert`` on user input: it vanishes under ``python -O``.
"""

from __future__ import annotations

import operator
from typing import Any, NoReturn

import torch


def fail(name: str, expected: str, got: Any, exc: type = ValueError) -> NoReturn:
    raise exc(f"`{name}`: expected {expected}, got {got}")


def check(cond: bool, name: str, expected: str, got: Any, exc: type = ValueError) -> None:
    if not cond:
        fail(name, expected, got, exc)


def check_tensor(x: Any, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        fail(name, "a torch.Tensor", type(x).__name__, TypeError)
    return x


def check_memory(t: torch.Tensor, name: str) -> None:
    """``t`` lives in CPU or CUDA memory: the kernels and the store move the bytes behind
    ``data_ptr()`` (a meta tensor has none; other devices are not supported)."""
    check(t.device.type in ("cpu", "cuda"), name, "a tensor in CPU or CUDA memory", t.device)


def check_byte_buffer(buf: Any, name: str, nbytes: int) -> torch.Tensor:
    """``buf`` is a 1-D contiguous uint8 tensor of at least ``nbytes`` bytes (a staging buffer's
    shape rules; where it may live is the caller's rule). Messages built on failure only."""
    check_tensor(buf, name)
    if buf.dtype != torch.uint8:
        fail(name, "dtype torch.uint8", buf.dtype, TypeError)
    if buf.dim() != 1:
        fail(name, "a 1-D buffer", describe(buf))
    if buf.stride(0) != 1 and buf.numel() > 1:
        fail(name, "a contiguous buffer", describe(buf))
    if buf.numel() < nbytes:
        fail(name, f"at least {nbytes} bytes", f"{buf.numel()} bytes")
    return buf


class _Described:
    """A tensor's description, formatted only if an error message uses it: checks that pass (the
    hot path, e.g. the pipeline's per-layer calls) do not pay for the string."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t

    def __str__(self) -> str:
        t = self.t
        return f"Tensor(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device}, stride={tuple(t.stride())})"

    __repr__ = __str__


def describe(t: torch.Tensor) -> _Described:
    """Short description of a tensor for error messages (formatted lazily: ``str()`` it)."""
    return _Described(t)


def check_int(x: Any, name: str, *, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        fail(name, "an int", type(x).__name__, TypeError)
    if lo is not None and x < lo:
        fail(name, f"an int >= {lo}", x)
    if hi is not None and x > hi:
        fail(name, f"an int <= {hi}", x)
    return x


def check_index(x: Any, name: str, *, lo: int | None = None, hi: int | None = None) -> int:
    """:func:`check_int` for integer-like values too (numpy / torch integers, e.g. a size read
    from a header), never a bool, float or string that ``int()`` would quietly turn into one."""
    if isinstance(x, bool):
        fail(name, "an int", "bool", TypeError)
    try:
        x = operator.index(x)
    except TypeError:
        fail(name, "an int", type(x).__name__, TypeError)
    return check_int(x, name, lo=lo, hi=hi)


def same_device(a: torch.device, b: torch.device) -> bool:
    """True when two devices name the same memory (cuda == cuda:current)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    ia = a.index if a.index is not None else torch.cuda.current_device()
    ib = b.index if b.index is not None else torch.cuda.current_device()
    return ia == ib
