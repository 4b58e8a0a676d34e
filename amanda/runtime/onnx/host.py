"""The routine host: Python routines called from inside onnxruntime.

A routine that does not lower to ONNX nodes runs as custom ops of
``onnxruntime-extensions`` (domain `CALLBACK_DOMAIN`): ``AmandaPut_<dtype>``
nodes hand each tensor to Python, ``AmandaCall`` runs the routine (a
`_Callback`: its result checks, its errors kept instead of crossing into
onnxruntime), ``AmandaGet_<dtype>`` nodes hand its results back. The nodes
are written by :mod:`amanda.runtime.onnx.routine_nodes`; this module is
their other side: the op catalog registered once per process, the hand-off
along token chains (safe for concurrent runs of one session), the routine
errors re-raised by the run that met them (`_checked_run`), `current_run`
for routines that pair events within a run, and the sessions that can host
routines (`session_options`, `inference_session`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import types
import weakref

import numpy as np
import onnxruntime as ort

from amanda.errors import BackendError
from amanda.frontends.onnx import load_model
from amanda.runtime import host
from amanda.runtime.backends import load_skipping_package
from amanda.runtime.routines import call_routine

#: Domain of the custom ops that host Python routines.
CALLBACK_DOMAIN = "ai.onnx.contrib"

#: onnxruntime's own ``InferenceSession.__init__``, taken when amanda's ONNX
#: runtime is first imported (before the driver can patch it). The sessions
#: amanda builds for itself (type completion, the optimised copy,
#: `inference_session`) and the patched constructor itself call it directly.
_original_init = ort.InferenceSession.__init__


# -- Python routines hosted by onnxruntime-extensions -------------------------------------
#
# onnxruntime-extensions keeps its Python op definitions in a table that
# sessions point into; adding definitions after a session registered the
# library can leave those pointers dangling (the process crashes). So amanda
# registers one fixed catalog, once, before its first use: per dtype an
# ``AmandaPut_<dtype>`` (tensor, token -> token) and an ``AmandaGet_<dtype>``
# (token -> tensor), and one ``AmandaCall`` (token -> token). Its own
# invocation hook hands arrays back without the extensions' list conversion
# (that costs ~0.4 s per million elements); other ops keep the default hook.


_EXTENSIONS = "onnxruntime_extensions"
_EXTENSIONS_LOCK = threading.Lock()


def extensions():
    """onnxruntime-extensions' Python-op module, ``onnxruntime_extensions._ocos``
    (``PyCustomOpDef``, ``Opdef.declare`` = ``onnx_op``, ``get_library_path``,
    the invocation hook): all amanda uses of the package.

    The package's ``__init__`` also imports its model converters, which
    import transformers and through it torch: 0.3 s and more, and a process
    holding torch's objects pays for them in every full ``gc.collect()``.
    Unless the package is imported already, ``_ocos`` is loaded under its
    own name with the package's ``__init__`` not run (an empty package
    module stands in for the span of that import) and the stand-in is taken
    out of ``sys.modules`` again: a later ``import onnxruntime_extensions``
    runs the real ``__init__``, which reuses this same ``_ocos`` (one op
    table, one invocation hook)."""
    import sys
    name = f"{_EXTENSIONS}._ocos"
    found = sys.modules.get(name)
    if found is not None:
        return found
    with _EXTENSIONS_LOCK:
        return load_skipping_package(name)


def _hosted_dtypes():
    P = extensions().PyCustomOpDef
    # float16 and bfloat16 are not supported by the extensions' Python ops
    return {"float32": P.dt_float, "float64": P.dt_double, "int8": P.dt_int8,
            "int16": P.dt_int16, "int32": P.dt_int32, "int64": P.dt_int64, "uint8": P.dt_uint8,
            "uint16": P.dt_uint16, "uint32": P.dt_uint32, "uint64": P.dt_uint64,
            "bool": P.dt_bool}


_HOSTED_DTYPES = _hosted_dtypes()
_CATALOG = {}          # op id (of the extensions) -> (op definition, dtype of its output)
# key attribute -> _Callback. Weak: a callback lives as long as its owner,
# the amanda session whose tools it calls (`owned_by`; the session's cache
# "onnx.callbacks" holds it, and every InferenceSession amanda made keeps
# its amanda session), so a tool nobody holds any more is not kept by
# amanda for the life of the process.
_CALLBACKS = weakref.WeakValueDictionary()
_UNOWNED = []          # callbacks registered outside `owned_by`: kept, as before
_OWNER = threading.local()
_KEYS = itertools.count(1)
_LOCK = threading.Lock()

# The hand-off. A routine's tensors travel AmandaPut -> AmandaCall ->
# AmandaGet along a chain of int64 scalar *tokens*. Every chain starts at the
# constant 0 ("amanda.trigger"); the first host node of a chain that sees 0
# draws a fresh chain id and passes it on as its token, and everything the
# chain stashes is keyed by that id. So concurrent runs of one session
# (several Python threads, or onnxruntime's inter-op pool) never see each
# other's tensors, and the hot path takes no lock: dict operations on
# distinct keys and ``next`` on a counter are atomic under the GIL.
_CHAINS = itertools.count(1)
_STASH = {}            # chain id -> {slot: array} handed over by AmandaPut nodes
# (chain id, routine key) -> {slot: array} left for AmandaGet nodes (each pops
# its own); keyed by routine too, since one chain threads every routine of a
# run and the next routine may be called before this one's results are taken
_RESULTS = {}
#: Slot of an AmandaPut that only orders the chain after a tensor (the value
#: is not handed to the routine).
ORDER_SLOT = "order"

# Routine errors met inside onnxruntime, raised again by the run that met
# them: keyed by the thread that called ``run`` (onnxruntime's sequential
# executor runs every node on it); errors met on a pool thread (parallel
# execution mode) cannot be told apart and go to the next run that finishes.
_failures = {}         # thread ident -> first error met during its current run
_orphans = []          # errors met on threads that are not running a checked run
_in_run = set()        # idents of threads inside a checked run


def _chain(token):
    chain = int(token)
    return chain if chain else next(_CHAINS)


def _put(value, token, key):
    chain = _chain(token)
    slot = key.rpartition(":")[2]
    if slot != ORDER_SLOT:
        _STASH.setdefault(chain, {})[int(slot)] = value
    return np.array(chain, np.int64)


def _call(token, key):
    chain = _chain(token)
    arrays = _STASH.pop(chain, {})
    callback = _CALLBACKS[key]
    constants = callback.constants   # weights no AmandaPut hands over
    results = callback([arrays[i] if i in arrays else constants.get(i)
                        for i in range(len(callback.hosted))])
    if results:   # AmandaGet nodes follow and take them
        _RESULTS[chain, key] = dict(enumerate(results))
    return np.array(chain, np.int64)


def _get(token, key):
    routine, _, slot = key.rpartition(":")
    where = (int(token), routine)
    results = _RESULTS[where]
    value = results.pop(int(slot))
    if not results:
        _RESULTS.pop(where, None)
    return value


def _fail(error):
    """Keep a routine error for the run that met it."""
    ident = threading.get_ident()
    if ident in _in_run:
        _failures.setdefault(ident, error)
    else:
        with _LOCK:
            _orphans.append(error)


def _take_failure(ident):
    failure = _failures.pop(ident, None)
    if failure is None and _orphans:
        with _LOCK:
            if _orphans:
                failure = _orphans[0]
                _orphans.clear()
    return failure


def _catalog():
    """Register the host ops (once per process)."""
    with _LOCK:
        if _CATALOG:
            return
        ocos = extensions()
        PyCustomOpDef, onnx_op = ocos.PyCustomOpDef, ocos.Opdef.declare
        key = {"key": PyCustomOpDef.dt_string}
        token = PyCustomOpDef.dt_int64
        defs = [(onnx_op(op_type="AmandaCall", inputs=[token], outputs=[token], attrs=key)(_call),
                 "int64")]
        for dtype, code in _HOSTED_DTYPES.items():
            defs.append((onnx_op(op_type=f"AmandaPut_{dtype}", inputs=[code, token],
                                 outputs=[token], attrs=key)(_put), "int64"))
            defs.append((onnx_op(op_type=f"AmandaGet_{dtype}", inputs=[token], outputs=[code],
                                 attrs=key)(_get), dtype))
        for opdef, dtype in defs:
            _CATALOG[opdef._id] = (opdef, np.dtype(dtype))
        _install_hook()


def _install_hook():
    try:
        ocos = extensions()
        PyCustomOpDef, _on_pyop_invocation = ocos.PyCustomOpDef, ocos._on_pyop_invocation
    except (ImportError, AttributeError):   # a layout we do not know: keep the default hook
        return

    def invoke(op_id, feed, attributes):
        entry = _CATALOG.get(op_id)
        if entry is None:
            return _on_pyop_invocation(op_id, feed, attributes)
        opdef, dtype = entry
        try:
            result = np.require(opdef.body(*feed, **attributes), requirements="C")
        except BaseException as exc:   # noqa: BLE001 - an exception here aborts the process
            error = BackendError(f"amanda's host op {opdef.op_type} ({attributes.get('key')}) "
                                 f"failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            _fail(error)
            result = np.zeros((), dtype)
        return op_id, result.shape, result.reshape(-1)

    PyCustomOpDef.install_hooker(invoke)


@contextlib.contextmanager
def owned_by(session):
    """Callbacks registered inside (on this thread) are kept alive by the
    amanda ``session`` (in ``session.caches["onnx.callbacks"]``)."""
    previous = getattr(_OWNER, "kept", None)
    _OWNER.kept = session.caches.setdefault("onnx.callbacks", [])
    try:
        yield
    finally:
        _OWNER.kept = previous


def _register_callback(callback):
    key = f"amanda.{next(_KEYS)}"
    _CALLBACKS[key] = callback
    kept = getattr(_OWNER, "kept", None)
    (kept if kept is not None else _UNOWNED).append(callback)
    return key


_is_array = host.is_array
#: what a tensor the routine receives as None is, in error messages
_UNHOSTED = "does not reach Python (a dtype onnxruntime-extensions cannot hand over)"


class _Callback:
    """Calls one action's routine from inside onnxruntime.

    An exception must not cross into onnxruntime (the extensions' host
    aborts the process): it is kept, the inputs are passed on, and the run
    that called it raises it (see `inference_session`).

    Args:
        action, where: the action and ``(op type, op id, namespace)``.
        count: how many tensors the routine selects.
        hosted: positions among them that reach Python (others are None).
        out_dtypes: dtypes of the results AmandaGet nodes produce.
        replacing: the action replaces the op.
        observe: the routine only looks: nothing reads its results (a side
            branch of the graph), so it returns nothing to onnxruntime.

    Attributes:
        constants: ``{position in hosted: read-only array}`` for initializers
            an observe-only routine reads without an ``AmandaPut`` (set by
            `amanda.runtime.onnx.observe._SideBranches`).
    """

    def __init__(self, action, where, count, hosted, out_dtypes, replacing, observe=False):
        self.action = action
        self.where = where
        self.count = count
        self.hosted = hosted
        self.out_dtypes = [np.dtype(d) for d in out_dtypes]
        self.replacing = replacing
        self.observe = observe
        self.constants = {}

    def __call__(self, arrays):
        return host.call_muted(self.action, self.where, self._call, arrays, self._failed,
                               catch=BaseException)   # noqa: BLE001 - must not reach onnxruntime

    def _failed(self, error, arrays):
        """Keep ``error`` for the run, and hand onnxruntime something."""
        _fail(error)
        if self.observe:
            return None
        if self.replacing:
            return [np.zeros((), d) for d in self.out_dtypes]
        return list(arrays)

    def _call(self, arrays):
        if self.replacing:
            # the op's inputs in, one array per output out (onnxruntime copies them)
            return host.replace(self.action, self.where, list(arrays), self.out_dtypes,
                                copy=False)
        values = host.spread(self.count, self.hosted, arrays)
        if self.observe:
            call_routine(self.action, values, _is_array, self.where)
            return None
        new = host.observe(self.action, self.where, values, self.hosted, _UNHOSTED)
        if new is None:
            return list(arrays)
        return [array if replacement is None else np.asarray(replacement)
                for array, replacement in zip(arrays, new)]


_runs = threading.local()


def current_run():
    """``(thread ident, serial)`` of the run the calling thread is inside.

    For routines that pair events within one run (e.g. a profiler's start
    and stop): onnxruntime's sequential executor calls hosted routines on
    the thread that called ``run``; the serial counts that thread's runs.
    """
    return threading.get_ident(), getattr(_runs, "serial", 0)


def _checked_run(run):
    """``run`` re-raising the first error a hosted routine met during it.

    The routine's error is raised with its own cause chained; when
    onnxruntime failed too (e.g. on a bad replacement), its error is the
    context. Both take the session first (see `set_run`).
    """
    def checked(*args, **kwargs):
        ident = threading.get_ident()
        _failures.pop(ident, None)
        _in_run.add(ident)
        _runs.serial = getattr(_runs, "serial", 0) + 1
        try:
            result = run(*args, **kwargs)
        except Exception:
            _in_run.discard(ident)
            failure = _take_failure(ident)
            if failure is not None:
                raise failure   # noqa: B904 - onnxruntime's error stays as __context__
            raise
        _in_run.discard(ident)
        failure = _take_failure(ident)
        if failure is not None:
            raise failure
        return result
    checked.__wrapped__ = run
    return checked


#: ``InferenceSession`` methods that run the model on the calling thread:
#: a session that hosts routines raises their errors from each of them.
CHECKED_RUNS = ("run", "run_with_ort_values", "run_with_iobinding", "run_with_ortvaluevector")


def run_methods():
    """Every ``InferenceSession`` method that runs the model (its name starts
    with ``run``): `CHECKED_RUNS`, ``run_async`` and any a later onnxruntime
    adds, which amanda refuses rather than letting it run routines silently."""
    return sorted(n for n in dir(ort.InferenceSession)
                  if n.startswith("run") and callable(getattr(ort.InferenceSession, n)))


def set_run(session, method, func):
    """Make ``session.<method>`` (a run method or ``io_binding``) call
    ``func(session, *args, **kwargs)``.

    **Rule: a session amanda made holds no reference to itself.** Its run
    methods are not functions in its ``__dict__`` (a function that calls
    the session must refer to it, and the session would then be freed only
    by the cyclic garbage collector, with its model and onnxruntime's
    buffers: a loop making sessions kept every one of them). The session's
    class becomes a subclass of its own (`_subclass_of`, the same name,
    one per class) whose run methods look up the function installed for
    this session in ``session._amanda_runs`` and bind it as a method does:
    ``session.run`` held elsewhere keeps the session alive as a plain
    session's bound method does, and a session dropped is freed at once.
    A method nothing was installed for is the class's own."""
    runs = session.__dict__.get("_amanda_runs")
    if runs is None:
        runs = session._amanda_runs = {}
        session.__class__ = _subclass_of(type(session))
    runs[method] = func


