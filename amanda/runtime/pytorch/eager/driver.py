"""PyTorch eager driver: ``DRIVER`` and what it installs while applied.

``TorchEagerDriver`` pushes the mode per thread and adds the two global
module hooks (``_module_pre_hook``/``_module_post_hook``: the stack of
modules being called, steps, checkpointed segments) at the outermost
``apply`` scope, and removes them when it exits; meanwhile autograd's engine
entry runs backward passes under the thread's mode, and ``torch.compile``'d
code runs instrumented (:mod:`amanda.runtime.pytorch.compiled`) or eagerly.
Part of :mod:`amanda.runtime.pytorch`.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import warnings
import weakref

import torch
from torch.nn.modules import module as _torch_module

from amanda.errors import NotBitExactWarning, NotInstrumentedWarning, user_stacklevel
from amanda.runtime.driver import Driver
from amanda.runtime.pytorch.eager import records as _records
from amanda.runtime.pytorch.eager.backward import (
    install_quick_registration, remove_quick_registration)
from amanda.runtime.pytorch.eager.mode import WRAPPER_MODULES, _Mode
from amanda.runtime.pytorch.eager.records import _Cache, _StraightThrough
from amanda.runtime.pytorch.eager.routines import _grad_enabled
from amanda.runtime.pytorch.eager.segments import (
    _FORWARD, _RECOMPUTE, _checkpoint_role, _drop_finished, _in_backward, _state, _tls)
from amanda.runtime.pytorch.eager.sites import _CONTROLS, _getframe


_SCRIPT_MODULE = torch.jit.ScriptModule


def _warn_scripted(st, module):
    """A TorchScript module (``torch.jit.script``/``trace``) runs its ops in
    TorchScript's interpreter, which never reaches ``__torch_function__``: say
    so once per module and scope rather than count nothing silently."""
    st.scripted.add(id(module))
    name = next((n for n, _ in _named_parents(st, module)), None)
    where = f" ({name})" if name else ""
    kind = getattr(module, "original_name", None) or type(module).__name__
    warnings.warn(
        f"amanda: {kind}{where} is a TorchScript module; the ops it runs "
        "are executed by TorchScript, not seen by amanda, and get no instrumentation "
        "points (run the eager module inside apply instead). See docs/pytorch-eager.md, "
        "Limits.", NotInstrumentedWarning, stacklevel=user_stacklevel(torch))


# module type -> the TorchScript functions its ``forward`` names (globals
# and closure variables), found once per type
_SCRIPT_FUNCTIONS = {}


def _script_functions(cls):
    """**Rule: a TorchScript function a module's forward calls is said.** A
    ``torch.jit.script``ed function runs its ops in TorchScript's
    interpreter, which never reaches ``__torch_function__``: the ops it ran
    (and their backward nodes) had no points and nothing said so. The names
    ``forward`` reads (its globals and closure variables) are looked at once
    per module type; a helper called from forward that calls the function
    itself is not followed."""
    found = ()
    try:
        forward = cls.forward
        code = forward.__code__
        scope = forward.__globals__
        cells = dict(zip(code.co_freevars, forward.__closure__ or ()))
        values = [scope.get(name) for name in code.co_names]
        for cell in cells.values():
            try:
                values.append(cell.cell_contents)
            except ValueError:        # an empty cell
                pass
        found = tuple({id(v): v for v in values
                       if isinstance(v, torch.jit.ScriptFunction)}.values())
    except AttributeError:            # no Python forward (a ScriptModule, a builtin)
        pass
    _SCRIPT_FUNCTIONS[cls] = found
    return found


def _warn_script_functions(st, module, functions):
    for function in functions:
        key = ("script function", id(function))
        if key in st.scripted:
            continue
        st.scripted.add(key)
        warnings.warn(
            f"amanda: {type(module).__name__}.forward calls the TorchScript function "
            f"{getattr(function, 'name', function)!r}; the ops it runs are executed by "
            "TorchScript, not seen by amanda, and get no instrumentation points (call "
            "the Python function inside apply instead). See docs/pytorch-eager.md, Limits.",
            NotInstrumentedWarning, stacklevel=user_stacklevel(torch))


# torch modules whose forward takes a fused fast path (in eval) only when no
# torch-function mode is on (torch.overrides.has_torch_function)
_FAST_PATH = frozenset((torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer,
                        torch.nn.TransformerEncoder))


def _warn_fast_path(st, module):
    """Inside ``apply`` amanda's mode is on, so these modules take their
    ordinary path: the result may differ from a run outside by rounding,
    and no nested tensor is made (positions a padding mask hides hold
    computed values where the fast path gives zeros). Said once per scope."""
    st.scripted.add("fast path")
    warnings.warn(
        f"amanda: {type(module).__name__} takes its ordinary path inside apply, not "
        "torch's fused fast path (which refuses to run while a torch-function mode is "
        "on); outputs may differ from a run outside apply by rounding, and positions a "
        "padding mask hides are computed instead of zero (no nested tensor). See "
        "docs/pytorch-eager.md, Limits.", NotBitExactWarning,
        stacklevel=user_stacklevel(torch))


def _named_parents(st, module):
    """(name, parent) for ``module`` in the module being called around it."""
    parent = st.modules[-1]() if st.modules else None
    if parent is None:
        return ()
    return [(n, parent) for n, child in parent.named_children() if child is module]


#: how many times the module hooks were installed: a thread outside any
#: scope is warned once per installation (`_warn_other_thread`)
_SCOPES = [0]


def _warn_other_thread(module):
    """**Rule: a module called in a thread outside any ``apply`` scope
    while another thread is inside one is said to run uninstrumented.**
    Scopes are per thread (the contract): the call runs plain PyTorch. The
    module hooks are global, so they see the call: amanda says so once per
    thread while the hooks stay installed, rather than count nothing
    silently."""
    _tls.outside_warned = _SCOPES[0]
    warnings.warn(
        f"amanda: {type(module).__name__} is called in thread "
        f"{threading.current_thread().name!r}, outside any amanda.apply scope, while "
        "another thread is inside one: scopes are per thread, so its ops get no "
        "instrumentation points (enter apply in that thread). See docs/pytorch-eager.md, "
        "Leaving apply.", NotInstrumentedWarning, stacklevel=user_stacklevel(torch))


#: the code of the function inside ``Module._call_impl`` that runs the hooks
_HOOKS_CODE = next(c for c in torch.nn.Module._call_impl.__code__.co_consts
                   if getattr(c, "co_name", None) == "inner")


def _module_pre_hook(module, args):
    """Global forward pre-hook while amanda is applied: keeps the stack of
    modules being called. (Wrapping ``nn.Module.__call__`` would be cheaper
    per call, but assigning a class attribute of ``nn.Module`` invalidates the
    type caches of every subclass, which costs ~0.5 ms per apply scope.)

    Module calls inside ``amanda.disabled()`` are not tracked: the code after
    the block sees the same modules, steps and counts as if it had not run."""
    st = getattr(_tls, "state", None)
    if st is None or not st.depth:
        if getattr(_tls, "outside_warned", None) != _SCOPES[0]:
            _warn_other_thread(module)
        return
    if _CONTROLS.disabled:
        if _in_backward() == -1 and _grad_enabled():
            role, token = _checkpoint_role(_getframe(1))
            if role is _FORWARD:
                st.checkpointed(module, args, token, None)   # its recomputation stays muted
        return
    if _COMPILE["prior"] is None and type(module).__name__ == "OptimizedModule":
        with DRIVER._lock:
            _compile_eagerly()     # compiled after apply was entered
    if isinstance(module, _SCRIPT_MODULE) and id(module) not in st.scripted:
        _warn_scripted(st, module)
    functions = _SCRIPT_FUNCTIONS.get(type(module))
    if functions is None:
        functions = _script_functions(type(module))
    if functions:
        _warn_script_functions(st, module, functions)
    elif type(module) in _FAST_PATH and not module.training \
            and "fast path" not in st.scripted and torch.backends.mha.get_fastpath_enabled():
        _warn_fast_path(st, module)
    modules = st.modules
    caller = _getframe(1)
    role, token = _checkpoint_role(caller)
    if _in_backward() != -1:
        if role is _FORWARD:
            st.checkpointed(module, args, token, st.cache)  # a first run in a recomputation
        elif role is _RECOMPUTE or not modules:
            st.recompute(module, args, role is _RECOMPUTE, token)
    else:
        if st.recomputing:
            st.end_recompute()
        if modules:
            _drop_finished(st, caller)
        if not modules:
            st.new_step()                  # a root module call starts a step
        else:
            st.parents[id(module)] = modules[:]
        if role is not None:
            st.checkpointed(module, args, token, st.cache)
    frames = st.frames
    if len(frames) != len(modules):      # the stack was set by a recomputation
        frames[:] = [None] * len(modules)
    modules.append(weakref.ref(module))
    # the frame of Module.__call__ running the hooks; None when another
    # caller runs this hook (the compiled path, for calls Dynamo ran)
    frames.append(caller if caller.f_code is _HOOKS_CODE else None)


def _module_post_hook(module, args, output):
    st = getattr(_tls, "state", None)
    if st is None or not st.depth:
        return
    modules = st.modules
    if modules and modules[-1]() is module:
        modules.pop()
        del st.frames[len(modules):]
        if st.recomputing and len(modules) == st.base:
            st.end_segment()         # the stack stays: see _ThreadState.recompute


# -- the driver ----------------------------------------------------------------------

class TorchEagerDriver(Driver):
    """Activates the mode and the module hooks per thread for ``apply``.

    The process-wide part is the shared lifecycle
    (`amanda.runtime.driver.Driver`): the module hooks, the engine entry and
    ``torch.compile``'s routing are installed when the first thread enters
    and removed when the last one leaves. The per-thread part is its own:
    the thread's depth is ``st.depth``, which the mode and the hooks read on
    every call, a nested scope swaps the analysis cache, and every scope's
    end finishes a traced step.
    """

    def __init__(self):
        super().__init__()
        self._handles = []

    def enter(self, session):
        # the class is set where the autograd walk reads it (once, for all threads)
        if _records._STRAIGHT_THROUGH_NODE is None:
            _records._STRAIGHT_THROUGH_NODE = _StraightThrough._backward_cls
        st = _state()
        cache = session.caches.get("pytorch")
        if cache is None:
            cache = session.caches["pytorch"] = _Cache(session)
        st.depth += 1
        if st.depth == 1:
            st.reset(cache)
            try:
                self._acquire()
            except BaseException:
                st.depth -= 1
                raise
            st.mode = _Mode(st)
            try:
                st.mode.__enter__()
            except BaseException:
                self._release()
                st.depth -= 1
                raise
        else:
            st.cache = cache

    def exit(self, session, restored):
        st = _state()
        cache = session.caches.get("pytorch")
        try:
            if cache is not None and cache.trace is not None:
                cache.trace.finish()  # a scope's end ends the traced step (tools may raise)
        finally:
            self._leave(st, restored)

    def _leave(self, st, restored):
        """Pop one scope: at the outermost, remove the mode and hooks."""
        st.depth -= 1
        if st.depth == 0:
            if st.forked:                    # a forked child leaves its copy of the scope
                st.forked = False
                _CONTROLS.disabled = False
            mode = st.mode
            st.reset(None)
            st.mode = None
            try:
                mode.__exit__(None, None, None)
            finally:
                self._release()
        else:
            st.cache = restored.caches["pytorch"]

    def install(self):
        _SCOPES[0] += 1
        self._handles = [
            _torch_module.register_module_forward_pre_hook(_module_pre_hook),
            _torch_module.register_module_forward_hook(_module_post_hook, always_call=True),
        ]
        _patch_engine()
        _patch_graph_capture()
        _recompute_whole_segments()
        install_quick_registration()
        if "torch._dynamo" in sys.modules:
            _compile_eagerly()

    def uninstall(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        _restore_engine()
        _restore_graph_capture()
        _restore_early_stop()
        remove_quick_registration()
        _restore_compile()


_EARLY_STOP = []    # the user's checkpoint early-stop setting while apply holds it


def _recompute_whole_segments():
    """**Rule: a recomputed op runs whole, points and all.** Non-reentrant
    activation checkpointing stops recomputing a segment as soon as it has
    the tensors backward needs (its "early stop"), by raising out of the op
    that saves the last of them: that op's before-routines had run and its
    after-routines never did (a LLaMA layer's last projections ran their
    before-routines twice a step and their after-routines once). Inside
    ``apply`` segments checkpointed there are recomputed whole, as
    ``torch.utils.checkpoint.set_checkpoint_early_stop(False)`` does: the
    same values, the rest of each segment recomputed too."""
    import torch.utils.checkpoint as checkpoint
    _EARLY_STOP.append(checkpoint._enable_checkpoint_early_stop)
    checkpoint._enable_checkpoint_early_stop = False


def _restore_early_stop():
    if _EARLY_STOP:
        import torch.utils.checkpoint as checkpoint
        checkpoint._enable_checkpoint_early_stop = _EARLY_STOP.pop()


# -- forked processes -----------------------------------------------------------------

def _after_fork_in_child():
    """**Rule: a process forked inside ``apply`` runs uninstrumented.** A
    DataLoader worker (or any ``fork``) inherits the thread's mode and
    hooks: without this, the dataset's and collate's torch calls ran the
    routines of the child's *copy* of the tools, whose counts, traces and
    state the parent never sees. The child is muted as by ``disabled()``
    until it leaves its copy of the scope (a child that goes on running the
    parent's code); the parent says so (`_after_fork_in_parent`)."""
    st = getattr(_tls, "state", None)
    if st is not None and st.depth and not _CONTROLS.disabled:
        st.forked = True
        _CONTROLS.disabled = True


def _after_fork_in_parent():
    st = getattr(_tls, "state", None)
    if st is None or not st.depth or _CONTROLS.disabled or st.fork_warned:
        return
    st.fork_warned = True
    warnings.warn(
        "amanda: a process forked inside apply (a DataLoader worker, multiprocessing's "
        "fork) runs its torch calls uninstrumented: routines run in this process only "
        "(load data with num_workers=0 to instrument it). See docs/pytorch-eager.md, "
        "Limits.", NotInstrumentedWarning, stacklevel=user_stacklevel(torch, multiprocessing))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child,
                        after_in_parent=_after_fork_in_parent)


