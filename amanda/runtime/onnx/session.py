"""The session driver: ``InferenceSession`` inside ``amanda.apply`` runs the
instrumented model.

`OnnxRuntimeDriver` patches ``InferenceSession.__init__`` while any thread is
inside a scope and restores it when the last one leaves. The patched
constructor instruments the model once per amanda session and model bytes
(`_instrumented`, cached by SHA-256), then builds the session on what it
needs: the user's bytes when nothing was recorded, the optimised model with
observe-only side branches (:mod:`amanda.runtime.onnx.observe`), or the
instrumented model with routines in its dataflow.
"""

from __future__ import annotations

import gc
import hashlib
import io
import os
import sys
import tempfile
import threading
import warnings

import onnx
import onnxruntime as ort

from amanda import controls
from amanda.errors import BackendError, NotInstrumentedWarning
from amanda.frontends.onnx import load_model, load_model_file
from amanda.passes.lower_actions import ROUTINE
from amanda.runtime.collector import collect_young, paused
from amanda.runtime.driver import Driver
from amanda.runtime.onnx import scratch
from amanda.runtime.onnx.bodies import _bodies_host_routines
from amanda.runtime.onnx.host import (CALLBACK_DOMAIN, _original_init, checked_session,
                                      class_run, extensions, owned_by, run_methods,
                                      session_options, set_run)
from amanda.runtime.onnx.instrument import _instrument
from amanda.runtime.onnx.lowering import lower
from amanda.runtime.onnx.sites import SitedGraph, lowerable
from amanda.runtime.observation import choosing, current_choice, fetch_budget
from amanda.runtime.onnx.observe import (_BODY_KINDS, _fetch_for, _NotSide, _observed,
                                         _SideBranches, bind_weights)
from amanda.runtime.onnx.wire import initializer_views, raw_size, viewable, write_model


def _model_key(source, stat):
    """(SHA-256 of the model, its bytes or None, ModelProto or None, whether
    onnxruntime may read the model from its file) of what
    ``InferenceSession`` was given (``stat``: its file's before reading)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        return hashlib.sha256(data).hexdigest(), data, None, False
    if isinstance(source, (str, os.PathLike)):
        model, external = load_model_file(source)   # with external data, if any
        if not external:
            # the file's own bytes, read in pieces (no copy of the model's
            # bytes beside the loaded model): a session from the same bytes
            # has the same key. Unless the file changed while it was read
            digest = hashlib.sha256()
            with open(source, "rb") as file:
                for piece in iter(lambda: file.read(1 << 20), b""):
                    digest.update(piece)
            after = os.stat(source)
            if (after.st_size, after.st_mtime_ns) == (stat.st_size, stat.st_mtime_ns):
                return digest.hexdigest(), None, model, True
        # onnxruntime saves the model it optimised from a file with external
        # data pointing at data files beside the saved copy, which do not
        # exist: such a model is handed to it as bytes (its data read in)
        data = model.SerializeToString()
        return hashlib.sha256(data).hexdigest(), None, model, False
    raise BackendError(f"amanda cannot instrument an InferenceSession created from a "
                       f"{type(source).__name__}")


#: a dropped model at least this large (bytes) is freed at once (`_Given.free_now`)
PROMPT_FREE_BYTES = 1 << 24


class _Given:
    """The model of the ``InferenceSession`` call being served: its bytes
    hash to the cache key, so it is the model the cached entry was made
    from. The cache keeps no copy of it; an entry needing it again (another
    optimisation level) takes it from here.

    Args:
        data: the model's bytes (what the key hashes), or None once dropped.
        model: the loaded ModelProto, or None until `model` loads it.
        file: ``(path, size, mtime)`` of the file it was read from when
            onnxruntime may read that file itself (no external data).
    """

    def __init__(self, data, model, file):
        self.data = data
        self._model = model
        self.file = file
        self.ahead = None   # `_Ahead`: optimised by onnxruntime before or while loading

    def model(self):
        if self._model is None:
            if self.data is None:   # read from its file again, which must not have changed
                if not isinstance(self.for_onnxruntime(), str):
                    raise BackendError(f"the ONNX model file {self.file[0]!r} changed while "
                                       "amanda read it")
                self._model = load_model_file(self.file[0])[0]
            else:
                self._model = load_model(self.data)
        return self._model

    def size(self):
        """The model's size in bytes as given (None: unknown, external data)."""
        if self.data is not None:
            return len(self.data)
        return self.file[1] if self.file is not None else None

    def release(self):
        """Drop the loaded model (kept while the bytes are: they are the user's)."""
        self._model = None

    def free_now(self):
        """Collect the cycles that kept the dropped model (the IR graph's,
        the side branches') now, if it is large enough to matter: at least
        `PROMPT_FREE_BYTES`, or of unknown size (external data). A smaller
        one is left to Python's own collector: a full ``gc.collect()`` walks
        every object of the process (tens of milliseconds with onnx and
        numpy loaded, 0.2 s with torch), more than the session creation
        itself."""
        size = self.size()
        if size is None or size >= PROMPT_FREE_BYTES:
            gc.collect()

    def for_onnxruntime(self):
        """What onnxruntime should read the model from: its file while
        unchanged, else its bytes."""
        if self.file is not None:
            path, size, mtime = self.file
            try:
                stat = os.stat(path)
            except OSError:
                stat = None
            if stat is not None and (stat.st_size, stat.st_mtime_ns) == (size, mtime):
                return path
        if self.data is None and self._model is None:
            raise BackendError(f"the ONNX model file {self.file[0]!r} changed while amanda "
                               "read it")
        return self.data if self.data is not None else self._model.SerializeToString()


