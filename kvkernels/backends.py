"""Which backends exist here, and which one ``backend="auto"`` picks.

* ``"triton"`` — kernels in ``triton_ops/``; on CUDA tensors, or on CPU tensors when
  ``TRITON_INTERPRET=1`` was set before anything imported triton (the CI path).
* ``"cuda"`` — the compiled C++ kernels in ``csrc/`` (C ABI via ctypes; built at install with
  ``KVKERNELS_BUILD_CUDA=1`` or just in time on first use). ``auto`` does not pick it: on the
  H100 (2026-11-23, docs/PERF_NOTES.md) Triton was at or above it on every registered shape
  (98.6 vs 96.2 % on 4 KB chunks, 97.0 vs 97.2 % on 32 KB, the FP8 gather 73-91 % vs 24-57 %
  in the third run, shuffle at parity) except
  the deepseek-v3 MLA plain copy (94.7 vs 97.5 %), where 3 points do not justify an nvcc build on
  first use; pass ``backend="cuda"`` there (docs/csrc.md).
* ``"torch"`` — :mod:`kvkernels.reference`, any device; the CPU fallback.

``auto`` (or ``KVKERNELS_BACKEND``): CUDA tensors -> triton if importable, else torch; CPU tensors
-> torch (the interpreter is a correctness tool, far slower than torch on CPU). The choice is
logged at debug level.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os

import torch

from . import config

log = logging.getLogger("kvkernels")

BACKENDS = ("triton", "cuda", "torch")


def triton_interpret() -> bool:
    """Whether Triton runs its interpreter: ``TRITON_INTERPRET`` read as Triton (3.6-3.8's
    ``getenv_bool``) reads it: 1, true, yes, on or y, in any case (only "1" counted here until
    2026-11-25, so ``true`` ran the interpreter while kvkernels refused CPU tensors for want of it;
    ``y`` until the thirty-second session's docs review)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


# The oldest Triton the kernels run on (the `[triton]` extra's floor; torch >= 2.7 pins one). Triton
# 3.2 (torch 2.6's) has no `tl.gather`, which one FP8 gather variant uses: its JIT walks the whole
# kernel for dependencies, so every FP8 gather failed to compile there; and its interpreter ignores
# a masked scalar `tl.atomic_add`'s mask (the invalid-id counter). Measured on 2026-11-25 with
# triton 3.2.0 and 3.3.0 (README, "Tested versions").
MIN_TRITON = (3, 3)


def _version_tuple(v: str) -> tuple[int, ...]:
    """``"3.3.0+git..."`` -> ``(3, 3, 0)``: the leading dotted integers."""
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    try:
        import triton

        if _version_tuple(triton.__version__)[:2] < MIN_TRITON:
            need = ".".join(map(str, MIN_TRITON))
            return (f"triton {triton.__version__} is older than {need}, the oldest the kernels run on "
                    f"(pip install 'triton>={need}'; torch >= 2.7 brings one)")
        from kvkernels import triton_ops  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (None: they can)."""
    why = _triton_import_error()
    if why is not None:
        return why
    if device is None or device.type == "cuda":
        return None if torch.cuda.is_available() or triton_interpret() else "no CUDA device"
    if device.type == "cpu":
        return None if triton_interpret() else "CPU tensors need TRITON_INTERPRET=1 set before triton is imported"
    return f"no Triton kernels for {device.type} tensors"


def triton_available(device: torch.device | None = None) -> bool:
    """True when the Triton kernels can run on ``device`` (CUDA, or CPU under the interpreter)."""
    return triton_unavailable_reason(device) is None


def cuda_ext_available() -> bool:
    """True when the compiled csrc backend loads (built at install, cached, or JIT-built)."""
    from . import _cuda

    return _cuda.available()


def resolve(backend: str, device: torch.device) -> str:
    """Map ``backend`` (``auto|triton|cuda|torch``) to the one that runs on ``device``."""
    if not isinstance(backend, str):
        raise TypeError(f"`backend`: expected a str, got {type(backend).__name__}")
    b = backend.lower()
    if b == "auto":
        b = config.backend()
        if b == "auto":
            b = "triton" if device.type == "cuda" and triton_available(device) else "torch"
            log.debug("kvkernels: backend auto -> %s on %s", b, device)
            return b
    if b not in BACKENDS:
        raise ValueError(f"`backend`: expected one of auto, {', '.join(BACKENDS)}, got {backend!r}")
    if b == "triton" and not triton_available(device) and device.type == "cpu" and backend.lower() == "auto" \
            and _triton_import_error() is None:
        # chosen by KVKERNELS_BACKEND for every call, as `cuda` below: calls on CPU tensors (the
        # LMCache plugin's host chunks) take the torch backend where Triton has no interpreter
        log.debug("kvkernels: KVKERNELS_BACKEND=triton -> torch on %s (no TRITON_INTERPRET)", device)
        return "torch"
    if b == "triton" and not triton_available(device):
        raise RuntimeError(f"`backend`: 'triton' is not available on {device}: {triton_unavailable_reason(device) or 'unavailable'}")
    if b == "cuda" and not cuda_ext_available():
        from . import _cuda

        raise RuntimeError(f"`backend`: 'cuda' is not available: {_cuda.reason()}")
    if b == "cuda" and device.type != "cuda":
        # the C kernels take raw device pointers: a CPU tensor's address would be dereferenced on
        # the GPU. Asked for by name: an error. Chosen by KVKERNELS_BACKEND for every call: the
        # calls on CPU tensors (e.g. LMCache's host chunks) take the torch backend.
        if backend.lower() == "auto":
            log.debug("kvkernels: KVKERNELS_BACKEND=cuda -> torch on %s", device)
            return "torch"
        raise RuntimeError(f"`backend`: 'cuda' runs on CUDA tensors only, got tensors on {device}")
    return b
