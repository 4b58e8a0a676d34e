"""Compiled PyTorch: tools run on ``torch.compile``d code, inside the compiled graphs.

While amanda is applied, every call of a compiled callable goes through
Dynamo's ``_callback_from_stance``, the function that picks the callback
(the compiler) for the call. amanda wraps it (`install`/`uninstall`) and picks
one of four ways for each call:

* **instrumented** (the thread is inside ``apply``, the tools have forward
  routines only): the call gets a callback of its own per (session, user's
  callback), whose compiler is `InstrumentingBackend`: the FX graph Dynamo
  captured is lifted into the IR (`lift_dynamo_graph`), the tools' analysis
  runs once on it, the actions are inserted into the graph (`insert_actions`)
  and the result is handed to the user's compiler (inductor by default).
  Dynamo keys its cache by the callback's backend, so the instrumented code
  is cached by Dynamo itself, beside the vanilla code: re-entering ``apply``
  with the same tools compiles nothing; other tools compile their own version.
  For the duration of the call amanda's eager machinery (its
  ``TorchFunctionMode`` and global module hooks) is taken out of the thread
  (`_Call`), so Dynamo neither traces it nor guards on it. Dynamo's per-frame
  callback is watched (`_WatchedFrames`): if the code Dynamo makes for a frame
  would run anything outside its graphs (a graph break: ``torch.nonzero``,
  ``.item()`` in a condition, ``print``; a frame Dynamo skips), that code is
  dropped before the frame starts, the machinery is put back and the call
  runs eagerly from there, with every op a point and eager's ids; the
  callable then stays eager inside ``apply`` (counted in `EAGER_FALLBACKS`);
* **vanilla** (inside ``amanda.disabled()``): the user's callback, with the
  eager machinery out of the way: the vanilla compiled code runs;
* **DDP's forward eagerly, its module instrumented and compiled**
  (``torch.compile(ddp_model)``; Dynamo too runs DDP's own forward as
  Python between graph breaks and compiles the module it wraps:
  `compiled.distributed`). A frame converted while a DDP forward runs is
  instrumented whole, then cut at DDP's buckets as Dynamo's DDPOptimizer
  would cut it;
* **eager** (everything the compiled path cannot do: tools with backward
  routines on a compiler without AOTAutograd, another thread's compiled code, an unexpected
  Dynamo layout): no callback, i.e. Dynamo's ``force_eager``: the Python code
  runs eagerly and amanda's eager runtime sees every op, as before this
  module existed. Points are never dropped silently.

Python routines become calls of opaque ``torch.library`` custom ops
(``amanda::observe``, side-effectful, and ``amanda::replace``, straight-through
for autograd), so they cause no graph break; portable routines
(`amanda.portable.routine`) are called inside the graph and traced by the
compiler like model code (`compiled.lowering`). Op ids and names are
eager's: the sites are read while Dynamo traces (`compiled.sites`).
"""

from __future__ import annotations

import collections
import inspect
import sys
import warnings
import weakref

import torch

from amanda import controls
from amanda.errors import BackendError, EagerFallbackWarning, user_stacklevel
from amanda.runtime.pytorch.compiled import sites as _sites
from amanda.runtime.pytorch.compiled.backward import (backward_compiler, runs_aot_autograd,
                                                      supports_backward)
from amanda.runtime.pytorch.compiled.distributed import (active_ddp, ddp_of_compiled_call,
                                                         hidden_from_dynamo, run_module_compiled,
                                                         split_at_buckets)
from amanda.runtime.pytorch.compiled.graphs import (  # noqa: F401 (re-exported)
    _FUNCTION,
    _MODULE_FILE,
    _graph_breaks,
    NAMESPACE,
    NoSite,
    NotLifted,
    _tls,
    _outside_graphs,
    lift_dynamo_graph,
)
from amanda.runtime.pytorch.compiled.lowering import insert_actions, with_constants
from amanda.runtime.pytorch.compiled.probe import _own_copy, analyse
from amanda.runtime.pytorch.eager.mode import _below_wrappers, _module_path

__all__ = ["NAMESPACE", "InstrumentingBackend", "install", "insert_actions", "lift_dynamo_graph",
           "uninstall"]

#: The namespace of contexts of compiled graphs.


