"""Framework-neutral pieces shared by every benchmark suite.

A suite (``benchmarks.eager`` today; TensorFlow or ONNX graph-mode suites
later) times a set of named configurations of the same workload, interleaved
in one process, and hands back a markdown report plus raw numbers. This module
holds what they all need: the interleaved timing loop, medians and ratios,
the machine description and writing results to ``benchmarks/results``.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class Config:
    """One way of running the workload, e.g. "vanilla" or "identity".

    ``enter`` returns a fresh context manager that wraps exactly one timed
    run; entering and leaving it is part of the time, as it would be for a
    user who opens the scope around every step.
    """

    def __init__(self, name, enter):
        self.name = name
        self.enter = enter


def first_line(exc):
    """``Type: message`` of an exception, first line only."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def first_sentence(text):
    """Text up to and including its first full stop followed by a space."""
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def run_once(step, config, number=1):
    """Run ``step`` ``number`` times, each inside a fresh ``config`` scope.

    Returns the mean seconds per step: averaging several short steps in one
    sample damps scheduler noise for small models.
    """
    start = time.perf_counter()
    for _ in range(number):
        with config.enter():
            step()
    return (time.perf_counter() - start) / number


def interleaved_times(step, configs, repeats, warmup=2, cleanup=None, number=1):
    """Time every config ``repeats`` times, round-robin within each repeat.

    Each repeat runs every config once; the starting config rotates from one
    repeat to the next so no config always runs first (right after a
    collection or a cold cache line). ``warmup`` rounds run first and are
    discarded. A config that raises is dropped and reported instead. A
    garbage collection precedes every run and is not timed. Each run is the
    mean of ``number`` consecutive steps (see :func:`run_once`).

    Returns ``(times, failures)``: seconds per run by config name, and the
    first line of the error of each failed config.
    """
    times = {c.name: [] for c in configs}
    failures = {}
    live = list(configs)

    def attempt(config, record):
        gc.collect()
        try:
            elapsed = run_once(step, config, number)
        except Exception as exc:  # a config that cannot run is a result too
            failures[config.name] = first_line(exc)
            times.pop(config.name, None)
            live.remove(config)
            if cleanup is not None:
                cleanup()
            return
        if record:
            times[config.name].append(elapsed)

    # Objects that exist now (torch, the model) are frozen out of the
    # collector's sight, so the collection before each run stays cheap.
    gc.collect()
    gc.freeze()
    try:
        for _ in range(warmup):
            for config in list(live):
                attempt(config, record=False)
        for r in range(repeats):
            order = live[r % len(live):] + live[:r % len(live)] if live else []
            for config in order:
                attempt(config, record=True)
    finally:
        gc.unfreeze()
    return times, failures


def summarize(times, baseline):
    """Median seconds and ratio to ``baseline``'s median, by config name."""
    medians = {name: statistics.median(ts) for name, ts in times.items() if ts}
    base = medians[baseline]
    return {name: {"median_s": m, "ratio": m / base, "spread": spread(times[name]),
                   "min_s": min(times[name]), "max_s": max(times[name]),
                   "runs": len(times[name])}
            for name, m in medians.items()}


def spread(values):
    """Interquartile range over the median: the run-to-run noise of a config."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(values)


def cpu_snapshot():
    """(wall s, busy CPU s of the whole machine, CPU s of this process).

    Machine CPU time comes from /proc/stat; it is None where that is missing.
    """
    busy = None
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    own = os.times()
    return time.perf_counter(), busy, own.user + own.system


def foreign_load(start, end):
    """Cores' worth of CPU used by *other* processes between two snapshots.

    Near 0 on a quiet machine; a value near the core count means the
    benchmark shared the CPU and its timings are noisy.
    """
    if start[1] is None or end[1] is None or end[0] <= start[0]:
        return None
    others = (end[1] - start[1]) - (end[2] - start[2])
    return max(others, 0.0) / (end[0] - start[0])


def cpu_model():
    """The CPU's model name from /proc/cpuinfo, or what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(**extra):
    """A dictionary describing the machine the benchmarks ran on."""
    info = {"cpu": cpu_model(), "cores": os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform()}
    info.update(extra)
    return info


def machine_markdown(info):
    """The machine description as one markdown line."""
    return "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items())


def benchmark_models(suite, specs, configs, benchmark_model, repeats=None, quick=False,
                     log=print):
    """Benchmark each model spec in turn: ``benchmark_model(spec, repeats,
    warmup=...)`` with ``repeats`` (when given) or the spec's own count
    (``quick_repeats`` with ``quick``, which also warms up once instead of twice).
    Returns the list of results."""
    results = []
    for spec in specs:
        n = repeats or (spec.quick_repeats if quick else spec.repeats)
        log(f"[{suite}] {spec.name}: {n} repeats x {len(configs)} configs ...")
        results.append(benchmark_model(spec, n, warmup=1 if quick else 2))
    return results


def write_results(name, markdown, raw, directory=RESULTS_DIR):
    """Write ``<name>.md`` and ``<name>.json`` under ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.md").write_text(markdown)
    (directory / f"{name}.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return directory / f"{name}.md", directory / f"{name}.json"