class _Instrumented:
    """What a session inside ``apply`` runs for one model and tool set.

    Attributes:
        data: the model bytes to run when routines feed the model; None
            when nothing was recorded (sessions read the user's model as
            given). When every routine only looks they are written only if
            the side branches cannot be attached (the lowered model is as
            large as the user's).
        callbacks: they host Python routines.
        inline: some Python routine's results flow back into the model.
        sides: every routine only looks (see `_SideBranches`).
        side: ``(lowered IR graph, user's ModelProto)`` while the session
            that made the entry is created; then dropped (the IR graph refers
            to the model's protobuf messages, so keeping it would keep the
            whole model): another optimisation level instruments the model of
            its own call again.
        observed: for `sides`: (routines in bodies, a routine was recorded
            in `hosted_observation`, bytes the top-level routines read).
        optimised: side-branch models by (optimisation level, providers,
            fetched): ``(bytes, plan, eager, shared)``.
    """

    def __init__(self, data, callbacks=False, inline=False, side=None):
        self._data = data
        self.callbacks = callbacks
        self.inline = inline
        self.sides = side is not None
        self.side = side
        self.observed = None
        if side is not None:
            graph = side[0]
            # (a plan read at its sites has no routine in a body, by its rule)
            in_bodies = not isinstance(graph, SitedGraph) and _bodies_host_routines(graph)
            self.observed = (in_bodies,) + _observed(graph)
        self.optimised = {}

    def side_graph(self, given, session):
        """``(lowered IR graph, ModelProto)``: the entry's while it has them,
        else from instrumenting the given model again."""
        if self.side is not None:
            return self.side
        model = given.model()
        lowered, lowering = _instrument(model, session, callbacks=True, apart=True)
        del lowered
        if lowering is None or not lowering.side_only:
            raise BackendError("amanda: instrumenting the model again gave another plan")
        return lowering.top, model

    def lowered_data(self, given, session):
        """The lowered model's bytes (side branches could not be attached)."""
        if self._data is None:
            self._data = lower(lowerable(self.side_graph(given, session)[0])).SerializeToString()
        return self._data

    @property
    def data(self):
        return self._data