#: True (the default): compiled callables inside ``apply`` run instrumented
#: compiled graphs (this module), with the limits in docs/pytorch-compiled.md;
#: what those graphs cannot show or carry (a graph break, backward
#: routines...) runs eagerly, every op a point (see `EAGER_FALLBACKS`).
#: False: compiled callables inside ``apply`` always run eagerly (Dynamo's
#: ``force_eager`` stance), exactly as eager.
ENABLED = True

#: Compiled callables that ran eagerly inside ``apply`` because Dynamo would
#: have run part of their code outside its graphs (a graph break, a frame it
#: skips) or the tools asked for an action compiled graphs cannot carry
#: (an in-place op's ``replace_op``...): reason -> number of fallbacks (one per callable and reason; the
#: callable then stays eager inside ``apply``). Read it to know which models
#: did not run compiled; nothing in them was lost, they ran like eager.
EAGER_FALLBACKS = collections.Counter()

_PATCH = {"original": None}
_CALLBACKS = {}   # (session token, id(user callback)) -> (user callback, amanda callback)
_EAGER = {}       # id(user callback) -> user callback, of callables that run eagerly inside apply


# -- Dynamo's callback --------------------------------------------------------------------

def install():
    """Route compiled calls through `_pick_callback` (while amanda is applied)."""
    if _PATCH["original"] is not None:
        return
    from torch._dynamo import eval_frame
    _PATCH["original"] = eval_frame._callback_from_stance
    eval_frame._callback_from_stance = _pick_callback
    _sites.install()


def uninstall():
    """Restore Dynamo's ``_callback_from_stance`` (the last scope left)."""
    original = _PATCH["original"]
    if original is not None:
        from torch._dynamo import eval_frame
        eval_frame._callback_from_stance = original
        _PATCH["original"] = None
    _sites.uninstall()


def _pick_callback(callback):
    chosen = _PATCH["original"](callback)
    if chosen is None or chosen is False or _PATCH["original"] is None:
        return chosen          # the user's stance runs it eagerly: amanda's eager runtime sees it
    call = _suspended_call()
    if call is not None:
        # a compiled call nested in one whose machinery is out: same choice as the outer call
        return call.choice(chosen)
    from amanda.runtime.pytorch.eager import segments as eager
    from amanda.tool import current_session

    st = getattr(eager._tls, "state", None)
    session = current_session()
    if st is None or not st.depth or session is None:
        return None            # another thread's compiled code while amanda is applied: eagerly
    caller = None
    if controls.state.disabled:
        choice = _vanilla
    elif not controls.state.cache:
        # analysis at every execution: a compiled graph is analysed once
        _note_fallback(callback, _UNCACHED)
        return None
    elif session.has_backward and not supports_backward(_user_compiler(callback)):
        # backward points are put in AOTAutograd's backward graphs, which
        # amanda makes for the compilers it knows only
        _note_fallback(callback, "the tools have backward routines and the callable's compiler "
                       f"({_compiler_name(callback)}) is not one amanda runs AOTAutograd for "
                       "(aot_eager, an aot_autograd(...) backend; inductor only with "
                       "amanda.runtime.pytorch.compiled.backward.INDUCTOR_BACKWARD, "
                       "docs/pytorch-compiled.md)")
        return None
    elif _EAGER.get(id(callback)) is callback:
        return None            # Dynamo breaks its graph: it runs eagerly inside apply
    else:
        ddp = ddp_of_compiled_call(st.modules[-1]() if st.modules else None, callback)
        if ddp is not None:
            # torch.compile(ddp_model): DDP's forward runs eagerly and the module it
            # wraps compiled, as Dynamo splits the call (compiled.distributed)
            cleanups = _caller_cleanups()
            if cleanups is None:
                _note_fallback(callback, "a Dynamo call layout amanda does not know")
                return None
            run_module_compiled(st.modules[-1](), ddp, cleanups)
            return None
        caller = _caller(st, callback)
        if not _within_dynamo_limit(st, session, callback, caller):
            return None        # Dynamo would refuse one more version in the middle of the call
        choice = _instrumented(session, callback, caller)
    cleanups = _caller_cleanups()
    stack = torch.overrides._get_current_function_mode_stack()
    if cleanups is None or not stack or stack[-1] is not st.mode:
        # a layout this module does not know: eagerly, never unseen
        _note_fallback(callback, "a Dynamo call layout or mode stack amanda does not know")
        return None
    call = _Call(st, choice, callback, caller)
    cleanups.append(call.resume)
    return choice(chosen)


