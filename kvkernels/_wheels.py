"""kvikio and nvCOMP ship one wheel per CUDA major (``kvikio-cu12`` / ``kvikio-cu13``,
``nvidia-nvcomp-cu12`` / ``nvidia-nvcomp-cu13``; the same modules, ``kvikio`` and
``nvidia.nvcomp``). Which one to name in an install hint (the one matching this torch's CUDA
build), and which one is installed (either, for ``kvkernels info`` and the benches' records)."""

from __future__ import annotations

import importlib.metadata as md

MAJORS = ("cu13", "cu12")  # the extras: '.[gpu]' (CUDA 13) and '.[gpu-cu12]'


def suffix(cuda_version: str | None = None) -> str:
    """``"cu12"`` for a CUDA 12 build of torch (or ``cuda_version`` "12.x"), else ``"cu13"`` (CUDA
    13 builds, and CPU builds: the default extra)."""
    if cuda_version is None:
        import torch

        cuda_version = torch.version.cuda
    return "cu12" if str(cuda_version or "").split(".")[0] == "12" else "cu13"


def hint(base: str, cuda_version: str | None = None) -> str:
    """``pip install <base>-cuXX, or '.[gpu...]' from a kvkernels checkout`` for this torch's CUDA."""
    s = suffix(cuda_version)
    extra = "gpu" if s == "cu13" else f"gpu-{s}"
    return f"pip install {base}-{s}, or '.[{extra}]' from a kvkernels checkout"


def version(base: str) -> str | None:
    """The installed version of ``base``'s wheel of either CUDA major (or unsuffixed: a conda or
    source build), None if none is installed. Both installed: the one matching this torch first."""
    first = suffix()
    for name in [f"{base}-{first}"] + [f"{base}-{m}" for m in MAJORS if m != first] + [base]:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None