def _instrumented(session, source, ahead=None):
    """(the `_Instrumented` model for ``source``, cached per amanda session
    by the SHA-256 of the model; the `_Given` model of this call).

    ``ahead`` (`_ahead`), on a miss for a model onnxruntime reads from the
    user's file or bytes: onnxruntime optimises it while (or, large, before)
    it is loaded for instrumentation (`_Ahead`); if the routines turn out
    not to be observe-only, that optimisation was wasted."""
    stat = os.stat(source) if isinstance(source, (str, os.PathLike)) else None
    key, data, model, from_file = _model_key(source, stat)
    file = (os.fspath(source), stat.st_size, stat.st_mtime_ns) if from_file else None
    given = _Given(data, model, file)
    cache = session.caches.setdefault("onnx", {})
    hit = cache.get(key) if controls.state.cache else None
    if hit is not None:
        return hit, given
    del data, model
    if ahead is not None and (given.file is not None or given.data is not None):
        given.release()
        given.ahead = _Ahead(ahead, given.for_onnxruntime(), given.size())
    try:
        lowered, lowering = _instrument(given.model(), session, callbacks=True, apart=True)
    except BaseException:
        if given.ahead is not None:   # no optimisation left running behind an error
            given.ahead.discard()
        raise
    sides = lowering is not None and lowering.side_only and lowering.uses_callbacks
    if given.ahead is not None and not sides:
        # no side branches: the optimised model is not used; let the
        # optimisation finish rather than compete with the session's creation
        given.ahead.discard()
        given.ahead = None
    if lowering is None:
        # nothing recorded: sessions read the model from what the user gives
        # them, which hashes to this key (no copy is kept)
        hit = _Instrumented(None)
    elif sides:
        # the optimised model with side branches is what runs (written per
        # optimisation level): no copy of the lowered model is kept
        del lowered
        hit = _Instrumented(None, True, lowering.inline, (lowering.top, given.model()))
    else:
        hit = _Instrumented(lowered.SerializeToString(), lowering.uses_callbacks,
                            lowering.inline)
    if not hit.sides:
        # the IR graph's cycles refer to the user's model: free it now
        del lowered, lowering
        given.release()
        given.free_now()
    cache[key] = hit
    return hit, given


# Options are mutated for the span of a session's creation (the optimised
# model's path, the optimisation level); sessions copy them when created.
_OPTIONS_LOCK = threading.Lock()


def _fresh_options(level=None, register=True):
    """New ``SessionOptions`` like amanda's default ones (the extensions' op
    library registered unless not ``register``), at ``level`` if given; for
    a session that must not share options (and what is added to them) with
    any other."""
    options = ort.SessionOptions()
    if register:
        options.register_custom_ops_library(extensions().get_library_path())
    if level is not None:
        options.graph_optimization_level = level
    return options


def _optimised_by_onnxruntime(data, options, own, providers, provider_options, kwargs,
                              register=False):
    """(temporary folder, ModelProto): the user's model (a path or bytes) as
    onnxruntime optimises it with these options (``own``: amanda's, the user
    gave none; the weights then stay in the folder as external data).
    ``register``: with the extensions' op library (`_needs_library`), which
    only a model using that domain needs; its registration alone costs a
    session creation several milliseconds."""
    if register:
        options = session_options(None if own else options)
    if own:
        # this session only writes the optimised model: weights packed for
        # its kernels would only raise the build's peak (packing follows the
        # optimisation and does not change the graph). Not in the user's
        # options: a config entry cannot be taken back out of them
        options = _fresh_options(options.graph_optimization_level, register=register)
        options.add_session_config_entry("session.disable_prepacking", "1")
    folder = scratch.Files()
    try:
        return folder, _rename_inlined(_optimise_into(folder, data, options, own, providers,
                                                      provider_options, kwargs))
    except BaseException:
        folder.cleanup()
        raise


#: what the names onnxruntime gives the values of a function it inlines contain
INLINED_MARK = "_inlfunc_"


def _rename_inlined(model):
    """Rename the values onnxruntime made when it inlined a function
    (``_inlfunc_<op>_<name>``, and names derived from them such as
    ``InsertedPrecisionFreeCast__inlfunc_...``) in the model it saved.
    Loading that model again, onnxruntime inlines the function nodes still
    left in it (e.g. a float16 ``Softmax`` in an ``Attention`` expansion)
    and makes the same names again: "AddInitializedTensor already has tensor
    with name _inlfunc_Softmax_axes but different TensorProto", "Duplicate
    definition of name". The model's own inputs and outputs keep theirs."""
    graph = model.graph
    kept = {i.name for i in graph.input} | {o.name for o in graph.output}

    def new(name):
        if INLINED_MARK in name and name not in kept:
            return name.replace(INLINED_MARK, "_amanda_inlined_")
        return name

    def rename(graph):
        for info in list(graph.input) + list(graph.output) + list(graph.value_info):
            info.name = new(info.name)
        for initializer in graph.initializer:
            initializer.name = new(initializer.name)
        for node in graph.node:
            node.input[:] = [new(n) for n in node.input]
            node.output[:] = [new(n) for n in node.output]
            for attribute in node.attribute:
                if attribute.HasField("g"):
                    rename(attribute.g)
                for body in attribute.graphs:
                    rename(body)

    if any(INLINED_MARK in o for n in graph.node for o in n.output) \
            or any(INLINED_MARK in i.name for i in graph.initializer):
        rename(graph)
    return model


