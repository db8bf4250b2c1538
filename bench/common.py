"""Shared benchmark utilities: timing, measured peaks, environment record, table/CSV/JSON/PNG output.

Timing on the GPU: ``triton.testing.do_bench`` (CUDA events, warm-up, median). On the CPU:
``time.perf_counter`` median of a few repetitions (CPU numbers only prove the script runs).
Every "% of peak" is against peaks measured in the *same run* (:func:`measure_peaks`).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import importlib.metadata as md
import json
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Callable

import torch

from kvkernels import config

_T0 = time.perf_counter()


# why a CPU run leaves variants out (the benches' skipped_variants say it in the same words)
NO_TRITON_ON_CPU = "no GPU, and TRITON_INTERPRET is off (set it to run the Triton kernels on CPU)"
NO_CUDA_BACKEND_ON_CPU = "no GPU (the CUDA C++ backend runs on CUDA devices only)"


def distinct(values):
    """``values`` in their order, each once (None stays None): a list flag given a value twice
    (``--layouts nhd nhd``) measured it twice and wrote rows with the same key and other numbers."""
    return None if values is None else list(dict.fromkeys(values))


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts and sizes (``--reps``, ``--chunks``, ``--blocks``, ...): an
    integer >= 1. Zero or a negative count is meaningless to every bench (``--reps 0`` used to
    report a false corruption in ``bench compress`` and an ``IndexError`` in ``bench store``)."""
    try:
        val = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if val < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer (>= 1), got {val}")
    return val


def check_dir(parser: argparse.ArgumentParser, directory: str, what: str) -> None:
    """``directory`` is, or can be created as, a folder this process can write in; else
    ``parser.error`` naming ``what`` (usage + one line, exit 2). Leaves nothing behind."""
    why = dir_problem(directory)
    if why:
        parser.error(f"{what}: {why}")


def dir_problem(directory: str) -> str | None:
    """Why ``directory`` cannot be used as a folder to write in (None: it can: it is one, or it
    can be created). Leaves nothing behind."""
    if not directory:
        return "expected a directory, got an empty path"
    if os.path.exists(directory):
        if not os.path.isdir(directory):
            return f"{directory!r} is not a directory"
        why = _cannot_write_in(directory)
        return f"{directory!r} is not writable ({why})" if why else None
    parent = os.path.dirname(os.path.abspath(directory))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot create {directory!r} ({parent!r} is not a directory)"
    why = _cannot_write_in(parent)
    return f"cannot create {directory!r} (no folder can be made in {parent!r}: {why})" if why else None


