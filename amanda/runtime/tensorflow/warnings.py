"""TensorFlow graph mode: what a rewrite says about itself once (its floats
may differ from the plain graph's; ops inside function bodies that are not
points of their own). Called by `_GraphRewrite.refresh`.
"""

from __future__ import annotations

import warnings

from amanda.errors import NotBitExactWarning, NotInstrumentedWarning
from amanda.runtime.tensorflow.bodies import _ops_in_bodies
from amanda.runtime.tensorflow.hosting import _user_stacklevel


def _onednn_enabled():
    """Whether TensorFlow runs oneDNN's kernels (``TF_ENABLE_ONEDNN_OPTS``,
    read when TensorFlow starts)."""
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):   # a build without the query
        return True


def warn_inexact(self):
    """Say once that a rewrite's (``self``: a `_GraphRewrite`) copy's floats may be computed in another order
    than the plain graph's (docs/tensorflow.md, Bit-exactness).

    Grappler's arithmetic optimizer re-associates chains of ``Mul``/``Add``
    and its constant folding folds ``c1 * (c2 * x)``; a hosted routine
    between two ops of such a chain (even one that returns None) keeps
    them apart, so the last bits may differ. oneDNN's kernels (on by
    default on x86) fuse and order some computations (a convolution's
    backward, batch normalization) differently when routines sit between
    the ops. Portable routines are TF ops and Grappler sees through them.
    Nothing is said when the rewrites and oneDNN are off."""
    if self.warned_exact or not self.hosted or self.rewrites is None:
        return
    on = [name for name, enabled in self.rewrites().items() if enabled]
    onednn = _onednn_enabled()
    if not on and not onednn:
        return
    self.warned_exact = True
    causes = []
    if on:
        causes.append(f"Grappler's {' and '.join(on)} rewrite float expressions of the "
                      "plain graph that the routines keep apart")
    if onednn:
        causes.append("oneDNN's kernels fuse and order some ops (convolution backward, "
                      "batch normalization) differently when routines sit between them")
    warnings.warn(
        "amanda (TensorFlow): Python routines sit between the graph's ops; "
        f"{'; '.join(causes)}; so outputs may differ from an uninstrumented run in the "
        "last bits (more where training amplifies rounding, e.g. Adam on a gradient "
        "that is zero up to rounding), even with routines that return None. They were "
        "bit-identical in amanda's tests with the rewrites off "
        "(rewrite_options.arithmetic_optimization / "
        "constant_folding = OFF in the session config; "
        "tf.config.optimizer.set_experimental_options({'arithmetic_optimization': "
        "False, 'constant_folding': False}) for tf.function) and oneDNN off "
        "(TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow is imported), or with portable "
        "routines; one case is known where they are not (an AddN summing gradient "
        "terms that routines observed). See docs/tensorflow.md, Bit-exactness.",
        NotBitExactWarning, stacklevel=_user_stacklevel())

def warn_bodies(self, ir_graph):
    """Say, once per call op, that the ops in its function bodies are not
    points of their own (docs/tensorflow.md, Limits)."""
    calls = [(op, count) for op, count in _ops_in_bodies(ir_graph)
             if op.name not in self.warned_bodies]
    if not calls:
        return
    self.warned_bodies.update(op.name for op, _ in calls)
    listed = ", ".join(f"{op.name!r} ({op.type}, {count} ops)" for op, count in calls[:5])
    more = f" and {len(calls) - 5} more" if len(calls) > 5 else ""
    warnings.warn(
        f"amanda (TensorFlow): {sum(c for _, c in calls)} ops inside the function "
        f"bodies of {len(calls)} call op(s) are not instrumented one by one; only the "
        f"call ops are points: {listed}{more}. See docs/tensorflow.md, Limits.",
        NotInstrumentedWarning, stacklevel=_user_stacklevel())


def warn_v1_bare(self):
    """Say once that routines selecting no tensor in a graph with v1 control
    flow may be skipped (docs/tensorflow.md, Limits): they are tied to their
    op by control edges only and cannot be a run's targets there, and
    Grappler's rewrites remove ops (``Neg(Neg(x))``) with their control
    edges (a counter before each of eight negations in a v1 ``cond`` branch
    ran 0 times). Nothing is said when those rewrites are off."""
    if self.warned_v1_bare or not self.v1_bare or self.rewrites is None:
        return
    on = [name for name, enabled in self.rewrites().items() if enabled]
    if not on:
        return
    self.warned_v1_bare = True
    warnings.warn(
        "amanda (TensorFlow): routines that select no tensor (inputs=[], outputs=[], or "
        "an op without tensors) in a graph with v1 control flow are tied to their op by "
        f"control edges only, and Grappler's {' and '.join(on)} may remove the op with "
        "its edges: such a routine then does not run though the op's value is computed. "
        "Turn those rewrites off (rewrite_options.arithmetic_optimization / "
        "constant_folding = OFF in the session config) or select a tensor. See "
        "docs/tensorflow.md, Limits.",
        NotInstrumentedWarning, stacklevel=_user_stacklevel())

