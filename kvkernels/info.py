"""``kvkernels.info()``: what this machine can do (``kvkernels info`` prints it)."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import platform

import torch

from . import _wheels, backends, config


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _probe(module: str) -> tuple[bool, str]:
    try:
        importlib.import_module(module)
        return True, "importable"
    except Exception as exc:  # pragma: no cover - depends on the machine
        return False, f"{type(exc).__name__}: {exc}"


def _field(fn):
    """``fn()``, or the text of the configuration error it raises (``ValueError`` for a malformed
    ``KVKERNELS_*`` value, ``RuntimeError`` for one this machine cannot honour)."""
    try:
        return fn()
    except (ValueError, RuntimeError) as exc:
        return f"error: {exc}"


def info() -> dict:
    """A dict describing versions, the GPU, the usable backends and the I/O / compression stack."""
    import kvkernels

    cuda = torch.cuda.is_available()
    d: dict = {
        "kvkernels": kvkernels.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "triton_interpret": backends.triton_interpret(),
        "cuda_available": cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "gpu_sms": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
    }
    dev = torch.device("cuda" if cuda else "cpu")
    d["backends"] = {
        "triton": backends.triton_available(dev),
        "cuda": backends.cuda_ext_available(),
        "torch": True,
    }
    if not d["backends"]["triton"]:
        d["triton_status"] = backends.triton_unavailable_reason(dev)
    # what auto resolves to under KVKERNELS_BACKEND; a value that cannot run here (triton on a CPU
    # without TRITON_INTERPRET, cuda without the library) or is malformed is reported, not raised:
    # info is the command that diagnoses that configuration
    d["backend_auto"] = _field(lambda: backends.resolve("auto", dev))
    # every malformed KVKERNELS_* value (what `demo` and `bench` refuse to start with); info
    # reported only KVKERNELS_BACKEND's
    d["env_problems"] = config.env_problems()
    if d["backends"]["cuda"]:
        from . import _cuda

        d["cuda_lib"] = _cuda.reason()  # the library's path
        d["cuda_bulk"] = {"built": _cuda.bulk_supported(), "enabled": _field(config.cuda_bulk)}
    kv_ok, kv_msg = _probe("kvikio")
    d["kvikio"] = _wheels.version("kvikio") if kv_ok else None
    d["kvikio_status"] = kv_msg
    nv_ok, nv_msg = _probe("nvidia.nvcomp")
    d["nvcomp"] = _wheels.version("nvidia-nvcomp") if nv_ok else None
    d["nvcomp_status"] = nv_msg
    d["nvcomp_usable"] = bool(nv_ok and cuda)
    try:  # the store reports its engines and whether GPUDirect Storage is active
        from kvkernels.io import engine_info

        d["io"] = engine_info()
    except ImportError as exc:
        d["io"] = f"unavailable ({exc})"
    return d
