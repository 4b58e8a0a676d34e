"""TensorFlow graph mode: a user session's instrumented copy and its session
(`_Shadow`), the Grappler rewrites that break bit-exactness, and the
per-amanda-session cache of copies (`_cached_per_session`, `current_rewrite`).
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.client import session as _tf_session
from tensorflow.python.util import nest

from amanda import controls
from amanda.errors import BackendError
from amanda.runtime.tensorflow_hosting import _surface
from amanda.runtime.tensorflow_probes import _SessionProbe, _original_run
from amanda.runtime.tensorflow_rewrite import _GraphRewrite
from amanda.runtime.tensorflow_variables import _VariableSync


class _Shadow:
    """The instrumented copy of one user session's graph, and its session."""

    def __init__(self, user_session, session):
        self.user_session = user_session
        self.user_graph = user_session.graph
        config = user_session._config
        self.rewrite = _GraphRewrite(self.user_graph, session, tf.Graph(),
                                     lambda: _session_rewrites(config))
        self.copy = self.rewrite.copy
        self.rewrite.observers.enabled = True   # observers may run after the run
        self.session = None
        self.sync = _VariableSync(self)
        self._elements = {}   # user fetch/feed element -> its counterpart in the copy

    def refresh(self, feed_dict):
        if self.user_graph.version != self.rewrite.version:
            if self.rewrite.refresh(_SessionProbe(self, feed_dict)):
                self._elements.clear()
        if self.session is None:
            self.session = tf.compat.v1.Session(graph=self.copy,
                                                config=getattr(self.user_session, "_config", None))
            self.session._amanda_shadow = True

    def close(self):
        """Free the shadow session (its user session was closed)."""
        if self.session is not None:
            self.session.close()
            self.session = None
            self.sync.forget()

    def run(self, fetches, feed_dict, options, run_metadata):
        """``Session.run`` of the copy, answering exactly as the user's
        session would: TensorFlow's own fetch handler flattens the fetches
        (variables, sparse tensors, nested structures) into tensors and ops
        of the user's graph and rebuilds its answer from their values."""
        feeds, fed = self._feeds(feed_dict)
        handler = _tf_session._FetchHandler(self.user_graph, fetches, fed)
        tensors = handler.fetches()
        mapped = [self._cached_fetch(t) for t in tensors]
        mapped += [self._cached_fetch(op) for op in handler.targets()]
        values = []
        if mapped:
            observers = self.rewrite.observers
            extra, targets, calls = (observers.plan(
                self.copy, mapped, frozenset(t.name for t in tensors),
                frozenset(t.name for t in feeds)) if observers.records else ((), (), ()))
            self.sync.writes.ran(mapped)
            with _surface():
                values = _original_run(self.session, [*mapped, *extra, *targets], feeds or None,
                                       options, run_metadata)
            if calls:   # observe-only routines, after the run (tensorflow_observe)
                observers.call(calls, values[len(mapped):len(mapped) + len(extra)])
        return handler.build_results(self.user_session, values[:len(tensors)])

    def _feeds(self, feed_dict):
        """The feeds for the copy, and the user's fed tensors with their
        values (a fetched feed is answered with the fed value, as TF does)."""
        if not feed_dict:
            return {}, {}
        feeds, fed = {}, {}
        for key, value in nest.flatten_dict_items(feed_dict).items():
            for subkey, subvalue in _expand_feed(key, value):
                tensor = self._cached(("feed", subkey), self._feed_tensor, subkey)
                feeds[self._cached(("copy", tensor.name), self._feed_key, tensor)] = subvalue
                try:
                    fed[tensor.ref()] = np.asarray(subvalue, tensor.dtype.as_numpy_dtype)
                except (TypeError, ValueError):
                    pass   # the run of the copy reports it, as TF would
        return feeds, fed

    def _cached_fetch(self, element):
        return self._cached(element, self._fetch, element)

    def _cached(self, key, compute, element):
        """Mapping a fetch costs graph lookups; a training loop fetches the
        same elements every run (the memo is cleared when the copy grows)."""
        try:
            return self._elements[key]
        except (KeyError, TypeError):   # TypeError: an unhashable element
            mapped = compute(element)
            try:
                self._elements[key] = mapped
            except TypeError:
                pass
            return mapped

    def _fetch(self, element):
        if isinstance(element, tf.Tensor):
            return self.rewrite.tensor(element.name)
        if isinstance(element, tf.Operation):
            return self.rewrite.operation(element.name)
        raise BackendError(f"amanda cannot map the fetch {element!r} to the instrumented graph")

    def _feed_tensor(self, key):
        try:
            return self.user_graph.as_graph_element(key, allow_tensor=True, allow_operation=False)
        except Exception as exc:   # TF's own wording and type
            raise TypeError(f"Cannot interpret feed_dict key as Tensor: {exc.args[0]}") from exc

    def _feed_key(self, tensor):
        return self.copy.get_tensor_by_name(tensor.name)


def _expand_feed(key, value):
    """``(tensor or name, value)`` pairs for one ``feed_dict`` entry, split as
    ``Session.run`` splits it (a SparseTensor key feeds three tensors)."""
    for kind, _, expand, _ in _tf_session._REGISTERED_EXPANSIONS:
        if isinstance(key, kind):
            return expand(key, value)
    raise TypeError(f"{key} in argument `feed_dict` has invalid type \"{type(key).__name__}\"")


_EXACTNESS_REWRITES = ("arithmetic_optimization", "constant_folding")


def _session_rewrites(config):
    """{rewrite: on?} for the Grappler rewrites that break bit-exactness,
    under a session's ``ConfigProto`` (None: TF's defaults, all on)."""
    from tensorflow.core.protobuf import rewriter_config_pb2
    options = config.graph_options.rewrite_options if config is not None else None
    if options is not None and options.disable_meta_optimizer:
        return dict.fromkeys(_EXACTNESS_REWRITES, False)
    off = rewriter_config_pb2.RewriterConfig.OFF
    return {name: options is None or getattr(options, name) != off for name in _EXACTNESS_REWRITES}


def _cached_per_session(session, kind, user_object, make):
    """The amanda session's instrumented stand-in for a user session or
    function, made on first use and dropped with the user object."""
    table = session.caches.get(kind)
    if table is None:
        table = session.caches[kind] = weakref.WeakKeyDictionary()
    made = table.get(user_object)
    if made is None:
        made = table[user_object] = make(user_object, session)
    return made


def current_rewrite(user_session):
    """The instrumented copy (``.copy`` is its ``tf.Graph``) standing for
    ``user_session`` in the innermost ``amanda.apply`` scope, or None before
    its first instrumented run. For inspection and tests."""
    sessions = controls.state.sessions
    table = sessions[-1].caches.get("tensorflow") if sessions else None
    shadow = table.get(user_session) if table is not None else None
    return shadow.rewrite if shadow is not None else None
