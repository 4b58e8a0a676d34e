"""Where an op of a compiled graph is called from, as eager PyTorch would say.

Eager amanda identifies an op by the frame that calls it (`eager.sites._calling_site`:
the first frame outside torch's internals and amanda's runtime, never above
the module call that runs it), the instruction in that frame, the innermost
module and the op's callable. Dynamo's FX graphs carry only part of this:
``meta["stack_trace"]`` leaves out every frame inside ``torch/nn/modules`` (so
the ``conv2d`` that ``nn.Conv2d._conv_forward`` calls has no frame of its own)
and names functions, not their qualified names. So while Dynamo traces a
frame for amanda (`tracing`), each node it creates is given the site eager
would pick, read from Dynamo's stack of instruction translators (one per
Python frame it inlines): ``node.meta["amanda_site"] = (code, line,
offset)``, or `MACHINERY` for a call torch's checkpointing machinery makes.

And the callable an eager run sees for a Python operator (``h += 1`` reaches
amanda's ``TorchFunctionMode`` as ``Tensor.add_``, ``1 + x`` as
``Tensor.__radd__``), found by running the operator on meta tensors under a
mode that records what it receives (`eager_callable`).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from amanda.runtime.pytorch.eager.sites import _BOUNDARY, _MACHINERY, _SITE, _code_kind

#: ``node.meta["amanda_site"]`` of a call made by torch's checkpointing machinery
MACHINERY = "machinery"
META_KEY = "amanda_site"

_local = threading.local()
_PATCH = {"original": None}


def install():
    """Wrap Dynamo's ``SubgraphTracer.create_proxy`` (a no-op outside `tracing`)."""
    if _PATCH["original"] is not None:
        return
    from torch._dynamo.output_graph import SubgraphTracer
    original = SubgraphTracer.create_proxy

    def create_proxy(self, kind, *args, **kwargs):
        proxy = original(self, kind, *args, **kwargs)
        if getattr(_local, "tracing", 0) and kind in ("call_function", "call_method"):
            try:
                proxy.node.meta[META_KEY] = _site(self.output_graph.current_tx)
            except Exception:    # a Dynamo layout not known here: no site, ids as before
                pass
        return proxy

    _PATCH["original"] = original
    SubgraphTracer.create_proxy = create_proxy
    _install_dead_index_guard()


def uninstall():
    original = _PATCH["original"]
    if original is not None:
        from torch._dynamo.output_graph import SubgraphTracer
        SubgraphTracer.create_proxy = original
        _PATCH["original"] = None
    _uninstall_dead_index_guard()


# -- unused indexing kept in the graph -----------------------------------------------------

def _keep_alive(node):
    """The target of a temporary node that keeps ``node`` used (never run)."""


def _install_dead_index_guard():
    """Keep a tensor indexing whose result nothing uses (``x[:, None]``) in
    the graphs Dynamo makes for amanda: eager runs it, a point like any op,
    while Dynamo's ``OutputGraph.remove_unused_graphargs`` erases every
    unused ``operator.getitem`` node before the backend sees the graph.
    transformers' mask builders index ``batch_arange``/``head_arange`` and
    drop the result (``_non_vmap_expansion_sdpa``), so LLaMA, Mistral,
    Qwen2, Gemma2, GPT-2, BART, Bloom, DETR and DeBERTa-v2 lacked eager's
    ``__getitem__`` points. Only while tracing for amanda (`tracing`): each
    such node gets a temporary user for the duration of the call, removed
    after; the compiler (AOTAutograd) drops the dead code later."""
    from torch._dynamo.output_graph import OutputGraph
    if "remove_unused" in _PATCH:
        return
    original = OutputGraph.remove_unused_graphargs

    def remove_unused_graphargs(self):
        if not getattr(_local, "tracing", 0):
            return original(self)
        anchors = []
        for node in list(self.graph.nodes):
            if _unused_tensor_index(node):
                with self.graph.inserting_after(node):
                    anchors.append(self.graph.call_function(_keep_alive, (node,)))
        try:
            return original(self)
        finally:
            for anchor in anchors:
                self.graph.erase_node(anchor)

    _PATCH["remove_unused"] = original
    OutputGraph.remove_unused_graphargs = remove_unused_graphargs


def _uninstall_dead_index_guard():
    original = _PATCH.pop("remove_unused", None)
    if original is not None:
        from torch._dynamo.output_graph import OutputGraph
        OutputGraph.remove_unused_graphargs = original


