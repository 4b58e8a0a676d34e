"""Compiled DDP: ``torch.compile(DistributedDataParallel(model))`` training
steps on 2 ranks (gloo, 127.0.0.1, CPU, one intra-op thread each) under
tools with backward routines (docs/distributed.md, "Compiled DDP").

Differential, on each rank: the same two SGD steps of the tutorial CNN,
eagerly (DDP uncompiled) and compiled (``aot_eager``) under the same tools:
a counting tool (before every forward op, before and after every backward
op), ``FlopsProfiler(backward=True)``, ``CoverageTool`` and
``Pruner(mask_grads=True)``. Two ways Dynamo compiles DDP: with
DDPOptimizer (the default ``optimize_ddp``), which cuts the CNN's graph in
two pieces (DDP's first bucket holds 1 MiB of parameters, the CNN has 1.1
MiB), and with ``optimize_ddp=False`` (one graph). The two processes run
both cases once (a module fixture); the tests read their results.
"""

import collections
import copy
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

import amanda  # noqa: E402
from amanda import distributed  # noqa: E402

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

pytestmark = pytest.mark.slow      # two processes, two compilations each: about 20 s

#: name -> torch._dynamo.config.optimize_ddp
CASES = {"ddp_optimizer": True, "no_ddp_optimizer": False}
STEPS = 2


class CountPoints(amanda.Tool):
    """Counts (op id, backward op id, point) executions: before every forward
    op, before and after every backward op."""

    def __init__(self):
        super().__init__()
        self.executions = collections.Counter()
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(self.backward_before, backward=True)
        self.add_inst_for_op(self.backward_after, backward=True, require_outputs=True)

    def forward(self, context):
        context.insert_before_op(self.seen, key=(context.get_op_id(), None, "before"))

    def backward_before(self, context):
        context.insert_before_backward_op(self.seen, key=self._key(context, "backward before"))

    def backward_after(self, context):
        context.insert_after_backward_op(self.seen, key=self._key(context, "backward after"))

    @staticmethod
    def _key(context, point):
        return context.get_op_id(), context.get_backward_op_id(), point

    def seen(self, *tensors, key):
        self.executions[key] += 1


def _step_under_tools(rank, compiled):
    """Two SGD steps of the CNN in DDP under the four tools; the model
    compiled (``torch.compile(ddp_model)``) or not. Returns what the tools
    and the run computed; ``gather_*`` are collectives (every rank)."""
    from amanda.models import tutorial_cnn
    from amanda.runtime.pytorch import compiled as pytorch_compiled
    from amanda.tools.coverage import CoverageTool
    from amanda.tools.flops import FlopsProfiler
    from amanda.tools.pruning import Pruner
    from torch._dynamo.utils import counters

    torch.manual_seed(0)                      # the same model on both ranks
    model = tutorial_cnn()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    run = torch.compile(ddp, backend="aot_eager") if compiled else ddp
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)               # each rank its own data
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([rank, 3 + rank])
    counting, flops, coverage = CountPoints(), FlopsProfiler(backward=True), CoverageTool()
    pruner = Pruner("unstructured", sparsity=0.5, mask_grads=True)
    fallbacks = copy.copy(pytorch_compiled.EAGER_FALLBACKS)
    compilations = []       # AOTAutograd compilations per step: one per piece of graph
    with warnings.catch_warnings():
        warnings.simplefilter("error", amanda.EagerFallbackWarning)
        for _ in range(STEPS):
            before = counters["aot_autograd"]["total"]
            optimizer.zero_grad()
            with amanda.apply(counting, flops, coverage, pruner):
                loss = torch.nn.functional.cross_entropy(run(x), y)
                loss.backward()
            optimizer.step()
            compilations.append(counters["aot_autograd"]["total"] - before)
    return {"executions": dict(counting.executions),
            "parameters": [p.detach().numpy().copy() for p in model.parameters()],
            "masks": {layer.op_id: np.asarray(layer.mask).tobytes()
                      for layer in pruner.layers.values()},
            "fallbacks": pytorch_compiled.EAGER_FALLBACKS - fallbacks,
            "aot_compilations": compilations,
            "flops": distributed.gather_flops(flops),
            "coverage": distributed.gather_coverage(coverage)}


def _worker(rank, nproc):
    """Each case eagerly and compiled, on this rank."""
    torch.set_num_threads(1)
    results = {}
    for name, optimize_ddp in CASES.items():
        torch._dynamo.reset()
        with torch._dynamo.config.patch(optimize_ddp=optimize_ddp):
            results[name] = {"eager": _step_under_tools(rank, compiled=False),
                             "compiled": _step_under_tools(rank, compiled=True)}
    return results


@pytest.fixture(scope="module")
def ranks():
    """Per rank: case -> {"eager", "compiled"} -> what `_step_under_tools` returned."""
    return distributed.run_local(_worker, 2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_ddp_step_runs_compiled_with_eagers_points(ranks, case):
    """No eager fallback, AOTAutograd compiled at the first step (one graph
    per DDPOptimizer piece) and nothing at the second, and on each rank the
    (op id, backward op id, point) executions are eager DDP's, the same on
    both ranks, backward points included."""
    for rank, results in enumerate(ranks):
        eager, compiled = results[case]["eager"], results[case]["compiled"]
        assert not compiled["fallbacks"] and not eager["fallbacks"]
        assert eager["aot_compilations"] == [0] * STEPS
        first, *later = compiled["aot_compilations"]
        if CASES[case]:
            assert first >= 2, "DDPOptimizer cut the graph"
        else:
            assert first == 1
        assert later == [0] * (STEPS - 1)
        assert compiled["executions"] == eager["executions"], rank
        assert {key[2] for key in eager["executions"]} == {"before", "backward before",
                                                           "backward after"}
        assert all(n == STEPS for n in eager["executions"].values())
    assert ranks[0][case]["compiled"]["executions"] == ranks[1][case]["compiled"]["executions"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_ddp_step_trains_as_eager_ddp(ranks, case):
    """The pruner's masks and the parameters after the steps (gradients
    masked, then all-reduced) are eager DDP's, bit for bit, and the same on
    both ranks."""
    for results in ranks:
        eager, compiled = results[case]["eager"], results[case]["compiled"]
        assert compiled["masks"] == eager["masks"] and eager["masks"]
        assert all((a == b).all() for a, b in zip(compiled["parameters"], eager["parameters"]))
    first, second = (results[case]["compiled"]["parameters"] for results in ranks)
    assert all((a == b).all() for a, b in zip(first, second))


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_ddp_merged_reports_are_eagers(ranks, case):
    """``gather_flops`` and ``gather_coverage`` on rank 0: consistent across
    ranks, backward rows included, and equal to eager DDP's merged reports."""
    results = ranks[0][case]
    for report in ("flops", "coverage"):
        merged, eager = results["compiled"][report], results["eager"][report]
        assert merged["ranks"] == 2 and merged["consistent"], merged["mismatches"]
        assert merged["total"] == eager["total"]
        assert merged["total"]["backward"]
    assert ranks[1][case]["compiled"]["flops"] is None     # the reports go to rank 0