# -- the backward pass ------------------------------------------------------------

# torch pops the mode while its handler runs a call, and ``backward()`` is
# such a call: without help, the Python code autograd runs during backward
# (activation checkpointing's recomputation, Python autograd functions, tensor
# hooks) would run with no mode. While amanda is applied, the engine entry
# that ``torch.autograd.backward``/``grad`` call pushes the thread's mode back
# for the duration of the pass.
_ENGINE = {"original": None}
_function_mode_stack = torch.overrides._get_current_function_mode_stack


#
# On an accelerator, autograd runs a pass's nodes on a device thread of its
# own, where none of the caller's per-thread state holds: ``disabled()``,
# ``cache_disabled()``, the scope and its module stack (a checkpointed
# region recomputed there was "another thread outside any scope", its
# points dropped; a pass inside ``disabled()`` ran its backward routines).
# So every pass started while amanda is applied runs on the calling thread,
# as it does on the CPU (``set_multithreading_enabled(False)``: torch's own
# switch, which puts every node on the caller's ready queue; values and
# streams are the same, only passes spanning several devices lose their
# device threads' parallelism).
_single_threaded = torch.autograd.set_multithreading_enabled


def _run_backward_seen(*args, **kwargs):
    st = getattr(_tls, "state", None)
    mode = st.mode if st is not None and st.depth else None
    with _single_threaded(False):
        if mode is None or _CONTROLS.disabled or any(
                m is mode for m in _function_mode_stack()):
            return _ENGINE["original"](*args, **kwargs)
        with mode:
            return _ENGINE["original"](*args, **kwargs)