def _optimise_into(folder, data, options, own, providers, provider_options, kwargs):
    """The ``ModelProto`` onnxruntime optimised, written to one of
    ``folder``'s files (`scratch.Files`). With amanda's own options
    (``own``) its weights are external data in another of them beside it,
    read a weight at a time by `write_model` (loading them with the model
    would hold them twice for a while). Made by onnxruntime's model compiler
    where it may stand for a session (`_compiles`) and the graph it wrote
    has no body (it writes a body's constants twice, as nodes and as
    initializers, where a session writes nodes: the model is invalid); by
    a session saving the model it optimised otherwise."""
    path = folder.path(".onnx")
    if _compiles(options, providers, provider_options, kwargs):
        try:
            compiled = _compile(data, options, path,
                                folder.path(OPTIMISED_WEIGHTS) if own else None)
        except Exception:   # noqa: BLE001 - the session's way below reports a real failure
            compiled = None
        if compiled is not None and not any(a.type in _BODY_KINDS for n in compiled.graph.node
                                            for a in n.attribute):
            return compiled
    if own:
        weights = folder.path(OPTIMISED_WEIGHTS)
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name",
            os.path.basename(weights))
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes",
            str(SHARED_BYTES))
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
    return onnx.load(path, load_external_data=False)


#: the suffix of the optimised model's weights file (amanda's own options), beside it
OPTIMISED_WEIGHTS = ".weights"


#: onnxruntime's model compiler (``ModelCompiler``, 1.22 and later; one that
#: takes no optimisation level raises, and a session optimises instead)
_COMPILER = getattr(ort, "ModelCompiler", None)


def _compiles(options, providers, provider_options, kwargs):
    """Whether `_compile` may stand for a session that saves its optimised
    model: onnxruntime's CPU provider alone, named by the caller or none
    named (a session given no providers uses the CPU's, the compiler too),
    none in the options (the compiler would take those, a session the
    ones it is given), no provider options or ``disabled_optimizers``, and
    no file of the user's own to save the optimised model to."""
    if _COMPILER is None or kwargs or provider_options:
        return False
    if providers and (list(providers) != ["CPUExecutionProvider"]):
        return False   # (another provider, or the CPU's with options)
    has = getattr(options, "has_providers", None)
    return not options.optimized_model_filepath and not (has is not None and has())


def _compile(data, options, path, weights):
    """The model (a path or bytes) as onnxruntime optimises it with
    ``options``, a ``ModelProto``, made by onnxruntime's model compiler: the
    same graph a session saves through ``optimized_model_filepath`` (the
    same optimisers at the same level, checked by
    ``tests/onnx/test_compiled_optimisation_onnx.py``), without the
    session's kernels, its packed weights and its plan. Handed over in
    memory; only with ``weights`` (a path) written to ``path``, its weights
    of at least `SHARED_BYTES` into ``weights`` beside it. On the small
    BERT: 7.3 ms in memory, 7.9 through a file, 8.4 by a session saving it."""
    extra = {}
    if weights is not None:
        extra = {"external_initializers_file_path": os.path.basename(weights),
                 "external_initializers_size_threshold": SHARED_BYTES}
    with _OPTIONS_LOCK:
        saved = options.log_severity_level
        options.log_severity_level = 3   # (the NCHWc warning, see _optimise_into)
        try:
            compiler = _COMPILER(options, os.fspath(data) if isinstance(data, os.PathLike)
                                 else data,
                                 graph_optimization_level=options.graph_optimization_level,
                                 **extra)
            if weights is None:
                return onnx.load_from_string(compiler.compile_to_bytes())
            compiler.compile_to_file(path)
        finally:
            options.log_severity_level = saved
    return onnx.load(path, load_external_data=False)