#: the reason a compiled call inside ``amanda.cache_disabled()`` runs eagerly
_UNCACHED = ("amanda.cache_disabled() runs the analysis at every execution of an op, "
             "and a compiled graph is analysed once")

_NOTED = {}       # id(user callback) -> (user callback, reasons it ran eagerly for)


def _note_fallback(callback, reason):
    """A compiled callable runs eagerly inside ``apply`` for ``reason``:
    counted in `EAGER_FALLBACKS` and said by one `EagerFallbackWarning`, at
    the user's line, once per callable and reason."""
    entry = _NOTED.get(id(callback))
    if entry is None or entry[0] is not callback:
        entry = _NOTED[id(callback)] = (callback, set())
    if reason in entry[1]:
        return
    entry[1].add(reason)
    EAGER_FALLBACKS[reason] += 1
    warnings.warn(f"amanda: a torch.compile'd callable runs eagerly inside amanda.apply: {reason}. "
                  "Every op is still a point, with eager's op ids, but not at compiled speed "
                  "(docs/pytorch-compiled.md)", EagerFallbackWarning, stacklevel=user_stacklevel(torch))


def _caller(st, callback):
    """Where eager would put the ops of this compiled call: None at the top
    level (outside any module, or directly inside ``torch.compile(module)``'s
    ``OptimizedModule``), else (the eager path of the module the compiled code
    runs in, how many times this callable ran in that module earlier in the
    step, whether the compiled callable is that module). Eager names such
    ops by the calling module's path and counts a
    helper's calls as occurrences: the instrumented code is cached per
    caller (`_instrumented`), and ids are given from it (`_Ids`)."""
    if not st.modules or not _below_wrappers(st.modules):
        return None
    refs = st.modules
    top = refs[-1]()
    inner = getattr(top, "_orig_mod", None)
    module = isinstance(inner, torch.nn.Module)
    if module:                                  # a compiled submodule of an eager module
        refs = refs + [weakref.ref(inner)]
        top = inner
    key = ("amanda compiled call", id(top), id(callback))   # cleared with the step's counts
    calls = st.counts.get(key, 0)
    st.counts[key] = calls + 1
    return _module_path(refs), calls, module


_VERSIONS = {}    # compiled code target -> {(session token, id(callback), caller)}
_TOO_MANY = "more instrumented versions than Dynamo's recompile limit allows"
_SEEN_CODES = [0]  # codes Dynamo had seen at the last check: fewer means torch._dynamo.reset()


def _within_dynamo_limit(st, session, callback, caller):
    """Whether Dynamo can cache one more instrumented version of this code.
    Each (session, callable, caller) is a backend of its own, i.e. a cache
    entry of the code Dynamo compiles (shared by every layer of one class);
    past ``torch._dynamo.config.recompile_limit`` Dynamo refuses to compile in
    the middle of the call (which falls back with eager's ids, as any refusal
    does: docs/pytorch-compiled.md), after it tried. So once the versions of a
    code target reach the limit less two (one for the vanilla code, one
    spare), new ones run eagerly from the start, counted in `EAGER_FALLBACKS`."""
    top = st.modules[-1]() if st.modules else None
    inner = getattr(top, "_orig_mod", None)
    target = type(inner) if isinstance(inner, torch.nn.Module) else id(callback)
    from torch._dynamo import config, convert_frame
    seen = len(getattr(convert_frame.input_codes, "seen", ()))
    if seen < _SEEN_CODES[0]:
        _VERSIONS.clear()            # Dynamo's caches were reset
    _SEEN_CODES[0] = seen
    versions = _VERSIONS.setdefault(target, set())
    key = (session.token, id(callback), caller)
    if key in versions:
        return True
    if len(versions) >= getattr(config, "recompile_limit", 8) - 2:
        _note_fallback(callback, _TOO_MANY)
        return False
    versions.add(key)
    return True


def _vanilla(callback):
    return callback