def installed_run(session, method):
    """``session.<method>`` as `set_run` installed it, or the class's own
    function: called with the session first."""
    found = session.__dict__.get("_amanda_runs", {}).get(method)
    return found if found is not None else class_run(session, method)


def class_run(session, method):
    """``session.<method>`` as its own class (not `_subclass_of`) defines
    it: a function called with the session first."""
    cls = type(session)
    if cls.__dict__.get("_amanda_subclass"):
        cls = cls.__bases__[0]
    return getattr(cls, method)


class _Run:
    """A run method of `_subclass_of` (see `set_run`)."""

    __slots__ = ("name", "base")

    def __init__(self, name, base):
        self.name, self.base = name, base

    def __get__(self, session, owner=None):
        if session is not None:
            found = session.__dict__.get("_amanda_runs", {}).get(self.name)
            if found is not None:
                return types.MethodType(found, session)
        return getattr(self.base, self.name).__get__(session, owner)


_SUBCLASSES = {}   # class -> its subclass for sessions amanda made
_SUBCLASSES_LOCK = threading.Lock()   # (its own: `_LOCK` guards registration)


def _subclass_of(cls):
    """``cls`` with the run methods of `set_run` (``cls`` itself if it is one)."""
    if cls.__dict__.get("_amanda_subclass"):
        return cls
    with _SUBCLASSES_LOCK:
        made = _SUBCLASSES.get(cls)
        if made is None:
            names = list(run_methods()) + ["io_binding"]
            namespace = {name: _Run(name, cls) for name in names}
            namespace.update(__slots__=(), __module__=cls.__module__,
                             __qualname__=cls.__qualname__, __doc__=cls.__doc__,
                             _amanda_subclass=True)
            made = _SUBCLASSES[cls] = type(cls.__name__, (cls,), namespace)
    return made


