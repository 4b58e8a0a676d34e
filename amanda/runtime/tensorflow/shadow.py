"""TensorFlow graph mode: a user session's instrumented copy and its session
(`_Shadow`), the Grappler rewrites that break bit-exactness, and the
per-amanda-session cache of copies (`_cached_per_session`, `current_rewrite`).
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.client import session as _tf_session
from tensorflow.python.util import nest

from amanda import controls
from amanda.errors import BackendError, NotBitExactWarning, user_stacklevel
from amanda.runtime.tensorflow.callables import _Callables
from amanda.runtime.tensorflow.hosting import _surface
from amanda.runtime.tensorflow.observe import _executed
from amanda.runtime.tensorflow.probes import _SessionProbe, _original_run
from amanda.runtime.tensorflow.rewrite import _GraphRewrite
from amanda.runtime.tensorflow.variables import _VariableSync


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
        # (copy version, {(fetch names, fed names): (session-state ops, random ops)})
        self._state = (None, {})
        self._warned_random = set()
        self._callables = _Callables()   # the runs without options, through callables

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
            self._callables = _Callables()
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
                frozenset(t.name for t in feeds), self.rewrite.emitter.gate, self.rewrite)
                if observers.records or observers.by_edges or observers.point_of
                else ((), (), ()))
            self._check_state(mapped, feeds)
            self.sync.writes.ran(mapped)
            with _surface():
                values = None
                if options is None and run_metadata is None:
                    n = len(tensors)
                    fetched = self._callables.run(self.session, [*mapped[:n], *extra], feeds,
                                                  [*mapped[n:], *targets])
                    if fetched is not None:   # laid out as Session.run's: None per op
                        values = [*fetched[:n], *[None] * (len(mapped) - n), *fetched[n:]]
                if values is None:
                    values = _original_run(self.session, [*mapped, *extra, *targets],
                                           feeds or None, options, run_metadata)
            if calls:   # observe-only routines, after the run (tensorflow_observe)
                observers.call(calls, values[len(mapped):len(mapped) + len(extra)])
        return handler.build_results(self.user_session, values[:len(tensors)])

    def _check_state(self, elements, feeds):
        """Refuse a run that would use state the user's session keeps and the
        copy's session cannot share (an iterator's position, a queue's or
        table's contents): the copy would start from its own, fresh state,
        repeating or skipping elements without a word. Warn, once per op
        set, where stateful random ops run: the copy draws from its own
        sequence. Only what the run executes counts: ancestors of its
        fetches, not above a fed tensor (see `session_state_ops`)."""
        copy = self.copy
        if self._state[0] != copy.version:
            self._state = (copy.version, {})
        key = (tuple(e.name for e in elements), tuple(sorted(t.name for t in feeds)))
        found = self._state[1].get(key)
        if found is None:
            found = self._state[1][key] = session_state_ops(elements, set(key[1]))
        held, random = found
        if held:
            raise BackendError(
                "amanda cannot run this Session.run instrumented: it executes "
                f"{', '.join(held)}, whose state (an iterator's position, a queue's or a "
                "table's contents) lives in your session, and the instrumented copy runs in "
                "a session of its own that carries over only variables; it would read "
                "from a fresh iterator, queue or table, repeating or skipping elements. "
                "Fetch those values under amanda.disabled() and feed them (e.g. "
                "batch = session.run(next_element) there, then feed_dict={next_element: "
                "batch}), or use a tf.function. See docs/tensorflow.md")
        new = [name for name in random if name not in self._warned_random]
        if new:
            self._warned_random.update(random)
            warnings.warn(
                f"amanda: stateful random ops ({', '.join(new)}) run in amanda's instrumented "
                "copy of the graph, in a session of its own: they draw from their own "
                "sequence, which starts afresh in the copy (as in a new session) and does "
                "not advance the one of your session. Draws differ from a plain run that "
                "continues your session's sequence; use stateless random ops "
                "(tf.random.stateless_*) or feed the draws for reproducible values. See "
                "docs/tensorflow.md", NotBitExactWarning, stacklevel=user_stacklevel(tf))

    def _feeds(self, feed_dict):
        """The feeds for the copy, and the user's fed tensors with their
        values (a fetched feed is answered with the fed value, as TF does)."""
        if not feed_dict:
            return {}, {}
        feeds, fed = {}, {}
        for key, value in nest.flatten_dict_items(feed_dict).items():
            for subkey, subvalue in _expand_feed(key, value):
                tensor = self._cached(("feed", subkey), self._feed_tensor, subkey)
                if not self.user_graph.is_feedable(tensor):   # the copy does not know
                    raise ValueError(f"Tensor {tensor.name} may not be fed.")
                feeds[self._cached(("copy", tensor.name), self._feed_key, tensor)] = subvalue
                try:
                    fed[tensor.ref()] = np.asarray(subvalue, tensor.dtype.as_numpy_dtype)
                except Exception:   # noqa: BLE001 (a tf.Tensor, an int too large, ...)
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


#: Substrings of the types of ops that make a resource whose state lives in
#: the session that runs them (iterators, queues, lookup tables,
#: accumulators, barriers); ``Anonymous*`` ones are made afresh by every run.
_SESSION_STATE = ("Iterator", "Queue", "HashTable", "Accumulator", "Barrier")

#: Stateful random ops: their kernel keeps a generator per session.
_RANDOM = frozenset({"RandomUniform", "RandomUniformInt", "RandomStandardNormal",
                     "TruncatedNormal", "ParameterizedTruncatedNormal", "Multinomial",
                     "RandomGamma", "RandomPoisson", "RandomPoissonV2", "RandomShuffle",
                     "RandomCrop"})


def _holds_session_state(op):
    return (not op.type.startswith("Anonymous") and any(k in op.type for k in _SESSION_STATE)
            and any(t.dtype == tf.resource or t.dtype._is_ref_dtype for t in op.outputs))


def session_state_ops(elements, fed):
    """``(ops holding session state, stateful random ops)``, names sorted,
    among the ops a run of ``elements`` (tensors and ops of one graph)
    executes (`tensorflow_observe._executed`: their ancestors through data
    and control inputs, not above a tensor named in ``fed``, and a fetched
    tensor that is fed runs nothing)."""
    if not elements:
        return [], []
    graph = elements[0].graph
    held, random = [], []
    for name in _executed(elements, fed):
        op = graph.get_operation_by_name(name)
        if op.type in _RANDOM:
            random.append(name)
        elif _holds_session_state(op):
            held.append(name)
    return sorted(held), sorted(random)


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


def _cached_per_session(session, kind, user_object, make, retire=None, analysed=True):
    """The amanda session's instrumented stand-in for a user session or
    function, made on first use and dropped with the user object.

    Inside ``amanda.cache_disabled()`` a new one is made for every run where
    making it runs the analysis (``analysed``; the one rule of every
    backend: analysis at every execution); it replaces the cached one, which
    ``retire`` frees first."""
    table = session.caches.get(kind)
    if table is None:
        table = session.caches[kind] = weakref.WeakKeyDictionary()
    made = table.get(user_object)
    if made is not None and analysed and not controls.state.cache:
        if retire is not None:
            retire(made)
        made = None
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
