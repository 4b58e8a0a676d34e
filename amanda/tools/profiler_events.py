"""What the op profiler records: :class:`OpInfo` (one instrumented op) and
the constants naming phases and ranges, shared by the profiler
(:mod:`amanda.tools.profiler`), its Chrome trace and timeline
(:mod:`amanda.tools.profiler_trace`) and its kernel breakdown
(:mod:`amanda.tools.profiler_kernels`).
"""

from __future__ import annotations

__all__ = ["ACCUMULATE_GRAD", "BACKWARD", "FORWARD", "RANGE_PREFIX", "OpInfo"]

#: The type under which PyTorch's ``AccumulateGrad`` nodes (a leaf's gradient
#: added into its ``.grad``) are aggregated, apart from the forward op's type.
ACCUMULATE_GRAD = "accumulate_grad"

#: Prefix of the ``record_function`` ranges that enclose each op while
#: :meth:`OpProfiler.record_kernels` is active.
RANGE_PREFIX = "amanda.op#"

FORWARD, BACKWARD = "forward", "backward"
_PHASES = (FORWARD, BACKWARD)



class OpInfo:
    """What the profiler knows of one instrumented (forward or backward) op.

    Attributes:
        index: position in :attr:`OpProfiler.ops` (names its kernel range).
        phase: ``"forward"`` or ``"backward"``.
        name: the op's own name: the canonical type of a forward op
            (``linear``, ``conv2d``), the backward op's name for a backward
            op (``AddmmBackward0``; TF: the gradient op's type, ``Conv2DBackpropFilter``).
        type: the canonical type of the forward op (for a backward op, of the
            forward op owning it; its own type when no forward op owns it).
        op_id: the forward op's stable id (TF: the op name).
        backward_op_id: the backward op's stable id (backward only).
        module: dotted module path (PyTorch; "" for the root module), or the
            op's name scope (TF); None outside any module.
        shapes: input shapes at the op's first execution (gradient shapes for
            backward ops); None entries for non-tensors or unknown shapes.
        namespace: the context's namespace.
        producers: in graph mode, the keys of the ops this op waits for (data
            and control inputs); None in eager mode.
    """

    __slots__ = ("index", "phase", "name", "type", "op_id", "backward_op_id", "module",
                 "shapes", "namespace", "producers")

    def __init__(self, index, phase, name, op_type, op_id, backward_op_id, module, shapes,
                 namespace, producers=None):
        self.index = index
        self.phase = phase
        self.name = name
        self.type = op_type
        self.op_id = op_id
        self.backward_op_id = backward_op_id
        self.module = module
        self.shapes = shapes
        self.namespace = namespace
        self.producers = producers

    @property
    def key(self):
        """The op's id in its phase: op id (forward), backward op id (backward)."""
        return self.op_id if self.phase == FORWARD else self.backward_op_id

    def as_dict(self):
        return {name: getattr(self, name) for name in self.__slots__}

    def __repr__(self):
        return f"<OpInfo {self.phase} {self.name} id={self.key} module={self.module!r}>"