def _patch_engine():
    import torch.autograd as autograd
    _ENGINE["original"] = autograd._engine_run_backward
    autograd._engine_run_backward = _run_backward_seen


def _restore_engine():
    import torch.autograd as autograd
    if _ENGINE["original"] is not None:
        autograd._engine_run_backward = _ENGINE["original"]
        _ENGINE["original"] = None


# -- CUDA graphs ------------------------------------------------------------------

# **Rule: a CUDA graph captured inside ``apply`` is said to replay without
# routines.** Capture records the kernels the ops launch; a replay runs
# those kernels only, so the routines ran once, at capture, and no later
# replay reaches them (their counts, observed values and Python-side effects
# are the capture's). amanda cannot run Python inside a replay: it says so
# at the capture (``torch.cuda.graph``, ``make_graphed_callables``). Compiled
# graphs do not meet this: amanda's routine ops are marked unsafe for CUDA
# graphs, so ``mode="reduce-overhead"`` leaves them out of its graphs
# (`compiled.lowering`).
_CAPTURE = {"original": None}


def _capture_begin_said(graph, *args, **kwargs):
    st = getattr(_tls, "state", None)
    if st is not None and st.depth and not _CONTROLS.disabled:
        warnings.warn(
            "amanda: a CUDA graph is captured inside amanda.apply: its replays run the "
            "captured kernels only, so instrumentation routines ran at the capture and run at "
            "no replay. Capture outside apply (under amanda.disabled()) and run the model "
            "without CUDA graphs where it must be instrumented. See docs/pytorch-eager.md, "
            "Limits.", NotInstrumentedWarning, stacklevel=user_stacklevel(torch))
    return _CAPTURE["original"](graph, *args, **kwargs)


