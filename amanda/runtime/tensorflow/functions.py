"""TensorFlow graph mode: ``tf.function`` calls run an instrumented copy of
the concrete function's graph (`_FunctionCopy`, `_patched_call_flat`).
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from amanda import controls
from amanda.errors import NotInstrumentedWarning
from amanda.runtime.tensorflow.hosting import _surface
from amanda.runtime.tensorflow.probes import _FunctionProbe, _original_call_flat, _tls
from amanda.runtime.tensorflow.rewrite import _GraphRewrite
from amanda.runtime.tensorflow.shadow import _EXACTNESS_REWRITES, _cached_per_session


def _function_rewrites():
    """The same for functions, from ``tf.config.optimizer``'s options."""
    options = tf.config.optimizer.get_experimental_options()
    if options.get("disable_meta_optimizer"):
        return dict.fromkeys(_EXACTNESS_REWRITES, False)
    return {name: options.get(name, True) for name in _EXACTNESS_REWRITES}


class _FunctionCopy:
    """An instrumented copy of a concrete function's graph, callable with the
    same flat inputs (captured variables are fed by handle: same state)."""

    def __init__(self, function, session):
        self.function = function
        self.wrapped = tf.compat.v1.wrap_function(lambda: None, [])
        self.rewrite = _GraphRewrite(function.graph, session, self.wrapped.graph,
                                     _function_rewrites)
        self.pruned = None

    def call(self, flat_inputs):
        probe = _FunctionProbe(self.function.graph, flat_inputs)
        if self.rewrite.refresh(probe) or self.pruned is None:
            graph = self.function.graph
            feeds = [self.rewrite.copy.get_tensor_by_name(t.name) for t in graph.inputs]
            fetches = [self.rewrite.tensor(t.name) for t in graph.outputs]
            # the function's side effects that no output depends on (the
            # assigns of TensorFlow's variable-initialising function, which
            # has no output; a step returning nothing) are its control
            # outputs: they are fetched as operations, or pruning drops them
            effects = [self.rewrite.copy.get_operation_by_name(op.name)
                       for op in graph.control_outputs]
            # callbacks only control edges tie to the outputs run as control
            # outputs too: Grappler may remove the ops those edges went
            # through (`_Observers.plan`, the same rule for Session.run)
            effects += _by_edges(self.rewrite, [*fetches, *effects], feeds)
            self.pruned = self.wrapped.prune(feeds, (fetches, effects))
            self.pruned._amanda_copy = True
        with _surface():
            return self.pruned(*flat_inputs)[0]


def _by_edges(rewrite, elements, feeds):
    """The copy's ops that a run of ``elements`` with ``feeds`` fed must
    have as control outputs: the ops whose points run without them being
    needed (`whole_points`), then the callbacks in `_Observers.by_edges`
    it executes, in name order."""
    from amanda.runtime.tensorflow.observe import whole_points
    executed, forced, _ = whole_points(rewrite, elements, frozenset(t.name for t in feeds))
    copy = rewrite.copy
    ops = forced + [copy.get_operation_by_name(name)
                    for name in sorted(rewrite.observers.by_edges & executed)]
    named = {op.name for op in elements if hasattr(op, "node_def")}
    return [op for op in dict.fromkeys(ops) if op.name not in named]


def _patched_call_flat(self, tensor_inputs, captured_inputs):
    sessions = controls.state.sessions
    if (not sessions or controls.state.disabled or getattr(_tls, "live", None) is None
            or getattr(self, "_amanda_copy", False) or not tf.executing_eagerly()):
        return _original_call_flat(self, tensor_inputs, captured_inputs)
    if _xla_compiled_function(self):
        # XLA compiles the whole call, and no Python routine can run in an
        # XLA cluster: it runs as it is (as a body XLA compiles does), and
        # amanda says so once per function and scope
        _cached_per_session(sessions[-1], "tensorflow_xla_functions", self, _warn_xla_function,
                            analysed=False)
        return _original_call_flat(self, tensor_inputs, captured_inputs)
    copy = _cached_per_session(sessions[-1], "tensorflow_functions", self, _FunctionCopy)
    flat = copy.call(list(tensor_inputs) + list(captured_inputs))
    return self.function_type.pack_output(flat)


def _xla_compiled_function(function):
    """Whether TF compiles the concrete function's call with XLA
    (``tf.function(jit_compile=True)``)."""
    value = getattr(function, "_attrs", {}).get("_XlaMustCompile")
    return bool(getattr(value, "b", value))


def _warn_xla_function(function, session):
    from amanda.runtime.tensorflow.hosting import _user_stacklevel
    name = function.name.decode() if isinstance(function.name, bytes) else function.name
    warnings.warn(
        f"amanda (TensorFlow): {name!r} is compiled by XLA (jit_compile=True) and runs "
        "as it is, without points: a Python routine cannot run inside an XLA cluster, and "
        "running its ops one by one instead would change its results. Call a function without "
        "jit_compile to instrument it. See docs/tensorflow.md, Limits.",
        NotInstrumentedWarning, stacklevel=_user_stacklevel())
    return True
