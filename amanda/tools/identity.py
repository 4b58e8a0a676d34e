"""Identity instrumentation: a routine at all four points of every op.

Every routine returns its tensors unchanged, so outputs and gradients must stay
bit-identical to the uninstrumented run. Use it to check that instrumentation
itself changes nothing, and to measure the cost of routines on every op.
"""

from __future__ import annotations

import amanda


class IdentityTool(amanda.Tool):
    """Insert identity routines before/after every forward and backward op.

    Args:
        forward, backward: which ops get routines.
        portable: use a portable routine (:mod:`amanda.portable`) that graph
            backends lower natively as ``Identity`` ops; ``calls`` stays zero.

    Attributes:
        calls: how many times each kind of routine ran, by point name.
    """

    def __init__(self, forward=True, backward=True, portable=False):
        super().__init__()
        self.calls = {"before_op": 0, "after_op": 0,
                      "before_backward_op": 0, "after_backward_op": 0}
        if portable:
            # a routine without side effects: graph backends lower it natively
            # (Identity ops) instead of calling back into Python; nothing counts
            self.identity = _portable_identity
        if forward:
            self.add_inst_for_op(self.forward_analysis)
        if backward:
            self.add_inst_for_op(self.backward_analysis, backward=True)

    def forward_analysis(self, context):
        context.insert_before_op(self.identity, point="before_op")
        context.insert_after_op(self.identity, point="after_op")

    def backward_analysis(self, context):
        context.insert_before_backward_op(self.identity, point="before_backward_op")
        context.insert_after_backward_op(self.identity, point="after_backward_op")

    def identity(self, *tensors, point):
        self.calls[point] += 1
        return tensors


@amanda.portable.routine
def _portable_identity(*tensors, point):
    return [amanda.portable.identity(t) for t in tensors]


class AnalysisOnlyTool(amanda.Tool):
    """Analysis routines on every forward and backward op that record nothing.

    With the cache warm this measures what amanda costs on ops that carry no
    action. ``ops`` counts analysed forward ops, ``backward_ops`` backward ops.
    """

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.backward_ops = 0
        self.add_inst_for_op(self.forward_analysis)
        self.add_inst_for_op(self.backward_analysis, backward=True)

    def forward_analysis(self, context):
        self.ops += 1

    def backward_analysis(self, context):
        self.backward_ops += 1