def _patch_graph_capture():
    graph_class = getattr(torch.cuda, "CUDAGraph", None)
    if graph_class is None or _CAPTURE["original"] is not None:
        return
    _CAPTURE["original"] = graph_class.capture_begin
    graph_class.capture_begin = _capture_begin_said


def _restore_graph_capture():
    if _CAPTURE["original"] is not None:
        torch.cuda.CUDAGraph.capture_begin = _CAPTURE["original"]
        _CAPTURE["original"] = None


# -- torch.compile ----------------------------------------------------------------

# While amanda is applied, compiled callables run instrumented compiled graphs
# (amanda.runtime.pytorch.compiled: Dynamo's callback is chosen per call and
# session), or, for what that path cannot do, their Python code eagerly, so
# every op is seen (Dynamo would otherwise trace the mode's handler or run
# graphs in which no op is an instrumentation point). With
# compiled.ENABLED false, Dynamo's stance is force_eager for every
# call, as before; that stance is process-wide: another thread's compiled
# code runs eagerly meanwhile too (the compiled path does the same).
_COMPILE = {"prior": None, "filter": None}

#: torch warns on every ``torch.compile(module)`` call while any global module
#: hook is registered that the hook fires once more for the wrapper; amanda's
#: own hooks are global and skip the wrapper (it is no part of module paths),
#: so the warning, which would name amanda's hooks, is filtered while amanda
#: is applied, and the filter is taken out again with the rest of its state.
_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"
_COMPILED_PATH = "compiled path"   # _COMPILE["prior"] while the compiled path is installed