def _instrumented(session, user_callback, caller):
    def choose(callback):
        key = (session.token, id(callback), caller)
        entry = _CALLBACKS.get(key)
        if entry is None or entry[0] is not callback:
            entry = _CALLBACKS[key] = (callback, _amanda_callback(callback, session, user_callback,
                                                                  caller))
        return entry[1]
    return choose


def _user_compiler(callback):
    inner = getattr(callback, "_torchdynamo_orig_backend", None)
    return getattr(inner, "_torchdynamo_orig_backend", None)


def _compiler_name(callback):
    compiler = _user_compiler(callback)
    return getattr(compiler, "__name__", None) or type(compiler).__name__


def _amanda_callback(callback, session, user_callback, caller=None):
    from torch._dynamo import eval_frame
    inner = callback._torchdynamo_orig_backend
    user_compiler = getattr(inner, "_torchdynamo_orig_backend", None)
    if user_compiler is None or not hasattr(inner, "_clone_with_backend"):
        raise BackendError("amanda cannot read the compiler of this torch.compile'd callable; "
                           "run it with torch.compiler.set_stance('force_eager')")
    backend = InstrumentingBackend(session, user_compiler, caller)
    hooks = getattr(callback, "hooks", None) or eval_frame.Hooks()
    from torch._dynamo import convert_frame
    return _WatchedFrames(convert_frame.catch_errors_wrapper(inner._clone_with_backend(backend), hooks),
                          user_callback)


def _caller_cleanups():
    """The ``cleanups`` list of Dynamo's ``compile_wrapper`` that called
    ``_callback_from_stance``: its entries run when the compiled call ends."""
    frame = sys._getframe(2)
    if frame.f_code.co_name != "compile_wrapper":
        return None
    cleanups = frame.f_locals.get("cleanups")
    return cleanups if type(cleanups) is list else None


def _suspended_call():
    calls = getattr(_tls, "calls", None)
    if calls:
        call = calls[-1]
        if call.out:
            return call
    return None


