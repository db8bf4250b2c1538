"""The package ships ``py.typed``: users' type checkers (vLLM and LMCache code bases run mypy) then
trust its annotations, so they must hold. mypy checks the package as it is installed
(``kvkernels.io`` is ``io/``, ...; setup.py's ``PACKAGE_DIR``) with the settings in pyproject's
``[tool.mypy]``, and any error fails the test."""

import ast
import os
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _package_dir() -> dict:
    """setup.py's ``PACKAGE_DIR`` (read, not imported: importing setup.py runs ``setup()``)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PACKAGE_DIR" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no PACKAGE_DIR")


def _installed_layout(dest: pathlib.Path) -> pathlib.Path:
    """A tree of symlinks laid out as the wheel installs the package."""
    pkgs = _package_dir()
    top = dest / "kvkernels"
    top.mkdir()
    for f in (ROOT / pkgs["kvkernels"]).iterdir():
        if f.name != "__pycache__":
            os.symlink(f, top / f.name)
    for name, folder in pkgs.items():
        parts = name.split(".")[1:]
        if len(parts) == 1:
            os.symlink(ROOT / folder, top / parts[0], target_is_directory=True)
        elif len(parts) > 1:  # nested: must sit where its parent's folder puts it
            parent = pkgs[".".join(["kvkernels", *parts[:-1]])]
            assert pathlib.Path(folder) == pathlib.Path(parent) / parts[-1], (name, folder)
    return top


def test_the_package_ships_the_py_typed_marker():
    assert (ROOT / _package_dir()["kvkernels"] / "py.typed").is_file()


@pytest.mark.skipif(not (ROOT / "setup.py").is_file(), reason="needs the source tree")
def test_mypy_finds_no_error_in_the_package_nor_in_typical_user_code(tmp_path):
    """The package, and tests/typing_usage.py: what the docs tell users to write must type-check
    (a ``Mapping[Hashable, object]`` parameter refused every ``dict[str, ...]`` a connector passes)."""
    api = pytest.importorskip("mypy.api", reason="mypy is in the [test] extra")
    _installed_layout(tmp_path)
    shutil.copy(ROOT / "tests" / "typing_usage.py", tmp_path)
    cwd = os.getcwd()
    os.chdir(tmp_path)  # (mypy finds `-p kvkernels` from the current folder first)
    try:
        out, err, rc = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / ".mypy"),
                                "--python-executable", sys.executable, "--no-error-summary", "-p", "kvkernels",
                                "-m", "typing_usage"])
    finally:
        os.chdir(cwd)
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert rc == 0 and not errors and not err, "\n".join(errors[:60]) or out[-4000:] + err[-2000:]