def _ahead(sess_options, providers, provider_options, kwargs):
    """A function optimising the model (a path or bytes) for `_Ahead`, as
    the session's options say (amanda's own when ``sess_options`` is None),
    returning ``(level key, folder, ModelProto)``."""
    def optimise(source):
        options = _plain_options(sess_options)
        level = (int(options.graph_optimization_level), repr(providers), repr(provider_options))
        return (level,) + _optimised_by_onnxruntime(source, options, sess_options is None,
                                                    providers, provider_options, kwargs)
    optimise.own = sess_options is None
    return optimise


#: a model at most this large (bytes) is optimised by onnxruntime while amanda
#: lifts and analyses it (`_Ahead`); a larger one first, then loaded
OVERLAP_BYTES = 1 << 26


class _Ahead:
    """The model as onnxruntime optimises it (``optimise(source)``: see
    `_ahead`), made before amanda loads the model or, for a model of at most
    `OVERLAP_BYTES`, on a thread while amanda lifts and analyses it:
    onnxruntime releases the GIL while it builds a session, so its
    optimisation and amanda's Python work share the wall time. A larger
    model is optimised first with amanda's own options (their weights stay
    on disk, see `_optimise_into`), so the optimising session and the loaded
    model never coexist; with the user's options (weights written into the
    optimised model) it is optimised after instrumenting, when the side
    branches need it (`_side_branch_model`). `result` is None when the
    optimisation failed (the failure is reported later, by instrumenting or
    by the session) or was left for later."""

    def __init__(self, optimise, source, size):
        self._result = None
        self._thread = None
        if size is not None and size <= OVERLAP_BYTES:
            self._thread = threading.Thread(target=self._run, args=(optimise, source, True),
                                            name="amanda-onnx-optimise", daemon=True)
            _SWITCH.enter()
            try:
                self._thread.start()
            except BaseException:
                _SWITCH.leave()
                raise
        elif optimise.own:
            self._run(optimise, source)

    def _run(self, optimise, source, overlapped=False):
        try:
            self._result = optimise(source)
        except Exception:   # noqa: BLE001 - see the class
            self._result = None
        finally:
            if overlapped:
                _SWITCH.leave()

    def running(self):
        """Whether the optimisation is still running on its thread."""
        return self._thread is not None and self._thread.is_alive()

    def result(self):
        """``(level key, folder, ModelProto)`` or None, once it is made."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self._result

    def discard(self):
        """Wait for it and remove its folder: it is not used."""
        result = self.result()
        self._result = None
        if result is not None:
            result[1].cleanup()


class _SwitchInterval:
    """The interpreter's switch interval, lowered while an optimisation
    runs on a thread beside amanda's Python work (`_Ahead`).

    onnxruntime releases the GIL while it builds the session but takes it
    back several times on the way (to return to Python among others); each
    time the thread waits for the main thread to give it up, which a busy
    thread does only every switch interval (5 ms by default). Measured on
    the small BERT, beside 25 ms of lifting (12 trials each): the
    optimisation took 36 ms at 5 ms, 27 ms at 1 ms, 24.6 ms at 0.2 ms,
    22.8 ms at 0.05 ms (no less at 0.01 ms), 20.2 ms alone; the lifting
    took 24-27 ms at every interval. The interval is restored when the last
    such thread ends (a count, so overlapping creations on several threads
    nest), unless somebody changed it meanwhile."""

    LOW = 0.00005

    def __init__(self):
        self._lock = threading.Lock()
        self._running = 0
        self._saved = None
        self._set = None   # what the interpreter reads back (it keeps microseconds)

    def enter(self):
        with self._lock:
            if self._running == 0:
                current = sys.getswitchinterval()
                if current > self.LOW:
                    self._saved = current
                    sys.setswitchinterval(self.LOW)
                    self._set = sys.getswitchinterval()
            self._running += 1

    def leave(self):
        with self._lock:
            self._running -= 1
            if self._running == 0 and self._saved is not None:
                if sys.getswitchinterval() == self._set:
                    sys.setswitchinterval(self._saved)
                self._saved = None


_SWITCH = _SwitchInterval()


#: initializers at least this large are shared with onnxruntime (see `_shared`)
SHARED_BYTES = 1 << 16


def _side_branch_model(hit, given, session, options, own, providers, provider_options,
                       kwargs):
    """``(bytes, plan, eager, shared)`` of the optimised model with the
    observe-only routines attached, cached per optimisation level and
    providers; None for the bytes if a routine reads a tensor that cannot be
    recomputed (it then runs in the model's dataflow). ``shared``: read-only
    views of its large initializers over the bytes, which a session may use
    instead of copies of its own (`_shared`)."""
    in_bodies, timed, observed = hit.observed
    budget = fetch_budget()
    fetch = not in_bodies and not timed and budget is not None and observed <= budget
    # (``own``: only a session with amanda's own options shares weights,
    # `_shared`; its entry holds the lean model and the shared views)
    key = (int(options.graph_optimization_level), repr(providers), repr(provider_options),
           fetch, own)
    found = hit.optimised.get(key)
    if found is None:
        graph, model = hit.side_graph(given, session)
        branches = _SideBranches(graph, model, fetch=fetch, eager=not fetch and not in_bodies)
        del graph, model   # the branches hold them now
        if given.ahead is not None:
            try:
                branches.prepare()   # while onnxruntime optimises the model
            except BaseException:
                given.ahead.discard()   # (its files removed, nothing left running)
                given.ahead = None
                raise
            if branches._sites_prepared:
                # the IR graph is garbage now: collected while onnxruntime
                # still optimises, not after it
                branches.drop_graph()
                hit.side = None
                if given.ahead.running():
                    collect_young()
        ahead = given.ahead.result() if given.ahead is not None else None
        if ahead is not None and ahead[0] == key[:3]:
            folder, optimised = ahead[1:]
        else:
            if ahead is not None:
                given.ahead.discard()
            # (the optimisation ahead, without the extensions' library, may
            # have failed on a model using its ops: this one registers it)
            folder, optimised = _optimised_by_onnxruntime(
                given.for_onnxruntime(), options, own, providers, provider_options, kwargs,
                register=True)
        given.ahead = None
        try:
            branches.take(optimised)
            del optimised   # the branches own it now
            result = branches.model()
            hosts = _needs_library(result)
            bound = branches.plan, branches.weights, branches._dropped
            eager = branches.eager
            # the user's model is no longer needed: free it (and the IR graph
            # and the branches, whose cycles refer to it) before the model is
            # serialized
            del branches
            hit.side = None
            given.release()
            given.free_now()
            needed = set(bound[0].constants) if bound[0] is not None else set()
            needed.update(n for _, slots in bound[1] for n in slots.values())
            needed.difference_update(bound[2])   # (dropped from the model: values kept)
            # copies of the observed weights no view can be made of
            fallback = onnx.GraphProto()
            fallback.initializer.extend(
                i for i in result.graph.initializer if i.name in needed
                and not viewable(i, folder) and i.data_location != onnx.TensorProto.EXTERNAL)
            large = {}
            for initializer in result.graph.initializer if own else ():
                if viewable(initializer, folder) and raw_size(initializer) >= SHARED_BYTES:
                    large[initializer.name] = raw_size(initializer)
            order = [i.name for i in result.graph.initializer]
            small = given.size() is not None and given.size() <= OVERLAP_BYTES
            # a small model is written into memory (no file, no system call
            # per weight); a larger one into a file, a weight at a time
            # (those onnxruntime left in the folder read from there), and
            # read back once the model is freed: one serialized copy at a
            # time, not three
            with (io.BytesIO() if small else
                  tempfile.TemporaryFile(prefix="amanda-onnx-")) as file:
                spans = write_model(result, file, folder)
                folder.cleanup()
                lean = _lean(result, large) if own else None
                del result
                if small:
                    data = file.getvalue()
                else:
                    file.seek(0)
                    data = file.read()
            wanted = needed | set(large)
            views = initializer_views(data, wanted, [span for name, span in zip(order, spans)
                                                     if name in wanted])
            if needed - set(views) - {i.name for i in fallback.initializer}:
                # malformed, or external data of a type no view is made of: copy from it
                fallback = onnx.ModelProto.FromString(data).graph
            # observed weights: views over the bytes kept here, not copies
            bind_weights(data, fallback, *bound, views=views)
            shared = {n: views[n] for n in large if n in views}
            if len(shared) != len(large):
                lean = None   # (malformed) every weight left out must be shared
            found = data, bound[0], eager, shared, lean, hosts
            del views, bound, fallback
        except _NotSide:
            folder.cleanup()   # (cleaning up twice is harmless)
            found = b"", None, False, {}, None, True
        hit.optimised[key] = found
    return found if found[0] else (None, None, False, {}, None, True)


def _needs_library(model):
    """Whether a session of ``model`` needs the extensions' op library: it
    imports the extensions' domain (amanda's host nodes, or the user's own
    ops of it). A model whose observed tensors are all fetched has no host
    node and is created without it (see `session_options`)."""
    return any(o.domain == CALLBACK_DOMAIN for o in model.opset_import)


_PLAIN_DEFAULT = []


def _plain_options(sess_options):
    """The user's options, or amanda's default options without the
    extensions' library (`session_options` registers it where a session
    hosts routines)."""
    if sess_options is not None:
        return sess_options
    if not _PLAIN_DEFAULT:
        _PLAIN_DEFAULT.append(ort.SessionOptions())
    return _PLAIN_DEFAULT[0]


#: the file a lean model's shared initializers name (see `_lean`): an
#: empty sparse file in the scratch folder (`scratch.stub`)
SHARED_FILE = scratch.STUB
_EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"


def _lean(model, large):
    """``(bytes, extent)``: ``model`` (changed in place) with the ``large``
    initializers (name -> bytes) as external data in `SHARED_FILE`, at
    offsets below ``extent``. A session given the shared arrays for them
    never reads that file (an empty sparse file of at least ``extent``
    bytes in the scratch folder, `scratch.stub`): onnxruntime then parses no
    weight beside the kept ones."""
    offset = 0
    for tensor in model.graph.initializer:
        size = large.get(tensor.name)
        if size is None:
            continue
        tensor.ClearField("raw_data")
        tensor.ClearField("external_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", SHARED_FILE), ("offset", str(offset)),
                           ("length", str(size))):
            tensor.external_data.add(key=key, value=value)
        offset += -(-size // 4096) * 4096
    return model.SerializeToString(), offset


def _on_cpu(providers):
    """Whether a session with these providers runs on onnxruntime's CPU
    provider alone."""
    names = ort.get_available_providers() if not providers else \
        [p[0] if isinstance(p, (tuple, list)) else p for p in providers]
    return all(n == "CPUExecutionProvider" for n in names)


def _shared(sess_options, providers, shared, hosts=True):
    """Fresh options (amanda's own: the user gave none) that make onnxruntime
    use ``shared`` (name -> read-only array over the cached bytes) as those
    initializers instead of copies (``SessionOptions.add_initializer``; the
    arrays must outlive the session, which keeps them), or None where the
    user's options are used (they cannot be copied, and an initializer added
    to them would stay there) or a provider other than the CPU's runs."""
    if sess_options is not None or not shared or not _on_cpu(providers):
        return None, ()
    options = _fresh_options(register=hosts)
    values = [ort.OrtValue.ortvalue_from_numpy(array) for array in shared.values()]
    for name, value in zip(shared, values):
        options.add_initializer(name, value)
    return options, values


