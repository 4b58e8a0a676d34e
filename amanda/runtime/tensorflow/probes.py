"""TensorFlow graph mode: what analysis routines see of the user's graph.

The contexts' backend (`TFGraphBackend`), `evaluate` and `current_session`
and the probes behind them, TensorFlow's own ``Session.run`` and
``_call_flat`` (taken once, at import) and the driver's per-thread state
(`_tls`: the shadows holding variable values, `_hand_back`).
"""

from __future__ import annotations

import threading

import tensorflow as tf
from tensorflow.python.client import session as _tf_session
from tensorflow.python.eager.polymorphic_function import concrete_function as _concrete

from amanda.passes.instrumentation import GraphBackend
from amanda.runtime import probe as _probe


NAMESPACE = f"tensorflow/{tf.__version__}/graph"
_original_run = _tf_session.BaseSession.run
_original_call_flat = _concrete.ConcreteFunction._call_flat


class TFGraphBackend(GraphBackend):
    """Contexts see the user's graph: ``get_op()`` is its ``tf.Operation``,
    ``get_inputs()`` its symbolic ``tf.Tensor`` objects."""

    namespace = NAMESPACE

    def __init__(self, tf_graph):
        super().__init__()
        self.tf_graph = tf_graph

    def raw_op(self, ir_op):
        return self.tf_graph.get_operation_by_name(ir_op.name)

    def values(self, ir_tensors):
        return [self._tensor(t) for t in ir_tensors]

    def _tensor(self, ir_tensor):
        if ir_tensor.producer is None:
            return None
        return self.tf_graph.get_operation_by_name(ir_tensor.producer.name).outputs[ir_tensor.index]


class _BodiesBackend(TFGraphBackend):
    """A gradient body's contexts: its own ops, and the forward body ops they
    differentiate, each looked up in the graph that holds it."""

    def __init__(self, tf_graphs):
        super().__init__(tf_graphs[0])
        self.tf_graphs = tf_graphs

    def raw_op(self, ir_op):
        for graph in self.tf_graphs:
            try:
                return graph.get_operation_by_name(ir_op.name)
            except KeyError:
                continue
        raise KeyError(ir_op.name)

    def _tensor(self, ir_tensor):
        if ir_tensor.producer is None:
            return None
        return self.raw_op(ir_tensor.producer).outputs[ir_tensor.index]


# -- values for analysis routines (the probes: amanda.runtime.probe) ---------------

_BACKEND = "tensorflow"


def current_session():
    """The user's ``tf.compat.v1.Session`` whose ``run`` is being instrumented.

    Only meaningful while analysis routines (or mapping rules) run: the
    session then holds the current variable values (amanda hands the shadow
    session's values back first if needed), and ``run`` on it executes the
    user's graph uninstrumented.

    Returns:
        The session, or None outside analysis and while a ``tf.function`` is
        being rewritten (use `evaluate` there).
    """
    probe = _probe.current(_BACKEND)
    return None if probe is None else probe.session()


def evaluate(tensors):
    """Values of tensors of the graph being rewritten, as NumPy arrays.

    Call it from an analysis routine or a mapping rule, e.g. to read a
    weight: ``evaluate(context.get_inputs()[1])``. The tensors are computed
    without instrumentation, from the current variable values and the inputs
    of the ``Session.run`` (its ``feed_dict``) or ``tf.function`` call being
    rewritten. Each call runs the graph once, so batch tensors in one call.

    Args:
        tensors: a ``tf.Tensor`` of the user's graph (what ``get_inputs()``
            and ``get_outputs()`` return), or a list of them.

    Returns:
        One array, or a list of arrays for a list.

    Raises:
        BackendError: called outside analysis in TensorFlow graph mode.
    """
    return _probe.evaluate(_BACKEND, tensors, "amanda.runtime.tensorflow.evaluate() works only "
                           "while analysis routines run on a TensorFlow graph")


def _probing(probe):
    return _probe.probing(_BACKEND, probe)


class _SessionProbe:
    """`evaluate` for a ``Session.run``: runs the user session uninstrumented
    with that run's feeds."""

    def __init__(self, shadow, feed_dict):
        self.shadow = shadow
        self.feed_dict = feed_dict

    def session(self):
        # the newest variable values may live in the shadow session; they are
        # only handed back when asked for, as that copies every variable
        _hand_back(self.shadow.user_session)
        return self.shadow.user_session

    def evaluate(self, tensors):
        return _original_run(self.session(), tensors, self.feed_dict or None)


class _FunctionProbe:
    """`evaluate` for a ``tf.function`` call: an uninstrumented copy of the
    function graph, pruned to the requested tensors, called with the call's
    inputs (variables are captured by handle: their current values)."""

    def __init__(self, function_graph, flat_inputs):
        self.function_graph = function_graph
        self.flat_inputs = flat_inputs
        self.plain = None

    def session(self):
        return None

    def evaluate(self, tensors):
        if self.plain is None:
            self.plain = tf.compat.v1.wrap_function(lambda: None, [])
            with self.plain.graph.as_default():
                tf.import_graph_def(self.function_graph.as_graph_def(), name="")
        graph = self.plain.graph
        feeds = [graph.get_tensor_by_name(t.name) for t in self.function_graph.inputs]
        pruned = self.plain.prune(feeds, [graph.get_tensor_by_name(t.name) for t in tensors])
        pruned._amanda_copy = True
        return [t.numpy() for t in pruned(*self.flat_inputs)]


# -- the driver's per-thread state ------------------------------------------------

_tls = threading.local()


def _hand_back(user_session):
    """Give ``user_session`` its newest variable values if a shadow holds
    them; the next instrumented run moves them into the shadow again."""
    live = getattr(_tls, "live", None)
    holder = None if live is None else live.pop(user_session, None)
    if holder is not None:
        holder.sync.out_of_shadow()
