"""The harness of ``tests/onnx/test_node_sweep_onnx.py``: onnx's own backend
node test cases (``onnx.backend.test.case.node.collect_testcases()``; the
onnx wheel ships no ``data/node`` directory, so models and inputs come from
the case definitions), each run in a plain onnxruntime session and under
amanda with three tools, outputs compared by difference.

``python -m tests.onnx.node_sweep_cases [NAME ...]`` runs the sweep (or the
named cases) and prints what failed and the time taken.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import sys
import time
import warnings

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, numpy_helper

import amanda
from amanda.tools.identity import IdentityTool

PROVIDERS = ["CPUExecutionProvider"]
ort.set_default_logger_severity(3)
RUNS = 2

#: element types onnxruntime's ``run`` cannot take or return as numpy arrays
EXOTIC = {getattr(TensorProto, n) for n in (
    "BFLOAT16", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ",
    "FLOAT8E8M0", "INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2") if hasattr(TensorProto, n)}


@functools.lru_cache(maxsize=None)
def cases(modules=None):
    """name -> onnx TestCase, sorted by name: every node case, or those of
    the case modules named (``("abs", "ai_onnx_ml.binarizer")``: importing
    a module of ``onnx.backend.test.case.node`` builds its cases)."""
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with np.errstate(all="ignore"):
            from onnx.backend.test.case import node
            if modules is None:
                node.collect_testcases()
            else:
                for module in modules:
                    importlib.import_module(f"onnx.backend.test.case.node.{module}")
    # (with modules: those cases and any built before in this process)
    return dict(sorted((case.name, case) for case in node._NodeTestCases))


# -- tools ---------------------------------------------------------------------------------

class ObserveTool(amanda.Tool):
    """Routines before and after every node that only count (return None);
    with ``SELECT`` set to ``[]`` they select no tensor."""

    SELECT = None

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        op = context.get_op_id()
        context.insert_before_op(self.look, inputs=self.SELECT, key=(op, "before"))
        context.insert_after_op(self.look, outputs=self.SELECT, key=(op, "after"))

    def look(self, *arrays, key):
        self.counts[key] += 1


class CountTool(ObserveTool):
    """Routines before and after every node that select no tensor."""

    SELECT = []


class Identity(IdentityTool):
    """IdentityTool that also counts per (op, point)."""

    def __init__(self):
        super().__init__(backward=False)
        self.counts = collections.Counter()

    def forward_analysis(self, context):
        op = context.get_op_id()
        context.insert_before_op(self.same, key=(op, "before"))
        context.insert_after_op(self.same, key=(op, "after"))

    def same(self, *tensors, key):
        self.counts[key] += 1
        return tensors


TOOLS = {"observe": ObserveTool, "identity": Identity, "count": CountTool}


# -- feeding and comparing -----------------------------------------------------------------

def _exotic(value_info):
    kind = value_info.type
    while True:
        which = kind.WhichOneof("value")
        if which == "tensor_type":
            return kind.tensor_type.elem_type in EXOTIC
        if which in ("sequence_type", "optional_type"):
            kind = getattr(kind, which).elem_type
            continue
        return False


def _ort_value(array):
    array = np.ascontiguousarray(array)
    elem = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
    if elem in EXOTIC:
        # a plain integer view of the same bytes (4-bit types: one per byte)
        raw = array.view(np.uint16 if array.dtype.itemsize == 2 else np.uint8)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw, elem)
    return ort.OrtValue.ortvalue_from_numpy(array)


class Feed:
    """How a case is run: ``run`` with numpy feeds, or ``run_with_ort_values``
    where an input or output has a type numpy cannot carry."""

    def __init__(self, case):
        model = case.model
        initializers = {i.name for i in model.graph.initializer}
        names = [i.name for i in model.graph.input if i.name not in initializers]
        self.ort_values = any(_exotic(v) for v in list(model.graph.input)
                              + list(model.graph.output))
        self.feeds = {}
        for name, value in zip(names, case.data_sets[0][0]):
            if value is None:
                continue
            if isinstance(value, TensorProto):
                value = numpy_helper.to_array(value)
            if isinstance(value, list):
                if self.ort_values:
                    raise NotImplementedError("a sequence input with an exotic type")
                self.feeds[name] = [np.asarray(v) for v in value]
            else:
                value = np.asarray(value)
                self.feeds[name] = _ort_value(value) if self.ort_values else value

    def run(self, session):
        if not self.ort_values:
            return [_canonical(v) for v in session.run(None, self.feeds)]
        outputs = session.run_with_ort_values(None, self.feeds)
        return [_ort_canonical(v) for v in outputs]


def _canonical(value):
    """A comparable form: (dtype, shape, bytes) or a list of them."""
    if value is None:
        return None
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    array = np.asarray(value)
    if array.dtype == object:
        return ("object", array.shape, array.tolist())
    return (str(array.dtype), array.shape, np.ascontiguousarray(array).tobytes())


def _ort_canonical(value):
    if not value.is_tensor():
        return ("non-tensor", value.data_type())
    size = value.tensor_size_in_bytes()
    data = ctypes.string_at(value.data_ptr(), size) if size else b""
    return (value.data_type(), tuple(value.shape()), data)


def _meta(value):
    if value is None or (isinstance(value, tuple) and value[0] == "non-tensor"):
        return value
    if isinstance(value, list):
        return [_meta(v) for v in value]
    return value[:2]


def _options(level, prepack=True):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    return options


#: per tool: the session options it is compared at
LEVELS = {"observe": (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, True),
          "identity": (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, False),
          "count": (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, False)}


def _has_bodies(model):
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for n in model.graph.node for a in n.attribute)


class NotPlain(Exception):
    """The case does not run in plain onnxruntime: not amanda's to test."""


