"""Build the CUDA backend (``libkvkernels_cuda.so``) with nvcc; no torch headers involved.

    python csrc/build.py OUT_DIR            # sm_80, sm_90, sm_90a
    python csrc/build.py --cutlass-subset SRC DEST   # only the CUTLASS headers the build reads
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
TMA_HEADER = "cute/arch/copy_sm90_tma.hpp"  # what marks a folder as the CuTe / CUTLASS headers


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


NVCC_ENV_FLAGS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")  # nvcc reads these: they change a build


def _nvcc_version(exe: str) -> str:
    """``nvcc --version``'s output: the toolkit behind ``exe`` even when ``exe`` is a wrapper
    script (``exec /usr/local/cuda-13.0/bin/nvcc "$@"``, as on the CPU CI machine), whose own
    size and time stay the same when the toolkit it calls changes."""
    try:
        r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
        return r.stdout.strip() if r.returncode == 0 else f"rc={r.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unrunnable: {type(exc).__name__}"


def toolchain_key() -> str:
    """What else a build depends on: the nvcc found (path, size, modification time, and its
    ``--version`` output: the toolkit behind a wrapper), the ``NVCC_PREPEND_FLAGS`` /
    ``NVCC_APPEND_FLAGS`` it would read, and the CUTLASS include folder found, with the size and
    time of its version header and of the TMA header the bulk copy uses (kvkernels/_cuda.py names
    a just-in-time build after its hash, :func:`jit_lib_name`)."""
    exe = nvcc()
    parts = ["nvcc=none"]
    if exe is not None:
        st = os.stat(exe)
        parts = [f"nvcc={os.path.realpath(exe)}:{st.st_size}:{st.st_mtime_ns}", f"version={_nvcc_version(exe)}"]
        parts += [f"{v}={os.environ[v]}" for v in NVCC_ENV_FLAGS if os.environ.get(v)]
    try:
        inc = cutlass_include()
        parts.append(f"cutlass={inc}")
        if inc is not None:  # an in-place upgrade (pip install -U nvidia-cutlass) rewrites these
            for h in ("cutlass/version.h", TMA_HEADER):
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
        if not os.path.isfile(os.path.join(env, TMA_HEADER)):
            raise RuntimeError(f"`KVKERNELS_CUTLASS_INCLUDE`: {env!r} holds no {TMA_HEADER}")
        return env
    import importlib.util

    spec = importlib.util.find_spec("cutlass_library")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    inc = os.path.join(next(iter(spec.submodule_search_locations)), "source", "include")
    return inc if os.path.isfile(os.path.join(inc, TMA_HEADER)) else None


def _nvcc_or_raise() -> str:
    exe = nvcc()
    if exe is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    return exe


def _gencode(archs) -> list[str]:
    gen = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    if "90" in archs:  # PTX too, so newer GPUs (sm_100, sm_120) JIT it instead of finding no code
        gen.append("-gencode=arch=compute_90,code=compute_90")
    return gen


def _cute_flags(inc: str | None) -> list[str]:
    # -isystem: CUTLASS's own host warnings are not ours to fail on
    return [] if inc is None else ["-isystem", inc, "-DKVK_HAVE_CUTE=1"]


def command(out: str, archs=ARCHS, extra=(), cutlass_inc: str | None = None) -> list[str]:
    """The nvcc command line of a build; ``cutlass_inc``: the CUTLASS include folder to build
    against (default: :func:`cutlass_include`'s)."""
    exe = _nvcc_or_raise()
    gen = _gencode(archs) + _cute_flags(cutlass_inc if cutlass_inc is not None else cutlass_include())
    # --threads 0: the targets compile in parallel, one thread per core (25 -> 20 s on the 2-core
    # CPU host; every fresh GPU machine builds it once, in its first timed step)
    return [exe, "-O3", "-std=c++17", "-shared", "--threads", "0", "-Xcompiler", "-fPIC,-Wall,-Wextra,-Werror",
            "-Werror", "all-warnings", "-cudart", "shared", *gen, *extra, *SOURCES, "-o", out]


def build(out_dir: str, archs=ARCHS, verbose: bool = False, extra=(), lib_name: str = LIB,
          cutlass_inc: str | None = None) -> str:
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, lib_name)
    # unique per build, not per process: two threads (or two containers whose processes share a
    # pid and the cache folder) building at once must not write, then rename, the same file
    tmp = out + f".tmp.{os.getpid()}.{uuid.uuid4().hex}"
    cmd = command(tmp, archs, extra, cutlass_inc)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if verbose or r.returncode:
            sys.stderr.write(" ".join(cmd) + "\n" + r.stdout + r.stderr)
        if r.returncode:
            raise RuntimeError(f"nvcc failed ({r.returncode}):\n{r.stderr[-4000:]}")
        # on disk before the rename: after a crash the name holds the whole file or none (a
        # rename that reached the disk before the data left a truncated library, which dlopen
        # maps and the process dies of SIGBUS on first touch; kvkernels/_cuda.py checks the size)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, out)  # atomic: a concurrent loader sees the old file or the new one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def cutlass_headers(inc: str, archs=ARCHS) -> list[str]:
    """The CuTe / CUTLASS headers under ``inc`` that a build of the sources reads, as paths relative
    to ``inc`` (``nvcc -M`` with the build's flags; on nvcc 13.0 its list is exactly the headers
    that the whole three-target build opens, checked with strace). ``RuntimeError`` when nvcc
    fails, e.g. on a header missing from ``inc``."""
    cmd = [_nvcc_or_raise(), "-std=c++17", *_gencode(archs), *_cute_flags(inc), "-M", *SOURCES]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"nvcc -M against {inc} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    import re

    root = os.path.realpath(inc)
    found = set()
    # make syntax: "target : dep dep \<newline> dep", a space in a path written "\ "
    for tok in re.split(r"(?<!\\)\s+", r.stdout.replace("\\\n", " ")):
        path = os.path.realpath(tok.replace("\\ ", " "))
        if path.startswith(root + os.sep):
            found.add(os.path.relpath(path, root))
    if TMA_HEADER not in found:
        raise RuntimeError(f"nvcc -M did not read {inc}/{TMA_HEADER}: not the headers the build uses")
    return sorted(found)


