"""FLOPs-profiler overhead: amanda's ``FlopsProfiler`` beside ``FlopCounterMode``.

The workload is the eager suite's training step (forward, ``.sum()`` loss,
backward, ``zero_grad``) on the same models (BERT-base, ResNet-50, the small-op
2-layer GPT-2; see :mod:`benchmarks.eager`). Configurations, interleaved
round-robin in one process after warm-up rounds:

* ``vanilla``: no instrumentation, the baseline;
* ``FlopsProfiler``: ``amanda.apply(FlopsProfiler())`` (forward and backward
  counts; the tool object is created once, so its analysis cache is warm);
* ``FlopCounterMode``: ``torch.utils.flop_counter.FlopCounterMode(display=False)``
  entered around the step.

Ratios are median(config) / median(vanilla). The report also gives the FLOPs
each counted in one step (their conventions differ: FlopCounterMode counts
matrix products and convolutions, forward and backward; the profiler also
counts element-wise ops, norms, softmax and pooling, and charges backward
FLOPs to convolutions and matrix products only).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.utils.flop_counter import FlopCounterMode

import amanda
from amanda.tools.flops import FlopsProfiler
from benchmarks import eager, harness

NAME = "flops"
BASELINE = "vanilla"
CONFIG_NAMES = ("vanilla", "FlopsProfiler", "FlopCounterMode")
MODELS = eager.MODELS


def make_configs():
    """The configurations, in report order (the profiler is created once)."""
    profiler = FlopsProfiler()
    return [
        harness.Config("vanilla", contextlib.nullcontext),
        harness.Config("FlopsProfiler", lambda: amanda.apply(profiler)),
        harness.Config("FlopCounterMode", lambda: FlopCounterMode(display=False)),
    ]


def count_flops(model, inputs):
    """FLOPs of one step by each counter: ``{"FlopsProfiler": {...},
    "FlopCounterMode": n}`` (the profiler's forward/backward totals and its
    unknown op types)."""
    profiler = FlopsProfiler()
    with amanda.apply(profiler):
        eager.training_step(model, inputs)
    counter = FlopCounterMode(display=False)
    with counter:
        eager.training_step(model, inputs)
    return {"FlopsProfiler": {"forward": profiler.total("forward"),
                              "backward": profiler.total("backward"),
                              "unknown": sorted(profiler.unknown)},
            "FlopCounterMode": int(counter.get_total_flops())}


def benchmark_model(spec, repeats, warmup=2):
    """Benchmark one model in every configuration; return its raw result."""
    torch.manual_seed(0)
    model, inputs = spec.build()
    model.eval()
    flops = count_flops(model, inputs)
    configs = make_configs()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        start = harness.cpu_snapshot()
        times, failures = harness.interleaved_times(
            lambda: eager.training_step(model, inputs), configs, repeats, warmup=warmup,
            cleanup=lambda: model.zero_grad(set_to_none=True), number=spec.steps_per_run)
        other_load = harness.foreign_load(start, harness.cpu_snapshot())
    summary = harness.summarize(times, BASELINE)
    lower = ("FlopsProfiler" in summary and "FlopCounterMode" in summary
             and summary["FlopsProfiler"]["ratio"] < summary["FlopCounterMode"]["ratio"])
    return {"model": spec.name, "repeats": repeats, "warmup": warmup,
            "steps_per_run": spec.steps_per_run, "configs": summary, "failures": failures,
            "times_s": times, "flops": flops, "ours_lower": lower,
            "other_processes_cores": other_load}


def _cell(result, name):
    if name in result["failures"]:
        return "fails¹"
    stats = result["configs"][name]
    return f"{stats['ratio']:.3f} ({stats['spread']:.0%})"


def render(results, machine):
    """The markdown report: one row per model, notes, machine."""
    header = ("| model | vanilla ms | FlopsProfiler × | FlopCounterMode × | ours lower? | "
              "FLOPs/step: FlopsProfiler fwd + bwd | FlopCounterMode |")
    lines = ["# FLOPs profiler overhead", "",
             "Training step (forward, `.sum()` loss, backward, zero grads), models in `eval()`. "
             "Ratios are median(config) / median(vanilla) over interleaved runs in one process "
             "(in parentheses: the config's run-to-run noise, IQR / median). FlopsProfiler: "
             "`amanda.apply(FlopsProfiler())`, forward and backward counts; FlopCounterMode: "
             "`torch.utils.flop_counter.FlopCounterMode(display=False)`.", "",
             header, "|" + "---|" * (header.count("|") - 1)]
    notes = []
    for r in results:
        ours, theirs = r["flops"]["FlopsProfiler"], r["flops"]["FlopCounterMode"]
        cells = [r["model"], f"{r['configs'][BASELINE]['median_s'] * 1e3:.1f}",
                 _cell(r, "FlopsProfiler"), _cell(r, "FlopCounterMode"),
                 "yes" if r["ours_lower"] else "no",
                 f"{ours['forward'] / 1e9:.3f} G + {ours['backward'] / 1e9:.3f} G",
                 f"{theirs / 1e9:.3f} G"]
        lines.append("| " + " | ".join(cells) + " |")
        for name, error in r["failures"].items():
            notes.append(f"{r['model']}, {name}: `{harness.first_sentence(error)}`")
        if ours["unknown"]:
            notes.append(f"{r['model']}: op types without a formula (listed, not counted): "
                         + ", ".join(ours["unknown"]))
    lines.append("")
    lines.append("Timed runs per config: " + ", ".join(
        f"{r['model']} {r['repeats']} × {r['steps_per_run']} step(s) (+{r['warmup']} warm-up)"
        for r in results))
    lines.append(eager._load_line(results))
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    lines += ["", harness.machine_markdown(machine), ""]
    return "\n".join(lines)


def run(repeats=None, quick=False, specs=MODELS, log=print):
    """Run the FLOPs suite. Returns ``(markdown, raw)``.

    ``repeats`` overrides every model's repeat count; ``quick`` uses each
    model's short count and one warm-up round.
    """
    results = harness.benchmark_models(NAME, specs, CONFIG_NAMES, benchmark_model,
                                       repeats, quick, log)
    info = eager.machine()
    return render(results, info), {"suite": NAME, "machine": info, "results": results}
