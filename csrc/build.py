"""Build the CUDA backend (``libkvkernels_cuda.so``) with nvcc; no torch headers involved.

    python csrc/build.py OUT_DIR            # sm_80, sm_90, sm_90a
    KVKERNELS_BUILD_CUDA=1 pip install .    # setup.py calls build() and ships the .so

Warnings are errors (host and device). Returns the path of the library.

The SM90 bulk-copy path (csrc/kernels/bulk_copy.cuh) uses CuTe / CUTLASS headers. They are found in
``KVKERNELS_CUTLASS_INCLUDE`` (a folder holding ``cute/`` and ``cutlass/``), else in the PyPI package
``nvidia-cutlass`` (``pip install --no-deps nvidia-cutlass``: its ``cutlass_library/source/include``).
Without them the library builds without that path (``kvk_features()`` bit 0 clear).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(HERE, "bindings", "capi.cu")]
LIB = "libkvkernels_cuda.so"
ARCHS = ("80", "90", "90a")


def nvcc() -> str | None:
    """nvcc on PATH, else ``$CUDA_HOME/bin/nvcc`` when that file exists (a runtime-only CUDA_HOME
    has none), else None."""
    exe = shutil.which("nvcc")
    if exe is None and os.environ.get("CUDA_HOME"):
        exe = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
        exe = exe if os.path.isfile(exe) else None
    return exe


def source_key() -> str:
    """A short hash of the sources a build is made of: every file under csrc/kernels and
    csrc/bindings, this script, the target archs. The just-in-time cache folder is named after
    it (kvkernels/_cuda.py), so a build of other sources is never loaded; it does not depend on
    the toolkit found, so a process without nvcc still finds a build made by one that had it."""
    import hashlib

    h = hashlib.sha1()
    files = [os.path.abspath(__file__)]
    for sub in ("kernels", "bindings"):
        d = os.path.join(HERE, sub)
        files += sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith((".cu", ".cuh", ".h", ".hpp")))
    for f in files:
        h.update(os.path.relpath(f, HERE).encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(fh.read())
    h.update(",".join(ARCHS).encode())
    return h.hexdigest()[:12]


def toolchain_key() -> str:
    """What else a build depends on: the nvcc found (path, size, modification time) and the
    CUTLASS include folder found, with the size and time of its version header and of the TMA
    header the bulk copy uses (kvkernels/_cuda.py names a just-in-time build after its hash,
    :func:`jit_lib_name`)."""
    exe = nvcc()
    parts = ["nvcc=none"]
    if exe is not None:
        st = os.stat(exe)
        parts = [f"nvcc={os.path.realpath(exe)}:{st.st_size}:{st.st_mtime_ns}"]
    try:
        inc = cutlass_include()
        parts.append(f"cutlass={inc}")
        if inc is not None:  # an in-place upgrade (pip install -U nvidia-cutlass) rewrites these
            for h in ("cutlass/version.h", "cute/arch/copy_sm90_tma.hpp"):
                try:
                    st = os.stat(os.path.join(inc, h))
                    parts.append(f"{h}:{st.st_size}:{st.st_mtime_ns}")
                except OSError:
                    parts.append(f"{h}:missing")
    except RuntimeError:
        parts.append("cutlass=invalid")
    return ";".join(parts)


def jit_lib_name() -> str:
    """File name of a just-in-time build in the sources' cache folder: one file per toolchain
    (``libkvkernels_cuda.<hash>.so``), so processes with different toolkits or CUTLASS installs
    sharing a cache never overwrite each other's build; a process without nvcc loads the newest."""
    import hashlib

    return f"libkvkernels_cuda.{hashlib.sha1(toolchain_key().encode()).hexdigest()[:12]}.so"


def cutlass_include() -> str | None:
    """Folder with the CuTe / CUTLASS headers, or None (see the module docstring)."""
    env = (os.environ.get("KVKERNELS_CUTLASS_INCLUDE") or "").strip()  # blank: unset, as every variable
    if env:
        if not os.path.isfile(os.path.join(env, "cute", "arch", "copy_sm90_tma.hpp")):
            raise RuntimeError(f"`KVKERNELS_CUTLASS_INCLUDE`: {env!r} holds no cute/arch/copy_sm90_tma.hpp")
        return env
    import importlib.util

    spec = importlib.util.find_spec("cutlass_library")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    inc = os.path.join(next(iter(spec.submodule_search_locations)), "source", "include")
    return inc if os.path.isfile(os.path.join(inc, "cute", "arch", "copy_sm90_tma.hpp")) else None


def command(out: str, archs=ARCHS, extra=()) -> list[str]:
    exe = nvcc()
    if exe is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    gen = []
    for a in archs:
        gen.append(f"-gencode=arch=compute_{a},code=sm_{a}")
    if "90" in archs:  # PTX too, so newer GPUs (sm_100, sm_120) JIT it instead of finding no code
        gen.append("-gencode=arch=compute_90,code=compute_90")
    inc = cutlass_include()
    if inc is not None:  # -isystem: CUTLASS's own host warnings are not ours to fail on
        gen += ["-isystem", inc, "-DKVK_HAVE_CUTE=1"]
    # --threads 0: the targets compile in parallel, one thread per core (25 -> 20 s on the 2-core
    # CPU host; every fresh GPU machine builds it once, in its first timed step)
    return [exe, "-O3", "-std=c++17", "-shared", "--threads", "0", "-Xcompiler", "-fPIC,-Wall,-Wextra,-Werror",
            "-Werror", "all-warnings", "-cudart", "shared", *gen, *extra, *SOURCES, "-o", out]


def build(out_dir: str, archs=ARCHS, verbose: bool = False, extra=(), lib_name: str = LIB) -> str:
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, lib_name)
    # unique per build, not per process: two threads (or two containers whose processes share a
    # pid and the cache folder) building at once must not write, then rename, the same file
    tmp = out + f".tmp.{os.getpid()}.{uuid.uuid4().hex}"
    cmd = command(tmp, archs, extra)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if verbose or r.returncode:
            sys.stderr.write(" ".join(cmd) + "\n" + r.stdout + r.stderr)
        if r.returncode:
            raise RuntimeError(f"nvcc failed ({r.returncode}):\n{r.stderr[-4000:]}")
        os.replace(tmp, out)  # atomic: a concurrent loader sees the old file or the new one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


if __name__ == "__main__":
    try:
        print(build(sys.argv[1] if len(sys.argv) > 1 else ".", verbose=True))
    except RuntimeError as exc:
        sys.exit(f"csrc/build.py: {exc}")
