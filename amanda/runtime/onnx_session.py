"""The session driver: ``InferenceSession`` inside ``amanda.apply`` runs the
instrumented model.

`OnnxRuntimeDriver` patches ``InferenceSession.__init__`` while any thread is
inside a scope and restores it when the last one leaves. The patched
constructor instruments the model once per amanda session and model bytes
(`_instrumented`, cached by SHA-256), then builds the session on what it
needs: the user's bytes when nothing was recorded, the optimised model with
observe-only side branches (:mod:`amanda.runtime.onnx_observe`), or the
instrumented model with routines in its dataflow.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings

import onnx
import onnxruntime as ort

from amanda import controls
from amanda.errors import BackendError, NotInstrumentedWarning
from amanda.frontends.onnx import load_model, load_model_file
from amanda.passes.lower_actions import ROUTINE
from amanda.runtime.driver import Driver
from amanda.runtime.onnx_bodies import _bodies_host_routines
from amanda.runtime.onnx_host import _original_init, checked_session, run_methods, session_options
from amanda.runtime.onnx_instrument import _instrument
from amanda.runtime.onnx_lowering import lower
from amanda.runtime.onnx_observe import _fetch_for, _fetches, _NotSide, _SideBranches


def _model_bytes(source):
    """(bytes, ModelProto or None, whether onnxruntime may read the model
    from its file) of what ``InferenceSession`` was given."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), None, False
    if isinstance(source, (str, os.PathLike)):
        model, external = load_model_file(source)   # with external data, if any
        # onnxruntime saves the model it optimised from a file with external
        # data pointing at data files beside the saved copy, which do not
        # exist: such a model is handed to it as bytes (its data read in)
        return model.SerializeToString(), model, not external
    raise BackendError(f"amanda cannot instrument an InferenceSession created from a "
                       f"{type(source).__name__}")


class _Instrumented:
    """What a session inside ``apply`` runs for one model and tool set.

    Attributes:
        data: the model bytes to run when routines feed the model (or
            nothing was recorded: the user's bytes). When every routine only
            looks they are written only if the side branches cannot be
            attached (the lowered model is as large as the user's).
        callbacks: they host Python routines.
        inline: some Python routine's results flow back into the model.
        side: ``(lowered IR graph, user's ModelProto)`` when every routine
            only looks (see `_SideBranches`), else None.
        optimised: side-branch models by (optimisation level, providers).
        file: ``(path, size, mtime)`` of the file the model was read from, if
            any: onnxruntime optimises it from there while it is unchanged
            (no serialized copy of the model beside the loaded one).
    """

    def __init__(self, data, callbacks=False, inline=False, side=None):
        self._data = data
        self.callbacks = callbacks
        self.inline = inline
        self.side = side
        self.optimised = {}
        self.file = None

    def user_model(self):
        """What onnxruntime should read the user's model from: its file while
        unchanged, else its bytes."""
        if self.file is not None:
            path, size, mtime = self.file
            try:
                stat = os.stat(path)
            except OSError:
                stat = None
            if stat is not None and (stat.st_size, stat.st_mtime_ns) == (size, mtime):
                return path
        return self.side[1].SerializeToString()

    @property
    def data(self):
        if self._data is None:
            self._data = lower(self.side[0]).SerializeToString()
        return self._data


def _instrumented(session, source):
    """The `_Instrumented` model for ``source``, cached per amanda session by
    the SHA-256 of the model."""
    stat = os.stat(source) if isinstance(source, (str, os.PathLike)) else None
    data, model, from_file = _model_bytes(source)
    key = hashlib.sha256(data).hexdigest()
    cache = session.caches.setdefault("onnx", {})
    hit = cache.get(key) if controls.state.cache else None
    if hit is not None:
        return hit
    if model is None:
        model = load_model(data)
    else:   # read from a file: the bytes were only needed for the key
        data = None
    lowered, lowering = _instrument(model, session, callbacks=True)
    if lowered is None:
        hit = _Instrumented(data if data is not None else model.SerializeToString())
    elif lowering.side_only and lowering.uses_callbacks:
        # the optimised model with side branches is what runs (written per
        # optimisation level): no copy of the lowered model is kept
        del lowered, data
        hit = _Instrumented(None, True, lowering.inline, (lowering.top, model))
        if stat is not None and from_file:
            hit.file = os.fspath(source), stat.st_size, stat.st_mtime_ns
    else:
        del data
        hit = _Instrumented(lowered.SerializeToString(), lowering.uses_callbacks,
                            lowering.inline)
    cache[key] = hit
    return hit


# Options are mutated for the span of a session's creation (the optimised
# model's path, the optimisation level); sessions copy them when created.
_OPTIONS_LOCK = threading.Lock()