def _cannot_write_in(directory: str) -> str | None:
    """Why a folder cannot be made inside ``directory`` (None: it can). Tried, not asked of
    ``os.access``: root passes every access check, and file systems such as sysfs or a read-only
    mount refuse what the mode bits allow. The probe folder is removed at once."""
    import tempfile

    try:
        probe = tempfile.mkdtemp(prefix=".kvk-probe-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        os.rmdir(probe)
    except OSError:  # writable all the same; say where the stray folder is
        print(f"kvkernels bench: could not remove the probe folder {probe!r}", file=sys.stderr)
    return None


def bench_paths(parser: argparse.ArgumentParser, *, out: str | None = None, directory: str | None = None,
                scratch: bool = False) -> None:
    """Check a bench's folders before it measures anything, then create them: ``--out`` (results
    are written only at the end of a long run: a path that cannot take them lost the run), ``--dir``,
    or with ``scratch`` and no ``--dir`` ``KVKERNELS_BENCH_DIR`` when set. Every check runs before
    any folder is made, so a refused call leaves nothing behind. The benches write only into a
    fresh temporary folder inside the scratch folder (and remove only that folder)."""
    todo: list[tuple[str, str]] = []
    base = bench_base_dir() if scratch else None
    if directory is not None:
        todo.append((directory, "argument --dir"))
    elif base is not None:
        todo.append((base, "KVKERNELS_BENCH_DIR"))
    if out is not None:
        todo.append((out, "argument --out"))
    for d, what in todo:
        check_dir(parser, d, what)
    for d, what in todo:
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as exc:
            parser.error(f"{what}: cannot create {d!r}: {exc.strerror or exc}")


def bench_base_dir() -> str | None:
    """``KVKERNELS_BENCH_DIR`` (None when unset or blank: the system temp dir)."""
    return config.env_str("KVKERNELS_BENCH_DIR", "").strip() or None


def fresh_bench_dir(directory: str | None, prefix: str, what: str) -> str:
    """A new folder ``<prefix>*`` inside ``directory`` (default ``KVKERNELS_BENCH_DIR``, else the
    system temp dir; created when missing) that the caller alone writes into and removes: nothing
    already in ``directory`` is touched."""
    import tempfile

    base = directory if directory is not None else bench_base_dir()
    if base is not None:
        if os.path.exists(base) and not os.path.isdir(base):
            raise NotADirectoryError(f"{what}: {base!r} is not a directory")
        os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same bytes (any dtypes, flattened; on other devices, compared on the
    host). Compared as int64 words where both allow it: 2.5-3.5x faster than bytes on a CPU."""
    x, y = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    if x.device != y.device:
        x, y = x.cpu(), y.cpu()
    if x.numel() == y.numel() and x.numel() % 8 == 0 and x.data_ptr() % 8 == 0 and y.data_ptr() % 8 == 0:
        try:
            x, y = x.view(torch.int64), y.view(torch.int64)
        except RuntimeError:  # (a view that cannot be reinterpreted: compared as bytes)
            pass
    return torch.equal(x, y)


def poison(dst: torch.Tensor, want: torch.Tensor) -> None:
    """``dst[:want.numel()]`` := the complement of ``want`` (uint8): every byte differs from the
    expected one, so a checked call that writes nothing cannot pass on bytes an earlier call (or a
    reused allocation) left there. Done outside the timed region."""
    part = dst[: want.numel()]
    if part.device == want.device and part.dtype == want.dtype and part.shape == want.shape:
        torch.bitwise_not(want, out=part)  # no temporary (the store bench poisons GiBs per read)
    else:  # (a pinned host buffer poisoned from device bytes: through a temporary)
        part.copy_(torch.bitwise_not(want))


class Variants:
    """What a bench run could not measure: variants that failed (a check or an exception: their
    rows dropped, the others kept) and variants the machine cannot run. Each bench keeps one at
    module level; its results' meta lists both (``failed_variants``, ``skipped_variants``) and its
    ``main()`` exits 3 when a variant failed. The lists are cleared in place."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.skipped: list[str] = []

    def clear(self) -> None:
        self.failed.clear()
        self.skipped.clear()

    def skip(self, what: str, why: str, *, say: bool = True) -> None:
        """A variant left out because the machine cannot run it: said on stderr and in the meta."""
        self.skipped.append(f"{what}: {why}")
        if say:
            print(f"[bench] {what} skipped: {why}", file=sys.stderr)

    @contextmanager
    def guard(self, tag: str, rows: list | None = None):
        """One variant: an exception (a path never run on a GPU, an API the driver refuses, a failed
        byte check) is printed with its traceback, the rows it added to ``rows`` are dropped, it is
        named in ``failed``, and the bench goes on (one variant's error lost whole runs before)."""
        n = len(rows) if rows is not None else 0
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - reported, the bench goes on
            if rows is not None:
                del rows[n:]
            self.failed.append(f"{tag}: {type(exc).__name__}: {exc}")
            import traceback

            print(f"[bench] {tag} rows failed and were dropped (the other rows stand):\n{traceback.format_exc()}",
                  file=sys.stderr)
            if torch.cuda.is_available():
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001 - a sticky CUDA error: later rows will say so
                    pass

    def meta(self, *, partial: bool = False) -> dict:
        """The lists for a result file's meta (only those not empty; a partial file has both)."""
        m: dict = {"partial": True} if partial else {}
        if self.failed or partial:
            m["failed_variants"] = list(self.failed)
        if self.skipped or partial:
            m["skipped_variants"] = list(self.skipped)
        return m

    def exit_code(self, what: str = "variant") -> int:
        """3 (and the failures printed) when a variant failed, else 0."""
        if not self.failed:
            return 0
        print(f"# {len(self.failed)} {what}(s) failed, their rows dropped:\n#   " + "\n#   ".join(self.failed))
        return 3


def progress(row: dict) -> None:
    """One line per measured row on stderr, as it is measured: a run cut off by a time cap still
    shows how far it got (the tables and files are written at the end)."""
    keep = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
    print(f"[bench +{time.perf_counter() - _T0:6.1f}s] {keep}", file=sys.stderr, flush=True)


@contextmanager
def env(**values: str):
    """Set ``KVKERNELS_*`` variables for a block (kvkernels reads them at each call), then restore."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _git_state(root: str | None = None) -> tuple[str | None, bool | None]:
    """(commit, whether the tree has uncommitted changes) of the kvkernels checkout this script
    runs from; without git or a repository of its own (the device machine gets a copied tree; a
    wheel lives in site-packages), ``KVK_COMMIT`` (the hash, ``-dirty`` appended for a changed
    tree: set it in the device call), else (None, None). Git is asked only when ``root`` is the
    top of its repository: a wheel installed in a venv inside a user's own project recorded that
    project's commit."""
    import subprocess  # noqa: PLC0415

    given = config.env_str("KVK_COMMIT", "").strip()

    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        top = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             timeout=10)
        if top.returncode or os.path.realpath(top.stdout.strip()) != os.path.realpath(root):
            raise OSError("not the top of a git checkout")
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode:
            raise OSError("not a git checkout")
        st = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, timeout=10)
        return head.stdout.strip(), (bool(st.stdout.strip()) if st.returncode == 0 else None)
    except (OSError, subprocess.SubprocessError):
        if given:
            return given.removesuffix("-dirty"), given.endswith("-dirty")
        return None, None


