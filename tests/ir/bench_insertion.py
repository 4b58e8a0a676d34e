"""Times instrumenting every op of a ResNet50-size IR graph (not a test).

Run: ``python -m tests.ir.bench_insertion [num_ops] [repeats]``. It builds a synthetic
graph shaped like a lifted ResNet-50 (bottleneck blocks of conv/bn/relu with a
residual add, ~5k ops by default) and reports the median of ``repeats`` runs of:

* ``ir``: inserting one routine op before and one after every op with the
  insertion cursor (what `lower_actions` does per action), on a fresh copy;
* ``instrument``: ``amanda.instrument(graph, tool)`` with a tool that observes
  before and after every op (instrumentation pass + lowering, copy included).
"""

import statistics
import sys
import time

import amanda
from amanda.ir import Graph


def resnet_like(num_ops):
    """A chain of bottleneck blocks (3 x conv/bn/relu, residual add, relu)."""
    graph = Graph("resnet_like", namespace="test/1/graph")
    x = graph.add_input("x")
    while len(graph) < num_ops:
        skip = x
        for _ in range(3):
            weight = graph.create_op("Constant", [], name="w").outputs[0]
            x = graph.create_op("Conv", [x, weight], attrs={"strides": [1, 1]}).outputs[0]
            x = graph.create_op("BatchNormalization", [x]).outputs[0]
            x = graph.create_op("Relu", [x]).outputs[0]
        x = graph.create_op("Add", [x, skip]).outputs[0]
        x = graph.create_op("Relu", [x]).outputs[0]
    graph.set_outputs([x])
    return graph


def insert_around_every_op(graph):
    for op in graph:
        with graph.inserting_before(op):
            graph.create_op("amanda.routine", list(op.inputs), num_outputs=len(op.inputs))
        with graph.inserting_after(op):
            graph.create_op("amanda.routine", list(op.outputs), num_outputs=len(op.outputs))


class ObserveEverything(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        context.insert_before_op(self.observe)
        context.insert_after_op(self.observe)

    def observe(self, *tensors):
        return None


def _median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(num_ops=5000, repeats=3):
    graph = resnet_like(num_ops)
    copies = [graph.copy() for _ in range(repeats)]
    ir = _median_seconds(lambda: insert_around_every_op(copies.pop()), repeats)
    tool = ObserveEverything()
    whole = _median_seconds(lambda: amanda.instrument(graph, tool), repeats)
    print(f"{len(graph)} ops: ir insert before+after every op {ir:.3f} s; "
          f"amanda.instrument observe before+after every op {whole:.3f} s (median of {repeats})")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