def _optimised_by_onnxruntime(data, options, providers, provider_options, kwargs):
    """The user's model (a path or bytes) as onnxruntime optimises it with
    these options."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="amanda-onnx-") as folder:
        path = os.path.join(folder, "optimised.onnx")
        with _OPTIONS_LOCK:
            saved = options.optimized_model_filepath, options.log_severity_level
            options.optimized_model_filepath = path
            # saving at level ALL warns that NCHWc layouts are machine-specific:
            # the file never leaves this process
            options.log_severity_level = 3
            try:
                _original_init(ort.InferenceSession.__new__(ort.InferenceSession), data,
                               options, providers, provider_options, **kwargs)
            finally:
                options.optimized_model_filepath, options.log_severity_level = saved
        return onnx.load(path)


def _timed(graph):
    """Whether a top-level routine of the lowered ``graph`` was recorded inside
    `hosted_observation` (a timer, `Action.in_run`): the session then hosts its
    observe-only routines inside the run, all of them, as the scope around its
    creation would."""
    return any(op.type == ROUTINE and getattr(op.attrs.get("action"), "in_run", False)
               for op in graph)


def _side_branch_model(hit, options, providers, provider_options, kwargs):
    """Bytes of the optimised model with the observe-only routines attached,
    cached per optimisation level and providers; None if a routine reads a
    tensor that cannot be recomputed (it then runs in the model's dataflow)."""
    graph, model = hit.side
    in_bodies = _bodies_host_routines(graph)
    fetch = not in_bodies and not _timed(graph) and _fetches(graph)
    key = (int(options.graph_optimization_level), repr(providers), repr(provider_options),
           fetch)
    found = hit.optimised.get(key)
    if found is None:
        optimised = _optimised_by_onnxruntime(hit.user_model(), options, providers,
                                              provider_options, kwargs)
        try:
            branches = _SideBranches(graph, model, optimised, fetch=fetch,
                                     eager=not fetch and not in_bodies)
            del optimised   # the branches own it now
            result = branches.model()
            data = result.SerializeToString()
            # observed weights: views over the bytes kept here, not copies
            branches.bind(data)
            found = data, branches.plan, branches.eager
        except _NotSide:
            found = b"", None, False
        hit.optimised[key] = found
    return found if found[0] else (None, None, False)


def _patched_init(self, path_or_bytes, sess_options=None, providers=None,
                  provider_options=None, **kwargs):
    sessions = controls.state.sessions
    if not sessions or controls.state.disabled:
        self._amanda_made = True     # plain on purpose (amanda.disabled()): nothing to say
        return _original_init(self, path_or_bytes, sess_options, providers, provider_options,
                              **kwargs)
    self._amanda_made = True
    hit = _instrumented(sessions[-1], path_or_bytes)
    if not hit.callbacks:
        return _original_init(self, hit.data, sess_options, providers, provider_options,
                              **kwargs)
    options = session_options(sess_options)
    data = plan = None
    eager = False
    if hit.side is not None:
        data, plan, eager = _side_branch_model(hit, options, providers, provider_options,
                                               kwargs)
    if data is not None:
        # the model is optimised already: optimising again could fuse the
        # side branches into it
        with _OPTIONS_LOCK:
            level, order = options.graph_optimization_level, options.execution_order
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            if eager:
                # hosted observers are listed right after their tensors'
                # producers: run nodes in that order (see _sort_nodes_eagerly)
                options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
            try:
                _original_init(self, data, options, providers, provider_options, **kwargs)
            finally:
                options.graph_optimization_level, options.execution_order = level, order
    else:
        if hit.inline and options.graph_optimization_level != \
                ort.GraphOptimizationLevel.ORT_DISABLE_ALL:
            warnings.warn(
                "amanda: Python routines that may replace tensors sit between the model's "
                "nodes; onnxruntime cannot fuse across them, so outputs may differ from the "
                f"plain model's in the last bits at {options.graph_optimization_level.name} "
                "(they are bit-identical at ORT_DISABLE_ALL; routines that only return None "
                "never change outputs). See docs/onnx.md.", stacklevel=2)
        _original_init(self, hit.data, options, providers, provider_options, **kwargs)
    checked_session(self)
    if plan is not None:
        _fetch_for(self, plan)


_patched_init.__wrapped__ = _original_init


# InferenceSession's own run methods (None: inherited from Session), restored
# when the last scope closes
_OWN_RUNS = {name: ort.InferenceSession.__dict__.get(name) for name in run_methods()}


def _named_if_plain(method):
    """``InferenceSession.<method>`` while a scope is open anywhere: a
    session made before any scope (so never instrumented) and run inside one,
    by any run method, gets a `NotInstrumentedWarning` once per amanda
    session, instead of silently running no routine; its results are
    unchanged."""
    original = getattr(ort.InferenceSession, method)

    def run(self, *args, **kwargs):
        sessions = controls.state.sessions
        if (sessions and not controls.state.disabled
                and not getattr(self, "_amanda_made", False)
                and getattr(self, "_amanda_warned", None) != id(sessions[-1])):
            self._amanda_warned = id(sessions[-1])   # not the session itself: nothing kept
            warnings.warn(
                "amanda: this onnxruntime InferenceSession was created outside amanda.apply, "
                "so it runs the plain model and its nodes get no instrumentation points; "
                "create the session inside the scope to instrument it (docs/onnx.md).",
                NotInstrumentedWarning, stacklevel=2)
        return original(self, *args, **kwargs)
    run.__name__ = method
    run.__wrapped__ = original
    return run


_NAMED_RUNS = {name: _named_if_plain(name) for name in _OWN_RUNS}


class OnnxRuntimeDriver(Driver):
    """Patches ``InferenceSession.__init__`` (and its run methods, to name
    sessions made outside any scope) while any thread is inside ``apply``;
    the last thread out restores them (the lifecycle:
    `amanda.runtime.driver.Driver`)."""

    def install(self):
        ort.InferenceSession.__init__ = _patched_init
        for name, patched in _NAMED_RUNS.items():
            setattr(ort.InferenceSession, name, patched)

    def uninstall(self):
        ort.InferenceSession.__init__ = _original_init
        for name, own in _OWN_RUNS.items():
            if own is None:
                delattr(ort.InferenceSession, name)     # the base class's again
            else:
                setattr(ort.InferenceSession, name, own)


DRIVER = OnnxRuntimeDriver()