def env_record(*, tiny: bool | None = None) -> dict:
    """GPU, versions, date, the commit and the command line, stored with every result file;
    ``tiny`` (where the bench has the mode): a tiny run's numbers prove the script runs, nothing
    more, also on a GPU."""
    cuda = torch.cuda.is_available()
    commit, dirty = _git_state()

    def ver(d):
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            return None

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": ver("triton"),
        "kvkernels": ver("kvkernels"),
        "nvidia-cutlass": ver("nvidia-cutlass"),  # headers of the CUDA backend's bulk path
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)",
        "sms": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
        "driver": _driver() if cuda else None,
        "commit": commit,
        "dirty": dirty,
        "argv": list(sys.argv),
        "tiny": tiny,
        # the library's own settings (backend, caps, FP8 quotient, bulk path...): a row's label
        # names what the bench asked for, these say what the environment changed under it
        "kvkernels_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVKERNELS_")},
    }


def _driver() -> str | None:
    try:
        import subprocess

        return subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        ).stdout.strip() or None
    except Exception:
        return None


def time_ms(fn: Callable[[], object], *, device: torch.device, reps: int = 20) -> float:
    """Median milliseconds of ``fn``. GPU: do_bench with events (warm-up included)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm-up (JIT, allocations)
    samples = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")


def start(tiny: bool, peak_nbytes: int | None = None) -> tuple[torch.device, bool, dict]:
    """A bench's first steps: the device (CUDA when there is one), whether the run is tiny (always on
    a machine without a GPU, said once), and the run's record (:func:`env_record`) with the peaks
    measured now (``meta["peaks"]``: over 1 MiB when tiny, else ``peak_nbytes``, default 1 GiB)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not tiny:
        print("[bench] no GPU: running tiny CPU sizes (numbers prove the script runs, nothing more)")
        tiny = True
    meta = env_record(tiny=tiny)
    meta["peaks"] = measure_peaks(device, 1 << 20 if tiny else (peak_nbytes or 1 << 30))
    return device, tiny, meta


def fp8_moved(qfmt, payload: int) -> int:
    """Bytes an FP8 quantizing gather (or dequantizing scatter) must move: the raw ``payload`` read
    (written) plus the codes and scales written (read), per region and K/V entry of ``qfmt`` (a
    :class:`kvkernels.QuantStagingFormat`); its bandwidth bound is this over the device-copy peak."""
    return payload + qfmt.num_regions * qfmt.num_kv * (qfmt.q_nbytes + qfmt.scale_nbytes)