def plain(case, feed, level, prepack):
    """The outputs of two plain sessions at these options and whether they
    agree (a nondeterministic op: only shapes and dtypes compare)."""
    data = case.model.SerializeToString()
    try:
        first = feed.run(ort.InferenceSession(data, _options(level, prepack),
                                              providers=PROVIDERS))
        second = feed.run(ort.InferenceSession(data, _options(level, prepack),
                                               providers=PROVIDERS))
    except Exception as error:  # noqa: BLE001  (not amanda's: the caller skips)
        raise NotPlain(f"{type(error).__name__}: {error}") from error
    return first, first == second


def check(case, tools=tuple(TOOLS)):
    """Runs one case (a TestCase); returns None (passed), raises NotPlain
    (skip), or returns the list of failures, each "tool: what"."""
    feed = Feed(case)
    model = case.model
    data = model.SerializeToString()
    nodes = len(model.graph.node)
    bodies = _has_bodies(model)
    failures = []
    references = {}
    for kind in tools:
        level, prepack = LEVELS[kind]
        if (level, prepack) not in references:
            references[(level, prepack)] = plain(case, feed, level, prepack)
        expected, deterministic = references[(level, prepack)]
        tool = TOOLS[kind]()
        try:
            with amanda.apply(tool), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                session = ort.InferenceSession(data, _options(level, prepack),
                                               providers=PROVIDERS)
                outputs = [feed.run(session) for _ in range(RUNS)]
        except Exception as error:  # noqa: BLE001  (a failure to report)
            failures.append(f"{kind}: {type(error).__name__}: {str(error)[:300]}")
            continue
        for got in outputs:
            if deterministic and got != expected:
                failures.append(f"{kind}: outputs differ from plain onnxruntime")
                break
            if not deterministic and _meta(got) != _meta(expected):
                failures.append(f"{kind}: output shapes/dtypes differ from plain onnxruntime")
                break
        before = {k[0]: c for k, c in tool.counts.items() if k[1] == "before"}
        after = {k[0]: c for k, c in tool.counts.items() if k[1] == "after"}
        if before != after:
            failures.append(f"{kind}: before-counts != after-counts")
        if bodies:
            if sum(before.values()) < nodes * RUNS:
                failures.append(f"{kind}: {sum(before.values())} node executions counted, "
                                f"fewer than {nodes} top-level nodes x {RUNS} runs")
        elif len(before) != nodes or set(before.values()) != {RUNS}:
            failures.append(f"{kind}: counted {len(before)} of {nodes} nodes, "
                            f"{sorted(set(before.values()))} times (of {RUNS} runs)")
    return failures or None


def sweep(names=None, out=sys.stdout):
    every = cases()
    names = names or list(every)
    results = {}
    start = time.perf_counter()
    for name in names:
        t = time.perf_counter()
        try:
            results[name] = check(every[name])
        except NotPlain as why:
            results[name] = f"SKIP {why}"
        except Exception as error:  # noqa: BLE001
            results[name] = [f"harness: {type(error).__name__}: {error}"]
        took = time.perf_counter() - t
        if results[name] and not isinstance(results[name], str):
            print(name, f"{took:.2f}s", results[name], file=out, flush=True)
        elif took > 2:
            print(name, f"slow {took:.2f}s", file=out, flush=True)
    skipped = sum(isinstance(r, str) for r in results.values())
    failed = sum(isinstance(r, list) for r in results.values())
    print(f"{len(names)} cases, {skipped} not run by plain onnxruntime, {failed} failed, "
          f"{time.perf_counter() - start:.0f}s", file=out)
    return results


if __name__ == "__main__":
    sweep(sys.argv[1:] or None)
