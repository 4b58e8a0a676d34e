"""TensorFlow graph mode: the driver (`TensorFlowGraphDriver`, `DRIVER`)
patching ``Session`` while any thread is inside ``apply``, and
`instrument_graph` (``amanda.instrument`` of a graph).
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.client import session as _tf_session
from tensorflow.python.eager.polymorphic_function import concrete_function as _concrete

from amanda import controls
from amanda.errors import BackendError
from amanda.runtime.tensorflow import eager as tensorflow_eager
from amanda.runtime.driver import Driver
from amanda.runtime.tensorflow.functions import _patched_call_flat
from amanda.runtime.tensorflow.probes import _hand_back, _original_call_flat, _original_run, _tls
from amanda.runtime.tensorflow.rewrite import _GraphRewrite
from amanda.runtime.tensorflow.shadow import _Shadow, _cached_per_session


def _activate(shadow):
    """Move the variable values into ``shadow`` if another place holds them.

    Nested scopes with other tools use other shadows of the same user
    session; the values go through the user session from one to the other.
    """
    live = _tls.live
    holder = live.get(shadow.user_session)
    if holder is shadow:
        return
    if holder is not None:
        holder.sync.out_of_shadow()
    shadow.sync.into_shadow()
    live[shadow.user_session] = shadow


def _retire(shadow):
    """Free a shadow that a new one replaces (``cache_disabled()``): its
    variable values go back to the user's session first, from where the new
    one takes them."""
    _hand_back(shadow.user_session)
    shadow.close()


def _patched_run(self, fetches, feed_dict=None, options=None, run_metadata=None):
    sessions = controls.state.sessions
    if not sessions or getattr(_tls, "live", None) is None or getattr(self, "_amanda_shadow", False):
        return _original_run(self, fetches, feed_dict, options, run_metadata)
    if controls.state.disabled:   # amanda.disabled(), or a rule running the user's graph
        _hand_back(self)
        return _original_run(self, fetches, feed_dict, options, run_metadata)
    shadow = _cached_per_session(sessions[-1], "tensorflow", self, _Shadow, _retire)
    shadow.refresh(feed_dict)
    _activate(shadow)
    return shadow.run(fetches, feed_dict, options, run_metadata)


def _instrumenting(session):
    """Whether a run of ``session`` on this thread executes an instrumented copy."""
    return (bool(controls.state.sessions) and getattr(_tls, "live", None) is not None
            and not getattr(session, "_amanda_shadow", False) and not controls.state.disabled)


_original_do_run = _tf_session.BaseSession._do_run
_original_call_tf_sessionrun = _tf_session.BaseSession._call_tf_sessionrun
_original_partial_run_setup = _tf_session.BaseSession.partial_run_setup
_original_partial_run = _tf_session.BaseSession.partial_run


def _patched_do_run(self, *args):
    # marks the low-level runs that Session.run itself makes (see below)
    _tls.do_run = getattr(_tls, "do_run", 0) + 1
    try:
        return _original_do_run(self, *args)
    finally:
        _tls.do_run -= 1


def _patched_call_tf_sessionrun(self, options, feed_dict, fetch_list, target_list,
                                run_metadata):
    """Callables of ``Session.make_callable`` (made inside the scope or
    before it) run here without going through ``Session.run``: their fetches
    are mapped back to the user's graph and run instrumented."""
    if getattr(_tls, "do_run", 0) or not _instrumenting(self):
        return _original_call_tf_sessionrun(self, options, feed_dict, fetch_list, target_list,
                                            run_metadata)
    if options is not None or run_metadata is not None or feed_dict:
        raise BackendError("a Session.make_callable callable with RunOptions, RunMetadata or "
                           "feeds of its own cannot run instrumented inside amanda.apply; "
                           "use Session.run")
    graph = self.graph
    tensors = [graph._get_tensor_by_tf_output(output) for output in fetch_list]
    targets = [graph._get_operation_by_tf_operation(op) for op in target_list]
    return _patched_run(self, tensors + targets)[:len(tensors)]


def _refusing(original):
    """``original`` (a partial-run method), refused where runs are instrumented."""

    def refused(self, *args, **kwargs):
        if _instrumenting(self):
            raise BackendError("Session.partial_run / partial_run_setup cannot run instrumented "
                               "inside amanda.apply (a partial run is a stateful handle on the "
                               "user's graph); use Session.run, or run it under "
                               "amanda.disabled()")
        return original(self, *args, **kwargs)

    return refused


_SESSION_PATCHES = {
    "run": (_original_run, _patched_run),
    "_do_run": (_original_do_run, _patched_do_run),
    "_call_tf_sessionrun": (_original_call_tf_sessionrun, _patched_call_tf_sessionrun),
    "partial_run_setup": (_original_partial_run_setup, _refusing(_original_partial_run_setup)),
    "partial_run": (_original_partial_run, _refusing(_original_partial_run)),
}


class TensorFlowGraphDriver(Driver):
    """Intercepts ``Session.run`` and ``tf.function`` calls while any thread
    is inside ``apply`` (the lifecycle: `amanda.runtime.driver.Driver`).

    Shadows (instrumented copies and their sessions) are cached per user
    session in the amanda session, so later scopes reuse the rewrite; variable
    values move into a shadow at its first run in a scope and back out when
    the thread's outermost scope ends.
    """

    def install(self):
        for name, (_, patched) in _SESSION_PATCHES.items():
            setattr(_tf_session.BaseSession, name, patched)
        _concrete.ConcreteFunction._call_flat = _patched_call_flat

    def uninstall(self):
        for name, (original, _) in _SESSION_PATCHES.items():
            setattr(_tf_session.BaseSession, name, original)
        _concrete.ConcreteFunction._call_flat = _original_call_flat

    def begin(self, session):
        _tls.live = {}   # user session -> the shadow holding its variable values
        tensorflow_eager.watch()   # ops executed eagerly are named, not silently missed

    def end(self, session):
        tensorflow_eager.unwatch()
        live, _tls.live = _tls.live, None
        for user_session, shadow in live.items():
            if getattr(user_session, "_closed", False):
                shadow.close()
            else:
                shadow.sync.out_of_shadow()


DRIVER = TensorFlowGraphDriver()


_EXPORTED = []   # rewrites whose GraphDefs were handed out: their callbacks stay registered


def instrument_graph(graph, session):
    """``amanda.instrument`` for a ``tf.Graph`` or ``GraphDef``: the GraphDef
    of an instrumented copy. Routines are ``tf.numpy_function`` callbacks
    registered in this process, so the result runs in this process only."""
    if isinstance(graph, tf.compat.v1.GraphDef):
        user = tf.Graph()
        with user.as_default():
            tf.import_graph_def(graph, name="")
        graph = user
    rewrite = _GraphRewrite(graph, session, tf.Graph())
    rewrite.refresh()
    _EXPORTED.append(rewrite)
    return rewrite.copy.as_graph_def()