def _patched_init(self, path_or_bytes, sess_options=None, providers=None,
                  provider_options=None, **kwargs):
    sessions = controls.state.sessions
    if not sessions or controls.state.disabled:
        self._amanda_made = True     # plain on purpose (amanda.disabled()): nothing to say
        return _original_init(self, path_or_bytes, sess_options, providers, provider_options,
                              **kwargs)
    self._amanda_made = True
    # the routines' callbacks live as long as the amanda session, which this
    # InferenceSession keeps (host.owned_by)
    self._amanda_owner = sessions[-1]
    with owned_by(sessions[-1]), paused():   # (amanda.runtime.collector)
        _patched_init_owned(self, sessions, path_or_bytes, sess_options, providers,
                            provider_options, **kwargs)
    # what the session is made from, so that a run inside cache_disabled()
    # can make it again: a reference to the user's path or bytes, no copy
    self._amanda_recipe = (path_or_bytes, sess_options, providers, provider_options, kwargs,
                           current_choice())
    _analysed_at_every_run(self)


def _analysed_at_every_run(session):
    """The one cache rule (analysis at every execution), for onnxruntime:
    each run method of ``session`` first makes the session again, with its
    tools' analysis, when it is called inside ``amanda.cache_disabled()``
    (outside ``amanda.disabled()``); for ``run_with_iobinding``, whose
    binding belongs to the session it was made with, ``io_binding()`` does.
    The run methods creation installed (routine error checks, the fetching
    of observed tensors) run inside. Installed by `set_run`: the session
    holds no reference to itself."""
    session._amanda_inner = _installed(session)
    for method in run_methods():
        set_run(session, method, _analysing(method))
    _show_inner(session)
    set_run(session, "io_binding", _binding_io)