class _Call:
    """One compiled call on the instrumented path. amanda's eager machinery
    (its ``TorchFunctionMode``, global module hooks, the autograd-engine hook)
    is out of the thread while Dynamo's code runs, so Dynamo neither traces
    it nor guards on it; `resume` puts it back, at the call's end or as soon
    as the call falls back to eager (`fall_back`)."""

    __slots__ = ("st", "mode", "saved_hooks", "mute", "choice", "callback", "out", "entered",
                 "compiled", "module", "caller", "base", "ran")

    def __init__(self, st, choice, callback, caller=None):
        self.st = st
        self.choice = choice
        self.callback = callback
        self.caller = caller
        self.entered = []      # modules whose calls amanda's pre-hook missed (see _enter_modules)
        self.compiled = False  # a frame of this call got code from Dynamo (its graphs run)
        called = st.modules[-1]() if st.modules else None
        self.module = getattr(called, "_orig_mod", None)   # torch.compile(module)'s module
        # the module the ops of this call's graphs are counted from (see count_graphs):
        # the compiled module, or the eager module a compiled function runs in
        self.base = self.module if self.module is not None or caller is None else called
        self.ran = []          # LiftedGraph.counts of the graphs that ran in this call
        torch._C._pop_torch_function_stack()
        self.mode = st.mode
        hooks = torch.nn.modules.module
        from amanda.runtime.pytorch.eager.driver import DRIVER
        ids = {handle.id for handle in DRIVER._handles}
        self.saved_hooks = []
        for table in (hooks._global_forward_pre_hooks, hooks._global_forward_hooks):
            self.saved_hooks.append((table, list(table.items())))
            for key in ids & set(table):
                del table[key]
        # disabled: the patched autograd engine must not push the mode back while
        # AOTAutograd traces the joint graph, nor at the compiled backward
        self.mute = controls.muted()
        self.mute.__enter__()   # ended by _put_back, when the call resumes amanda's machinery
        self.out = True
        calls = getattr(_tls, "calls", None)
        if calls is None:
            calls = _tls.calls = []
        calls.append(self)

    def resume(self):
        """Put amanda's machinery back (once; again is a no-op) and forget the call."""
        calls = _tls.calls
        if self.out:
            self._put_back()
        if self.ran:
            self.count_graphs()
        modules = self.st.modules
        for module in reversed(self.entered):   # their calls ended with this call
            if modules and modules[-1]() is module:
                modules.pop()
        self.entered = []
        if calls and calls[-1] is self:
            calls.pop()
        elif self in calls:
            calls.remove(self)

    def _put_back(self):
        self.out = False
        self.mute.__exit__(None, None, None)
        for table, items in self.saved_hooks:
            added = [(k, v) for k, v in table.items() if k not in dict(items)]
            table.clear()
            table.update(items)
            table.update(added)
        self.saved_hooks = None
        torch._C._push_on_torch_function_stack(self.mode)

    def fall_back(self, reason, refused=None):
        """Dynamo would run code of this call outside its graphs, where amanda
        cannot see it: from now on the call runs eagerly, with amanda's
        machinery back, and the callable stays eager inside ``apply``."""
        if _EAGER.get(id(self.callback)) is not self.callback:
            _EAGER[id(self.callback)] = self.callback
            _note_fallback(self.callback, reason)
        if self.out:
            self._put_back()
            self._enter_modules(refused)
        if self.ran:
            self.count_graphs()

    def count_graphs(self):
        """Adds the executions of the graphs that ran in this call to eager's
        occurrence counts of the step, as if their ops had run eagerly, so an
        op that runs eagerly later in the step (the rest of this call after a
        fallback, a later call of the callable in the step that falls back or
        runs eagerly) gets the occurrence, and the id, eager gives it."""
        ran, self.ran = self.ran, []
        base = self.base
        if base is None:
            return     # a compiled function outside modules: its ops have no occurrence
        counts = self.st.counts
        modules = {}
        for graph in ran:
            for (below, code, offset, raw), n in graph.items():
                ref = modules.get(below)
                if ref is None:
                    try:
                        ref = modules[below] = weakref.ref(base.get_submodule(below))
                    except (AttributeError, TypeError):
                        continue
                key = (ref, code, offset, raw)
                counts[key] = counts.get(key, 0) + n

    def _enter_modules(self, refused=None):
        """The module calls this call is in the middle of, between Dynamo's
        ``compile_wrapper`` and the frame that falls back (``Module.__call__``
        frames, which Dynamo runs as plain Python), began while amanda's
        module hooks were out: their modules are put on amanda's module stack,
        outermost first, as the pre-hook would have, so the ops get eager's
        module paths and ids. `resume` takes them off. A ``_call_impl`` that
        has not read the hooks yet (it is calling ``torch.compiler.is_compiling``,
        ``refused``, which Dynamo skips) runs amanda's pre-hook itself: it is
        left alone, or its module would be on the stack twice."""
        from amanda.runtime.pytorch.eager.driver import _module_pre_hook
        calls = []
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename == __file__:
            frame = frame.f_back          # to the caller of the refused frame
        before_hooks = refused is not None and refused.f_code.co_name == "is_compiling"
        while frame is not None and frame.f_code.co_name != "compile_wrapper":
            if frame.f_code.co_filename == _MODULE_FILE and frame.f_code.co_name == "_call_impl":
                module = frame.f_locals.get("self")
                if isinstance(module, torch.nn.Module) and not before_hooks:
                    calls.append((module, frame.f_locals.get("args", ())))
            before_hooks = False
            frame = frame.f_back
        for module, args in reversed(calls):
            _module_pre_hook(module, args)
            self.entered.append(module)


#: Frames Dynamo runs as plain Python that compute nothing themselves
#: (``Module.__call__``'s wrappers: the hooks and ``forward`` they call are
#: frames of their own, which Dynamo compiles or amanda sees).
def _run_eagerly():
    """Dynamo's answer for a frame (and the frames it calls) to run as plain
    Python, for this call only (the code is not marked for later calls)."""
    from torch._dynamo.types import ConvertFrameReturn, FrameAction, FrameExecStrategy
    return ConvertFrameReturn(frame_exec_strategy=FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP),
                              apply_to_code=False)


