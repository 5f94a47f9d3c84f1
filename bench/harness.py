"""The one benchmark harness every script in bench/ uses.

Timing: medians from ``sits_lora.utils.timing`` (on a GPU ``triton.testing.do_bench``: CUDA events,
warm-up first, many repeats), for forward, backward and full (forward + backward); peak memory from
the CUDA allocator. Results: rows of dicts written as JSON and CSV with the GPU name, versions and
git revision, so a number in the README can always be traced to a file and the command that made it.

Every script's rows also go, appended, to one file of one schema in the output folder, ``results.jsonl``
(``RESULTS_SCHEMA``): a line per row with the script and its suite, the machine, the versions, the revision
and the row's host share, so runs of several scripts, machines and revisions read as one table
(``python -m bench tools report OUT/results.jsonl``).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import subprocess
import sys
import uuid
from typing import Callable, Iterable, Optional

import torch

from sits_lora.utils.timing import median_seconds

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS_LOG = "results.jsonl"
RESULTS_SCHEMA = 1
MACHINE_KEYS = ("gpu", "cpu", "cpu_cores")
RUN_ID = uuid.uuid4().hex[:12]   # one process's lines in results.jsonl
VERSION_KEYS = ("torch", "cuda", "hip", "triton", "transformers", "peft", "sits_lora", "python")


def environment() -> dict:
    """GPU, versions and git revision: stamped on every result file (sits_lora.utils.env, shared with the CLI)."""
    from sits_lora.utils.env import environment as package_environment

    return package_environment()


def median_ms(fn: Callable[[], object], warmup_ms: int = 100, rep_ms: int = 400) -> float:
    """Median time of fn() in milliseconds: ``sits_lora.utils.timing.median_seconds`` (CUDA events via
    do_bench on a GPU; on the CPU a host timer, one warm-up call, then calls for ``rep_ms``, at least 3)."""
    return median_seconds(fn, warmup_ms=warmup_ms, rep_ms=rep_ms) * 1e3


def gpu_kernels_ms(fn: Callable[[], object], steps: int = 20, warmup: int = 3) -> Optional[dict]:
    """GPU time of one fn() call per kernel name, in milliseconds: the summed durations of the GPU activities
    (kernels, memsets, copies) the profiler records over ``steps`` calls, divided by ``steps``, largest first.
    None without a GPU.

    Unlike median_ms it leaves out the host: a ~1 ms layer step on the H200 host launches its kernels
    at 30-100 µs each, so a wall-clock or event timing mixes host and GPU time, with round-to-round
    spreads up to 25 % (bench/results/2026-11-30-h200-session5/callA). Gaps between kernels are not
    counted, so this is the kernels' cost, not the step's.
    """
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per_name: dict = {}
    gpu = torch.autograd.DeviceType.CUDA
    for event in prof.events():
        if event.device_type == gpu:
            per_name[event.name] = per_name.get(event.name, 0.0) + event.time_range.elapsed_us()
    if not per_name:  # a profiler build that attaches kernels to their launching ops only
        per_name = {e.key: e.self_device_time_total for e in prof.key_averages()
                    if getattr(e, "self_device_time_total", 0) > 0}
    return {name: us / steps / 1000 for name, us in sorted(per_name.items(), key=lambda kv: -kv[1])}


def peak_memory_gib(fn: Callable[[], object]) -> Optional[float]:
    """Peak allocated memory during fn(), in GiB above what was allocated before (None on the CPU)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def run_worker(cmd: list[str], timeout_s: Optional[float], identity: dict,
               echo: Callable[[str], bool] = lambda line: False, env: Optional[dict] = None) -> dict:
    """Run one worker process (a script's own ``--worker`` mode, one arm or run) and return the dict it printed
    last as ``RESULT {json}``; where it timed out or failed, ``identity`` with ``"error"``: the timeout, or the last
    line of its stderr. Lines of its output that ``echo`` selects are printed (a search's progress). ``env``: the
    process's environment (default: this one's)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {**identity, "error": f"timed out after {timeout_s:.0f} s"}
    for line in proc.stdout.splitlines():
        if echo(line):
            print(line, flush=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {**identity, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1][-300:]}
    return json.loads(lines[-1][len("RESULT "):])


def host_share(row: dict) -> Optional[float]:
    """The host's time to issue the step over the step's time (each the median of the repeats): near 1, the arm
    waits on its host, not its GPU, and its ratios follow the host's speed. None where the host was not timed."""
    host, step = row.get("host_s"), row.get("step_s")
    return host / step if host and step else None