def _installed(session):
    """The run methods installed for ``session`` (`set_run`), by name."""
    runs = session.__dict__.get("_amanda_runs", {})
    return {method: runs[method] for method in run_methods() if method in runs}


def _analysing(method):
    """``session.<method>`` under the cache rule (`_analysed_at_every_run`)."""
    def run(session, *args, **kwargs):
        if method != "run_with_iobinding" and not controls.state.cache \
                and not controls.state.disabled:
            _made_again(session)
        found = session._amanda_inner.get(method)
        if found is None:     # not installed by creation: the class's method
            found = class_run(session, method)
        return found(session, *args, **kwargs)
    run.__name__ = method
    return run


def _binding_io(session):
    # a binding belongs to the onnxruntime session it was made with: for
    # run_with_iobinding, the session is made again when the binding is
    if not controls.state.cache and not controls.state.disabled:
        _made_again(session)
    return class_run(session, "io_binding")(session)


def _made_again(session):
    """Create ``session`` again from its model, in its amanda session (its
    tools), with the analysis cache off: the routines of this run are those
    the analysis records now."""
    owner = session._amanda_owner
    path_or_bytes, sess_options, providers, provider_options, kwargs, choice = \
        session._amanda_recipe
    runs = session._amanda_runs
    outer = {method: runs.pop(method) for method in run_methods() if method in runs}
    try:
        with owned_by(owner), choosing(choice), paused():
            _patched_init_owned(session, [owner], path_or_bytes, sess_options, providers,
                                provider_options, **kwargs)
    finally:
        session._amanda_inner = _installed(session)
        runs.update(outer)
        _show_inner(session)