def _owner(frame, call):
    """``(class, source, module)`` of the module whose method ``frame`` runs (the
    root of its ops' module paths; ``source`` is where Dynamo finds it among
    the frame's locals, dotted as `_module_path` reads Dynamo's module
    stacks: ``L.self``, ``L.args.0``), or `_FUNCTION`. **Rule:** the
    module is the frame's first positional argument, named (``self``) or the
    first element of its ``*args`` (a decorator's ``wrapper(*args,
    **kwargs)`` around ``forward``: transformers 5.24's ``deprecate_kwarg``),
    when that parameter is named ``self`` (a ``forward``, a decorator's
    wrapper of it, the ``_call_impl`` of ``module.compile()``) or the
    argument is the module the compiled call was made on
    (``torch.compile(module)``, whatever the parameter's name)."""
    code = frame.f_code
    if code.co_argcount:
        name = code.co_varnames[0]
        first, source = frame.f_locals.get(name), "L." + name
    elif code.co_flags & inspect.CO_VARARGS:
        name = code.co_varnames[code.co_kwonlyargcount]
        args = frame.f_locals.get(name)
        first = args[0] if isinstance(args, tuple) and args else None
        source = f"L.{name}.0"
    else:
        return _FUNCTION
    if isinstance(first, torch.nn.Module) and (name == "self" or first is call.module):
        return type(first), source, first
    return _FUNCTION


def _amanda_cause(error):
    """The amanda error (a tool's `ToolError`...) that Dynamo wrapped, as
    ``BackendCompilerFailed`` or another of its errors, when an analysis
    routine failed while Dynamo compiled; None for any other error."""
    from amanda.errors import AmandaError
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, AmandaError):
            return error
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return None


class _WatchedFrames:
    """Dynamo's per-frame callback for amanda's compiled calls. Dynamo calls it
    for a frame that has no cached code; the frame has not started. If the code
    Dynamo makes for it would run anything outside its graphs, or the tools
    asked for an action compiled graphs cannot carry (``replace_op`` of an
    in-place op, an after-routine that may replace the result of an op
    returning None, a Python routine under ``amanda.ad_enabled()``), that code is dropped (never cached, never run)
    and the call falls back to eager before any of the frame runs: amanda's
    mode sees every op of it, as in eager."""

    def __init__(self, inner, user_callback):
        self.inner = inner
        self.user_callback = user_callback
        self._torchdynamo_orig_backend = inner._torchdynamo_orig_backend
        self.hooks = inner.hooks

    def __call__(self, frame, cache_entry, frame_state):
        call = _suspended_call()
        if call is None:
            return _run_eagerly()         # the call fell back: the rest of it runs eagerly
        breaks = _graph_breaks()
        _tls.breaks = breaks
        _tls.unsupported = None
        _tls.owner = _owner(frame, call)
        _tls.scope = {"L": frame.f_locals, "G": frame.f_globals}   # Dynamo's sources' roots
        _tls.ddp = ddp = active_ddp()   # amanda splits the graph after instrumenting it
        try:
            # nodes get the sites eager gives their ops; Dynamo's DDPOptimizer
            # does not cut the graph before amanda has it (InstrumentingBackend)
            with _sites.tracing(), hidden_from_dynamo(ddp):
                result = self.inner(frame, cache_entry, frame_state)
        except Exception as error:
            cause = _amanda_cause(error)
            if cause is None:
                raise
            raise cause      # the tool's error (its cause chained), not Dynamo's wrapper
        finally:
            _tls.breaks = _tls.owner = _tls.scope = _tls.ddp = None
        reason = _tls.unsupported or _outside_graphs(frame, result, breaks, call)
        _tls.unsupported = None
        if reason is None:
            return result
        call.fall_back(reason, frame)
        return _run_eagerly()