def _compile_eagerly():
    if _COMPILE["prior"] is not None:
        return
    from torch._dynamo import eval_frame

    from amanda.runtime.pytorch import compiled as pytorch_compiled
    WRAPPER_MODULES.add(eval_frame.OptimizedModule)
    warnings.filterwarnings("ignore", message=_HOOK_WARNING, category=UserWarning)
    _COMPILE["filter"] = warnings.filters[0]
    if pytorch_compiled.ENABLED:
        pytorch_compiled.install()
        _COMPILE["prior"] = _COMPILED_PATH
    else:
        _COMPILE["prior"] = eval_frame._set_stance(eval_frame.DynamoStance("force_eager"))


def _restore_compile():
    prior = _COMPILE["prior"]
    entry, _COMPILE["filter"] = _COMPILE["filter"], None
    if entry is not None and entry in warnings.filters:
        warnings.filters.remove(entry)
        warnings._filters_mutated()
    if prior is _COMPILED_PATH:
        from amanda.runtime.pytorch import compiled as pytorch_compiled
        pytorch_compiled.uninstall()
        _COMPILE["prior"] = None
    elif prior is not None:
        from torch._dynamo import eval_frame
        eval_frame._set_stance(prior)
        _COMPILE["prior"] = None


DRIVER = TorchEagerDriver()


def evaluate(tensors):
    """NumPy copies of PyTorch tensors (``amanda.evaluate``)."""
    if isinstance(tensors, (list, tuple)):
        return [t.detach().cpu().numpy() for t in tensors]
    return tensors.detach().cpu().numpy()