def _unused_tensor_index(node):
    import operator
    if node.op != "call_function" or node.target is not operator.getitem or node.users:
        return False
    source = node.args[0] if node.args else None
    return (isinstance(node.meta.get("example_value"), torch.Tensor)
            and isinstance(source, torch.fx.Node)
            and isinstance(source.meta.get("example_value"), torch.Tensor))


@contextlib.contextmanager
def tracing():
    """Nodes Dynamo creates in this thread inside the block get their eager site."""
    _local.tracing = getattr(_local, "tracing", 0) + 1
    try:
        yield
    finally:
        _local.tracing -= 1


def _module_entry(tx):
    """Whether ``tx`` runs a module's ``forward`` that Dynamo inlined for a
    module call (eager's walk stops below ``Module.__call__``)."""
    if tx.f_code.co_name != "forward":
        return False
    from torch._dynamo.variables.nn_module import NNModuleVariable, UnspecializedNNModuleVariable
    owner = getattr(tx, "symbolic_locals", {}).get("self")
    return isinstance(owner, (NNModuleVariable, UnspecializedNNModuleVariable))


def _where(tx):
    instruction = tx.current_instruction
    positions = getattr(instruction, "positions", None)
    line = positions.lineno if positions is not None and positions.lineno is not None else tx.lineno
    return tx.f_code, line, instruction.offset


def _site(tx):
    """eager's `_calling_site`, over Dynamo's translators instead of frames:
    (code, line, instruction offset) of the frame that identifies the op."""
    kind = _code_kind(tx.f_code)
    while kind is not _SITE and kind is not _BOUNDARY:
        if kind is _MACHINERY:
            return MACHINERY
        back = getattr(tx, "parent", None)
        if _module_entry(tx):
            return _hooked_call_site()
        if back is None:
            break
        tx, kind = back, _code_kind(back.f_code)
    return _where(tx)


_HOOKED_CALL = []


def _hooked_call_site():
    """The site eager gives an op whose frames, up to the module call, are all
    torch internals (the ``forward`` of a module defined outside
    ``torch/nn/modules``: weight norm's ``_WeightNorm``, a parametrization):
    with amanda's global module hooks in place, ``Module._call_impl`` calls
    ``forward`` from its nested ``inner``, the first frame eager's walk
    reaches below the module call. Wav2Vec2's ``_weight_norm`` had
    ``_WeightNorm.forward`` as its site, another id than eager's."""
    if not _HOOKED_CALL:
        import dis
        import types
        inner = next(c for c in torch.nn.Module._call_impl.__code__.co_consts
                     if isinstance(c, types.CodeType) and c.co_name == "inner")
        loaded = False
        for instruction in dis.get_instructions(inner):
            if instruction.argval == "forward_call" and instruction.opname.startswith("LOAD"):
                loaded = True
            elif loaded and instruction.opname.startswith("CALL"):
                _HOOKED_CALL.append((inner, instruction.positions.lineno, instruction.offset))
                break
    return _HOOKED_CALL[0]


# -- the callable eager sees for a Python operator -------------------------------------------

class _Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.seen is None:
            self.seen = func
        return func(*args, **(kwargs or {}))


_CALLABLES = {}
_SYMBOLIC = {torch.SymInt: 1, torch.SymFloat: 1.0, torch.SymBool: True}


def eager_callable(target, args, value_of):
    """The torch callable amanda's eager mode receives when Python runs the
    operator ``target`` (``operator.iadd``...) on ``args``: the operator is
    run on meta tensors of the same shapes and dtypes under a recording mode.
    None when it cannot be run so (the caller keeps its static mapping)."""
    probe, key = [], [target]
    for arg in args:
        value = value_of(arg) if isinstance(arg, torch.fx.Node) else arg
        if isinstance(value, torch.Tensor):
            # size-1 dims broadcast with anything; the callable does not depend on sizes
            probe.append(torch.empty((1,) * value.dim(), dtype=value.dtype, device="meta"))
            key.append((value.dtype, value.dim()))
        elif isinstance(value, (bool, int, float, complex)):
            probe.append(value)
            key.append(type(value))
        elif type(value) in _SYMBOLIC:      # a size under dynamic shapes: a Python number
            probe.append(_SYMBOLIC[type(value)])
            key.append(type(value))
        else:
            return None
    key = tuple(key)
    if key not in _CALLABLES:
        recorder = _Recorder()
        try:
            with recorder:
                target(*probe)
        except Exception:
            pass     # an error after the mode saw the call (sizes): the callable is known
        _CALLABLES[key] = recorder.seen
    return _CALLABLES[key]