def refused_run(method, why):
    """A stand-in for ``session.<method>`` that raises a `BackendError`."""
    def refuse(*args, **kwargs):
        raise BackendError(f"InferenceSession.{method} cannot run this session's amanda "
                           f"routines: {why}")
    refuse.__name__ = method
    return refuse


def checked_session(session):
    """Make every way of running ``session`` (a session hosting Python
    routines) raise the routine error its run met, on the calling thread
    (`_checked_run`); ``run_async`` and run methods amanda does not know are
    refused: their routines would run on onnxruntime's pool, where an error
    cannot be told apart from another run's."""
    for method in run_methods():
        if method in CHECKED_RUNS:
            set_run(session, method, _checked_run(installed_run(session, method)))
        else:
            set_run(session, method, refused_run(
                method, "its Python routines would run on onnxruntime's thread pool, where "
                "amanda cannot raise a routine's error from the run that met it (it would "
                "reach another run, or no one). Use session.run, run_with_ort_values or "
                "run_with_iobinding"))
    return session


# Options the extensions' library was registered into; kept alive (sessions
# made with them point into the library's state), registered once each.
_registered_options = []
_default_options = []


def session_options(options=None):
    """``SessionOptions`` able to run models with hosted Python routines.

    Args:
        options: options to extend (the extensions' op library is registered
            into them once, and amanda keeps a reference to them), or None for
            amanda's shared default options.
    """
    get_library_path = extensions().get_library_path
    _catalog()   # before any registration: the op table must not grow afterwards
    with _LOCK:
        if options is None:
            if not _default_options:
                _default_options.append(ort.SessionOptions())
            options = _default_options[0]
        if not any(o is options for o in _registered_options):
            options.register_custom_ops_library(get_library_path())
            _registered_options.append(options)
    return options


def inference_session(model, sess_options=None, providers=None, **kwargs):
    """An ``onnxruntime.InferenceSession`` for a model from `amanda.instrument`.

    Registers the host of Python routines and makes ``run`` raise the
    amanda error a routine met (instead of onnxruntime's).

    Args:
        model: an ``onnx.ModelProto``, its bytes or a path.
        sess_options, providers, **kwargs: as for ``InferenceSession``.
    """
    data = load_model(model).SerializeToString()
    session = ort.InferenceSession.__new__(ort.InferenceSession)
    _original_init(session, data, session_options(sess_options),
                   providers or ["CPUExecutionProvider"], **kwargs)
    return checked_session(session)