class InstrumentingBackend:
    """The Dynamo backend of one session: instrument, then the user's compiler.

    Args:
        session: the applied tools.
        compiler: the user's compiler function (inductor, ``aot_eager``...).
        caller: where eager would put the call's ops (`_caller`), or None.
    """

    def __init__(self, session, compiler, caller=None):
        self.session = session
        self.compiler = compiler
        self.caller = caller
        self.graphs = 0

    def __call__(self, gm, example_inputs, **kwargs):
        breaks = getattr(_tls, "breaks", None)
        if breaks is not None and _graph_breaks() != breaks:
            # a partial graph before a graph break: the frame's code is dropped
            # and the call runs eagerly (_WatchedFrames), so the tools' analysis
            # must not see these ops twice
            return gm.forward
        try:
            lifted = lift_dynamo_graph(gm, getattr(_tls, "owner", None), self.caller)
        except NoSite as error:
            if breaks is None:
                raise BackendError(f"{error}: amanda cannot give it eager's op id "
                                   f"[namespace {NAMESPACE}]") from None
            # its eager id is unknown: the frame's code is dropped and the call
            # runs eagerly (_WatchedFrames), before any tool saw the graph
            _tls.unsupported = str(error) if isinstance(error, NotLifted) else \
                f"{error} (its eager op id is unknown)"
            return gm.forward
        plan = analyse(lifted, self.session, gm, example_inputs)
        self.graphs += 1
        spliced = _Spliced.of(lifted, gm) if self.session.requires_graph else None
        if plan:
            gm = _own_copy(gm, lifted)
            try:
                insert_actions(gm, lifted, plan)
            except BackendError as error:
                if breaks is None:
                    raise          # not under amanda's frame callback: say it
                # an action compiled graphs cannot carry (an in-place op's replace_op...): the
                # frame's code is dropped and the call runs eagerly (_WatchedFrames)
                _tls.unsupported = str(error)
                return gm.forward
        constants = gm.__dict__.get("amanda_constants", [])
        compiler = self.compiler
        if runs_aot_autograd(compiler):
            # AOTAutograd run by amanda, the user's compiler inside: the backward
            # graph gets the tools' backward points (where `supports_backward`
            # let a session with backward routines get here) and runs outside
            # eager's mode
            compiler = backward_compiler(compiler, self.session, lifted, plan)
        ddp = getattr(_tls, "ddp", None)
        if ddp is not None:
            # DDPOptimizer's pieces, cut from the instrumented graph (compiled.distributed)
            compiler = split_at_buckets(compiler, ddp)
        compiled = with_constants(compiler(gm, list(example_inputs) + constants, **kwargs),
                                  constants)
        if spliced is not None:
            compiled = spliced.around(compiled)
        if self.caller is None or not lifted.counts:
            return compiled
        return _Counted(compiled, lifted.counts)


class _Spliced:
    """For tools that ask for whole graphs (``requires_graph``): each run of
    a compiled graph is recorded in the step's eager trace as the ops it
    ran (`EagerTrace.splice`), so the step's graph, handed to the tools when
    the step ends, is eager's, whether its ops ran compiled or eagerly."""

    __slots__ = ("graph", "op_ids", "modules", "positions", "constants", "outputs")

    @classmethod
    def of(cls, lifted, gm):
        self = cls()
        self.graph, self.op_ids, self.modules = lifted.graph, lifted.op_ids, lifted.module_paths
        # IR input name -> position among the compiled graph's arguments (its
        # placeholders, in order), or the module attribute a get_attr reads
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.positions = {n.name: i for i, n in enumerate(placeholders)}
        self.constants = {}
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                try:
                    self.constants[node.name] = gm.get_parameter(node.target)
                except AttributeError:
                    self.constants[node.name] = getattr(gm, node.target, None)
        results = torch.fx.node.map_aggregate(gm.graph.output_node().args[0], lambda n: n)
        flat = results if isinstance(results, (list, tuple)) else [results]
        self.outputs = [lifted.tensors.get(n) if isinstance(n, torch.fx.Node) else None
                        for n in flat]
        return self

    def around(self, compiled):
        from amanda.runtime.pytorch.eager import segments

        def run(*args):
            result = compiled(*args)
            st = getattr(segments._tls, "state", None)
            trace = st.cache.trace if st is not None and st.cache is not None else None
            if trace is not None:
                inputs = {name: args[i] for name, i in self.positions.items() if i < len(args)}
                inputs.update(self.constants)
                flat = result if isinstance(result, (list, tuple)) else [result]
                trace.splice(self.graph, self.op_ids, self.modules, inputs,
                             [(t, r) for t, r in zip(self.outputs, flat) if t is not None])
            return result
        return run


class _Counted:
    """A graph compiled for a caller (a compiled part of an eager module):
    each run is noted in the call, whose `_Call.count_graphs` adds its ops'
    executions to eager's occurrence counts of the step."""

    __slots__ = ("compiled", "counts")

    def __init__(self, compiled, counts):
        self.compiled = compiled
        self.counts = counts

    def __call__(self, *args, **kwargs):
        calls = getattr(_tls, "calls", None)
        if calls:
            calls[-1].ran.append(self.counts)
        return self.compiled(*args, **kwargs)
