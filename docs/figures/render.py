"""Render the figures of docs/tools/graph-tracing.md and effective-path.md.

    .venv/bin/python docs/figures/render.py

Traces the tutorial CNN with amanda's graph tracing tool and draws its graph
with networkx + matplotlib (no Graphviz needed); where Graphviz's ``dot`` is
installed, also writes the SVG of the DOT export.
"""

import os
import pathlib
import shutil

import torch

import amanda
from amanda.models import tutorial_cnn
from amanda.tools.effective_path import EffectivePathTool
from amanda.tools.graph import GraphTracingTool, render_png

HERE = pathlib.Path(__file__).resolve().parent


def train_step_graph():
    torch.manual_seed(0)
    model = tutorial_cnn()
    tracer = GraphTracingTool()
    with amanda.apply(tracer):
        model(torch.rand(1, 3, 32, 32)).sum().backward()
    return tracer


def main():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tracer = train_step_graph()
    tracer.render_png(HERE / "cnn-forward.png", title="Tutorial CNN: forward ops of one step")
    tracer.render_png(HERE / "cnn-train-step.png", forward_only=False, dpi=80,
                      title="Tutorial CNN: forward and backward ops of one training step")
    if shutil.which("dot"):
        tracer.to_svg(HERE / "cnn-forward.svg", forward_only=True)

    torch.manual_seed(0)
    model, x = tutorial_cnn(), torch.rand(1, 3, 32, 32)
    tool = EffectivePathTool(theta=0.5)
    with torch.no_grad(), amanda.apply(tool):
        model(x)
    density = tool.paths[0].density()
    render_png(tool.tracer.graph, HERE / "cnn-effective-path.png", highlight=density,
               title="Effective path of one input (theta=0.5):\nshare of each op's outputs on it",
               label=lambda op: f"{op.type}\n{100 * density.get(op.name, 0):.1f}%")


if __name__ == "__main__":
    main()
