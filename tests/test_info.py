"""kvikio and nvCOMP wheels of either CUDA major: install hints and installed versions."""

import importlib
import importlib.metadata as md
import os

import pytest

from kvkernels import _wheels

info = importlib.import_module("kvkernels.info")  # (the package exports a function of that name)


@pytest.mark.parametrize("cuda,want", [("12.8", "cu12"), ("12", "cu12"), ("13.0", "cu13"), (None, "cu13"),
                                       ("", "cu13"), ("14.1", "cu13")])
def test_the_hint_names_the_wheel_of_torchs_cuda_major(cuda, want, monkeypatch):
    import torch

    if cuda is None:  # None: torch's own CUDA version, here a CPU build's
        monkeypatch.setattr(torch.version, "cuda", None)
    assert _wheels.suffix(cuda) == want
    h = _wheels.hint("kvikio", cuda)
    assert f"pip install kvikio-{want}" in h
    assert ("'.[gpu-cu12]'" if want == "cu12" else "'.[gpu]'") in h


def _extras() -> dict:
    """pyproject.toml's optional dependencies."""
    import pathlib

    try:
        import tomllib
    except ImportError:  # Python 3.10 (requires-python >= 3.10): the same parser as a package
        tomllib = pytest.importorskip("tomli")

    return tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]


def test_the_extras_the_hints_name_exist():
    extras = _extras()
    for major, extra in (("cu13", "gpu"), ("cu12", "gpu-cu12")):
        assert f"kvikio-{major}" in extras[extra] and f"nvidia-nvcomp-{major}" in extras[extra]


def test_the_extras_triton_floor_is_the_one_the_backend_checks():
    # an extra allowing an older triton than kvkernels.backends.MIN_TRITON installs one that the
    # backend then refuses (triton 3.2 could not compile the FP8 gather); the test extra may ask
    # for more (the interpreter's results), never pin one (PyPI's torch pins its own triton: a
    # pin here made the README's test install unresolvable)
    import re

    from kvkernels import backends

    extras = _extras()
    floors = {name: [re.fullmatch(r"triton>=([0-9.]+)", d) for d in deps if d.startswith("triton")]
              for name, deps in extras.items()}
    assert all(len(f) == 1 and f[0] for n, f in floors.items() if n in ("triton", "gpu", "gpu-cu12", "bench", "test"))
    got = {n: backends._version_tuple(f[0].group(1)) for n, f in floors.items() if f}
    assert {got[n] for n in ("triton", "gpu", "gpu-cu12", "bench")} == {backends.MIN_TRITON}, got
    assert got["test"] >= backends.MIN_TRITON


@pytest.mark.parametrize("installed,want", [({"nvidia-nvcomp-cu12": "6.0.0.12"}, "6.0.0.12"),
                                            ({"nvidia-nvcomp-cu13": "6.0.1"}, "6.0.1"),
                                            ({"nvidia-nvcomp": "5.1"}, "5.1"), ({}, None)])
def test_either_majors_installed_wheel_is_found(monkeypatch, installed, want):
    # info reported no nvCOMP version for a CUDA 12 install (it asked for the cu13 wheel only)
    def version(name):
        if name in installed:
            return installed[name]
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(_wheels.md, "version", version)
    assert _wheels.version("nvidia-nvcomp") == want


def test_info_reports_the_versions_through_either_wheel(monkeypatch):
    monkeypatch.setattr(info, "_probe", lambda module: (True, "ok"))
    monkeypatch.setattr(_wheels, "version", lambda base: {"kvikio": "26.10.0", "nvidia-nvcomp": "6.0.0.12"}[base])
    d = info.info()
    assert d["kvikio"] == "26.10.0" and d["nvcomp"] == "6.0.0.12"


def test_info_reports_every_malformed_variable(monkeypatch):
    """Found by review (2026-11-25): `kvkernels info` said nothing of malformed KVKERNELS_*
    values other than KVKERNELS_BACKEND, which `demo` and every `bench` refuse to start with."""
    for name in list(os.environ):
        if name.startswith("KVKERNELS_"):
            monkeypatch.delenv(name)
    assert info.info()["env_problems"] == []
    monkeypatch.setenv("KVKERNELS_MAX_CTAS", "abc")
    monkeypatch.setenv("KVKERNELS_IO_THREADS", "0")
    got = info.info()["env_problems"]
    assert len(got) == 2 and any("KVKERNELS_MAX_CTAS" in m for m in got) and any("KVKERNELS_IO_THREADS" in m for m in got)