def suite_of(script: str) -> Optional[str]:
    """The suite ``python -m bench`` lists the script under (bench/suites.py), or None."""
    if HERE not in sys.path:   # harness is loaded by path in the tests, beside the scripts that add bench/
        sys.path.insert(0, HERE)
    from suites import SUITES

    return next((suite for suite, scripts in SUITES.items() if script in scripts), None)


def log_rows(script: str, result: str, rows: list[dict], out_dir: str, env: dict) -> str:
    """Put ``rows`` in <out_dir>/results.jsonl, one line each in the one schema every script shares; return the
    path. Lines of other runs (scripts, machines, revisions) stay; this process's earlier lines for ``result`` are
    replaced, so a script that rewrites its results as rows come in (progress kept on interruption) leaves its
    latest rows once. A lock on the folder orders processes writing to it."""
    import fcntl

    path = os.path.join(out_dir, RESULTS_LOG)
    stamp = {"schema": RESULTS_SCHEMA, "run": RUN_ID, "script": script, "suite": suite_of(script), "result": result,
             "date": env.get("date"), "revision": env.get("git_revision"),
             "machine": {k: env.get(k) for k in MACHINE_KEYS}, "versions": {k: env.get(k) for k in VERSION_KEYS}}
    folder = os.open(out_dir, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        kept = []
        if os.path.exists(path):
            with open(path) as f:
                kept = [text for text in f if text.strip() and not _same_run_and_result(text, result)]
        fresh = [json.dumps({**stamp, "host_share": host_share(row), "row": row}, default=str) + "\n" for row in rows]
        with open(path + ".tmp", "w") as f:
            f.writelines(kept + fresh)
        os.replace(path + ".tmp", path)
    finally:
        os.close(folder)   # closing the descriptor releases the lock
    return path


def _same_run_and_result(text: str, result: str) -> bool:
    try:
        line = json.loads(text)
    except ValueError:
        return False
    return line.get("run") == RUN_ID and line.get("result") == result


def read_log(path: str) -> list[dict]:
    """The lines of a results.jsonl, oldest first; a line of another schema version is refused by name."""
    lines = []
    with open(path) as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            line = json.loads(text)
            if line.get("schema") != RESULTS_SCHEMA:
                raise ValueError(f"{path}:{number}: schema {line.get('schema')!r}, this reader knows "
                                 f"{RESULTS_SCHEMA}")
            lines.append(line)
    return lines


def _calling_script() -> str:
    """The bench script that called write_results (its file, not sys.argv: tests call scripts' main in process)."""
    frame = sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) == os.path.abspath(__file__):
        frame = frame.f_back
    return os.path.splitext(os.path.basename(frame.f_code.co_filename))[0] if frame else "unknown"


def write_results(name: str, rows: list[dict], out_dir: str, extra: Optional[dict] = None) -> tuple[str, str]:
    """Write rows to <out_dir>/<name>.json (with the environment) and <name>.csv, and put them in
    <out_dir>/results.jsonl (``log_rows``); return the JSON and CSV paths."""
    os.makedirs(out_dir, exist_ok=True)
    env = environment()
    json_path = os.path.join(out_dir, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump({"environment": env, **(extra or {}), "rows": rows}, f, indent=2)
    csv_path = os.path.join(out_dir, f"{name}.csv")
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys + ["gpu", "torch", "triton", "git_revision"])
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **{k: env[k] for k in ("gpu", "torch", "triton", "git_revision")}})
    log_rows(_calling_script(), name, rows, out_dir, env)
    return json_path, csv_path


def print_table(rows: Iterable[dict], columns: list[str]) -> None:
    rows = list(rows)
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:,.0f}"
    return "" if v is None else str(v)


@contextlib.contextmanager
def png(path: str, figsize=(6, 3.5)):
    """Yields the axes of a figure written to ``path`` as a PNG on exit, or None (with a message) where
    matplotlib is missing: the GPU image may lack it, and the JSON / CSV carry every number anyway.
    matplotlib.figure.Figure, not pyplot: no global backend state, so it works headless."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"matplotlib is not installed: no {os.path.basename(path)}")
        yield None
        return
    fig = Figure(figsize=figsize)
    ax = fig.add_subplot()
    yield ax
    fig.tight_layout()
    fig.savefig(path, dpi=120)

