"""Render docs/figures/flops-breakdown.png: forward and backward FLOPs of one
training step of BERT-base and ResNet-50 by canonical op type, counted by
amanda's FLOPs profiler.

    .venv/bin/python docs/figures/flops_chart.py
"""

import os
import pathlib

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent


def breakdown(name):
    import amanda
    from amanda.models import load
    from amanda.tools.flops import FlopsProfiler
    workload = load(name)
    profiler = FlopsProfiler()
    with amanda.apply(profiler):
        workload.run()
    return profiler.by_type("forward"), profiler.by_type("backward")


def draw(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2))
    for ax, (title, (forward, backward)) in zip(np.atleast_1d(axes), results.items()):
        types = sorted(set(forward) | set(backward),
                       key=lambda t: -(forward.get(t, 0) + backward.get(t, 0)))[:8]
        y = np.arange(len(types))
        fwd = np.array([forward.get(t, 0) for t in types]) / 1e9
        bwd = np.array([backward.get(t, 0) for t in types]) / 1e9
        ax.barh(y - 0.2, fwd, height=0.4, label="forward")
        ax.barh(y + 0.2, bwd, height=0.4, label="backward")
        ax.set_yticks(y, [str(t) for t in types])
        ax.invert_yaxis()
        ax.set_xscale("log")   # matmuls/convs dominate by orders of magnitude
        ax.set_xlabel("GFLOPs per training step (log scale)")
        total = (sum(forward.values()) + sum(backward.values())) / 1e9
        ax.set_title(f"{title}: {total:.1f} GFLOPs")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {"BERT-base (seq 8)": breakdown("bert"), "ResNet-50 (224²)": breakdown("resnet50")}
    draw(results, HERE / "flops-breakdown.png")


if __name__ == "__main__":
    main()