SUBSET_MANIFEST = "KVK_SUBSET"


def cutlass_subset(src: str, dest: str) -> list[str]:
    """Copy into the new folder ``dest`` only the headers of the CUTLASS include folder ``src``
    that the build reads (:func:`cutlass_headers`; with nvidia-cutlass 4.2: 47 files, 0.8 MB of
    its 26 MB), plus ``cutlass/version.h`` (part of :func:`toolchain_key`), and prove the copy
    whole by building the library against it. ``dest`` then works as ``KVKERNELS_CUTLASS_INCLUDE``
    for these sources; ``dest/KVK_SUBSET`` names what it was cut from. .ci/fetch_wheels.sh carries
    it to the GPU machine instead of the 6.4 MB wheel. Returns the files copied."""
    if os.path.lexists(dest):
        raise RuntimeError(f"{dest} exists: cutlass_subset makes a new folder")
    files = cutlass_headers(src)
    if os.path.isfile(os.path.join(src, "cutlass", "version.h")) and "cutlass/version.h" not in files:
        files.append("cutlass/version.h")
    tmp = dest + f".tmp.{os.getpid()}"
    try:
        for rel in files:
            os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
            shutil.copy2(os.path.join(src, rel), os.path.join(tmp, rel))
        with open(os.path.join(tmp, SUBSET_MANIFEST), "w") as f:
            f.write(f"cut from: {os.path.realpath(src)}\nsources: {source_key()}\nfiles: {len(files)}\n")
            f.writelines(rel + "\n" for rel in files)
        check = os.path.join(tmp, ".build-check")
        build(check, lib_name="check.so", cutlass_inc=tmp)  # the whole build, every target, against the cut alone
        shutil.rmtree(check)
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return files


USAGE = """usage: python csrc/build.py [OUT_DIR]            build the library into OUT_DIR (default .)
       python csrc/build.py --cutlass-subset SRC DEST   copy SRC's headers the build reads into DEST
       python csrc/build.py --check-cutlass INC         INC holds every CUTLASS header the build reads"""


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["--cutlass-subset"] and len(argv) == 3:
            files = cutlass_subset(argv[1], argv[2])
            size = sum(os.path.getsize(os.path.join(argv[2], f)) for f in files)
            print(f"{argv[2]}: {len(files)} CUTLASS headers, {size / 1e6:.2f} MB (the library builds against them)")
        elif argv[:1] == ["--check-cutlass"] and len(argv) == 2:
            print(f"{argv[1]}: holds the {len(cutlass_headers(argv[1]))} CUTLASS headers the build reads")
        elif len(argv) <= 1 and not (argv and argv[0].startswith("-")):
            print(build(argv[0] if argv else ".", verbose=True))
        else:
            print(USAGE, file=sys.stderr)
            return 2
    except RuntimeError as exc:
        print(f"csrc/build.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
