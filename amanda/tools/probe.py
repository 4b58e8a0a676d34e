"""Probe: make intermediate tensors observable, e.g. inside onnxruntime.

onnxruntime returns only a model's declared outputs; getting at an
intermediate tensor normally means editing the graph. With a probe applied,
every run of a session created inside ``amanda.apply`` hands the selected
tensors to the probe, which keeps their values::

    probe = ProbeTool(op_types=["Conv"])
    with amanda.apply(probe):
        session = onnxruntime.InferenceSession(model_path)
    session.run(None, feeds)
    probe.values      # {tensor name: array} from that run

The probe is an ordinary tool (public API only), so it works on every backend
that hosts Python routines: the values are NumPy arrays in ONNX and TF graph
mode, ``torch.Tensor`` objects in PyTorch eager mode (detached copies).
"""

from __future__ import annotations

import amanda


class ProbeTool(amanda.Tool):
    """Record the values of selected op outputs (or inputs) at every run.

    An op is selected when it matches any of ``ops`` (op ids: node names in
    ONNX, operation names in TF), ``op_types`` (``get_op_name()``: ``Conv``,
    ``Conv2D``, ``conv2d``) or ``predicate(context)``; with no selector at
    all, every op is. Tensors are keyed by their name where the backend names
    them (ONNX, TF), else ``"<op id>:<position>"``.

    Args:
        ops: op ids to probe.
        op_types: op types to probe.
        tensors: tensor names to probe (whichever op produces them).
        predicate: ``predicate(context) -> bool`` selecting ops.
        inputs: probe the selected ops' inputs too.
        outputs: probe their outputs (default).
        history: keep every value (``self.history``), not only the last.

    Attributes:
        values: tensor key -> the value from its latest execution.
        history: tensor key -> list of values, when ``history`` is on.
        counts: tensor key -> how many times it was recorded.
    """

    def __init__(self, ops=None, op_types=None, tensors=None, predicate=None, inputs=False,
                 outputs=True, history=False):
        super().__init__()
        self.ops = set(ops or ())
        self.op_types = set(op_types or ())
        self.tensors = set(tensors or ())
        self.predicate = predicate
        self.probe_inputs = inputs
        self.probe_outputs = outputs
        self.keep_history = history
        self.values, self.history, self.counts = {}, {}, {}
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def clear(self):
        """Forget recorded values (e.g. between runs)."""
        self.values.clear()
        self.history.clear()
        self.counts.clear()

    def _selects_op(self, context):
        if not (self.ops or self.op_types or self.tensors or self.predicate):
            return True
        if context.get_op_id() in self.ops or context.get_op_name() in self.op_types:
            return True
        return self.predicate is not None and bool(self.predicate(context))

    def analyse(self, context):
        whole_op = self._selects_op(context)
        sides = []
        if self.probe_outputs:
            sides.append((context.get_outputs(), context.insert_after_op, "outputs"))
        if self.probe_inputs:
            sides.append((context.get_inputs(), context.insert_before_op, "inputs"))
        for values, insert, side in sides:
            for position, value in enumerate(values):
                if value is None:
                    continue
                key = getattr(value, "name", None)
                if not isinstance(key, str) or not key:
                    key = f"{context.get_op_id()}:{side}:{position}"
                if whole_op or key in self.tensors:
                    insert(self.record, [position], key=key)

    def record(self, value, key):
        """The instrumentation routine: keep a copy of ``value``."""
        value = _copy(value)
        self.values[key] = value
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.keep_history:
            self.history.setdefault(key, []).append(value)


def _copy(value):
    detach = getattr(value, "detach", None)
    if detach is not None:   # a torch tensor
        return detach().clone()
    copy = getattr(value, "copy", None)
    return copy() if copy is not None else value