def measure_peaks(device: torch.device, nbytes: int = 1 << 30) -> dict:
    """Measured ceilings: one-shot device copy (read + write bytes counted) and pinned D2H / H2D."""
    peaks: dict = {"copy_nbytes": nbytes}
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_(0, 255) if device.type == "cuda" else a.fill_(7)
    ms = time_ms(lambda: b.copy_(a), device=device, reps=5)
    peaks["d2d_ms"] = ms
    peaks["d2d_gbps"] = gbps(2 * nbytes, ms)  # read + write
    if device.type == "cuda":
        h = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        # best of three alternating rounds: on the H100 VM one H2D sample right after pinning read
        # 33.6 GB/s while the pipeline's own restore moved 44-50 GB/s in the same process
        d2h, h2d = [], []
        for _ in range(3):
            d2h.append(gbps(nbytes, time_ms(lambda: h.copy_(a, non_blocking=True), device=device)))
            h2d.append(gbps(nbytes, time_ms(lambda: a.copy_(h, non_blocking=True), device=device)))
        peaks["d2h_gbps"], peaks["h2d_gbps"] = max(d2h), max(h2d)
        peaks["d2h_samples"], peaks["h2d_samples"] = d2h, h2d
        del h
    else:
        peaks["d2h_gbps"] = peaks["h2d_gbps"] = None
    del a, b
    return peaks


def write_results(rows: list[dict], meta: dict, out_dir: str, stem: str) -> dict:
    """Write ``stem.csv`` and ``stem.json`` (rows + meta) under ``out_dir``; return the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"csv": os.path.join(out_dir, f"{stem}.csv"), "json": os.path.join(out_dir, f"{stem}.json")}
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    with open(paths["csv"], "w", newline="") as f:
        f.write("# " + json.dumps(meta, sort_keys=True) + "\n")
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, sort_keys=True)
    return paths


def format_table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"
        return "" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    line = "  ".join(c.rjust(w) for c, w in zip(cols, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


OUT_HELP = ("results folder: CSV, JSON and (with matplotlib) PNG (default ./bench_results; the committed results "
            "live in bench_results/<device>/)")
_SAID_NO_PNG: list[bool] = []


def no_matplotlib() -> None:
    """Say once per process that no PNG is written (a run without the ``bench`` extra)."""
    if not _SAID_NO_PNG:
        _SAID_NO_PNG.append(True)
        print("# no PNG: matplotlib is not installed (pip install 'kvkernels[bench]')", file=sys.stderr, flush=True)


def plot_bars(rows: list[dict], *, group: str, series: str, value: str, title: str, path: str, ylabel: str) -> str | None:
    """Grouped bar chart (PNG). Returns the path, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        no_matplotlib()
        return None
    groups = list(dict.fromkeys(r[group] for r in rows))
    names = list(dict.fromkeys(r[series] for r in rows))
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) * max(1, len(names)) / 2), 4.5))
    for k, name in enumerate(names):
        xs, ys = [], []
        for gi, g in enumerate(groups):
            v = [r[value] for r in rows if r[group] == g and r[series] == name and r.get(value) is not None]
            if v:
                xs.append(gi + k * width)
                ys.append(v[0])
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels(groups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish(rows: list[dict], meta: dict, paths: dict, *, out_dir: str, stem: str, plot: bool, case, value: str,
           ylabel: str, title: str, series: str = "method") -> dict:
    """Optional PNG (grouped by ``case(row)``, one bar per ``series``), the 'wrote' line, the result."""
    if plot:
        for r in rows:
            r["case"] = case(r)
        png = plot_bars([r for r in rows if r.get(value) is not None], group="case", series=series, value=value,
                        ylabel=ylabel, title=f"{title} - {meta['device']}", path=os.path.join(out_dir, f"{stem}.png"))
        if png:
            paths["png"] = png
    print("# wrote " + ", ".join(paths.values()))
    return {"rows": rows, "meta": meta, "paths": paths}