def _show_inner(session):
    """Each run method's ``__wrapped__`` is the one creation installed, if
    any (what ``inspect.unwrap`` and tests look through to)."""
    runs = session._amanda_runs
    for method in run_methods():
        outer, inner = runs.get(method), session._amanda_inner.get(method)
        if outer is None:
            continue
        if inner is not None:
            outer.__wrapped__ = inner
        elif hasattr(outer, "__wrapped__"):
            del outer.__wrapped__


def _patched_init_owned(self, sessions, path_or_bytes, sess_options, providers,
                        provider_options, **kwargs):
    hit, given = _instrumented(sessions[-1], path_or_bytes,
                               _ahead(sess_options, providers, provider_options, kwargs))
    if not hit.callbacks:
        del given
        return _original_init(self, path_or_bytes if hit.data is None else hit.data,
                              sess_options, providers, provider_options, **kwargs)
    options = _plain_options(sess_options)
    data = plan = None
    eager = False
    shared = {}
    lowered = hit.data
    lean = None
    hosts = True
    if hit.sides:
        try:
            data, plan, eager, shared, lean, hosts = _side_branch_model(
                hit, given, sessions[-1], options, sess_options is None, providers,
                provider_options, kwargs)
            if data is None:
                lowered = hit.lowered_data(given, sessions[-1])
        finally:
            # neither the user's model nor the IR graph (which refers to it) is kept
            hit.side = None
            del given
    else:
        del given
    if hosts:
        options = session_options(sess_options)
    if data is not None:
        fresh, values = _shared(sess_options, providers, shared, hosts)
        folder = None
        if fresh is not None:
            options = fresh
            self._amanda_shared = values   # onnxruntime reads the arrays: keep them
            if lean is not None:
                folder = scratch.stub(lean[1])
                options.add_session_config_entry(_EXTERNAL_FOLDER, folder)
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
                if folder is not None:
                    try:
                        _original_init(self, lean[0], options, providers, provider_options,
                                       **kwargs)
                    except Exception:   # an onnxruntime without that option: all weights
                        _original_init(self, data, options, providers, provider_options,
                                       **kwargs)
                else:
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
        _original_init(self, lowered, options, providers, provider_options, **kwargs)
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
