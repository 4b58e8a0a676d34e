"""``amanda.export`` for PyTorch: an instrumented model as a runnable ONNX model.

The model runs inside ``amanda.apply(*tools)`` while torch's TorchScript
tracing exporter (``torch.onnx.export(..., dynamo=False)``) records it, so the
tools' instrumentation routines are traced into the graph like model code:

1. One eager *analysis run* (eval mode, no autograd) lets the tools' analysis
   routines see real tensors and record their actions; whatever they compute
   (masks, scales) reaches the routines as constants.
2. The tracing run replays those actions; each routine is called with the
   traced tensors, so ``w * mask`` becomes an ONNX ``Mul`` (folded into the
   weight initializer by the exporter) and ``portable.fake_quant`` a
   ``QuantizeLinear``/``DequantizeLinear`` pair.

Only portable routines (:mod:`amanda.portable`) can be exported: a routine
with Python side effects or value reads would run once during tracing and leave
a constant behind. Both runs refuse any other routine before calling it.

Why the TorchScript exporter and not the ``torch.export``-based one
(``dynamo=True``): tracing runs the model on real tensors, so an analysis
routine that meets an op for the first time while tracing still reads real
values, exactly as in eager mode; ``torch.export`` runs the model on fake
tensors, where an analysis routine calling ``.item()``, NumPy or
``amanda.evaluate`` fails. See docs/export.md for the trade-offs and limits.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import warnings

import onnx
import torch

from amanda import controls
from amanda.errors import AmandaError, BackendError, describe
from amanda.runtime.pytorch.eager import mode as _mode
from amanda.runtime.pytorch.eager import routines as _routines
from amanda.runtime.pytorch.eager.mode import recording_instrumented_trace
from amanda.runtime.routines import routine_error
from amanda.tool import Tool, apply, resolve_tools

DEFAULT_OPSET = 17   # QuantizeLinear per channel needs 13; ORT 1.31 runs 17 everywhere
DEFAULT_IR_VERSION = 10   # onnxruntime 1.31 reads IR versions up to 10 reliably


class _Call(torch.nn.Module):
    """What is traced: the user's model called with its example arguments.

    Its forward takes the tensors of ``args``/``kwargs`` positionally (so the
    exporter sees a plain ``*tensors`` signature and fills in no defaults),
    puts the non-tensor arguments back, runs the model with amanda enabled and
    returns the output tensors flattened. Everything else the exporter does
    runs with amanda disabled.
    """

    def __init__(self, model, args, kwargs):
        super().__init__()
        self.model = model
        self.args = args
        self.kwargs = kwargs
        self.slots = [("arg", i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.slots += [("kwarg", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        self.output_names = None
        self.training = False   # the exporter then leaves train/eval flags alone

    def tensors(self):
        return tuple(self.args[key] if side == "arg" else self.kwargs[key]
                     for side, key in self.slots)

    def forward(self, *tensors):
        args, kwargs = list(self.args), dict(self.kwargs)
        for (side, key), tensor in zip(self.slots, tensors):
            if side == "arg":
                args[key] = tensor
            else:
                kwargs[key] = tensor
        with controls.enabled(), recording_instrumented_trace():
            result = self.model(*args, **kwargs)
        named = []
        _flatten_named(result, "", named)
        if not named:
            raise AmandaError(f"amanda.export: {type(self.model).__name__} returned no tensor")
        self.output_names = [name for name, _ in named]
        return tuple(tensor for _, tensor in named)


# Module paths and op ids are named from below these wrappers, so a tool sees
# the same paths and ids in an export as in an eager run.
_mode.WRAPPER_MODULES.add(_Call)
_traced_wrapper = getattr(getattr(torch.jit, "_trace", None), "ONNXTracedModule", None)
if _traced_wrapper is not None:
    _mode.WRAPPER_MODULES.add(_traced_wrapper)


def export_torch(model, args, tools, *, f=None, kwargs=None, opset=None, input_names=None,
                 output_names=None, dynamic_axes=None, ir_version=DEFAULT_IR_VERSION):
    """``amanda.export`` for a ``torch.nn.Module`` (see :func:`amanda.export.export`)."""
    if not isinstance(model, torch.nn.Module):
        raise AmandaError(f"amanda.export needs a torch.nn.Module, got {type(model).__name__}")
    resolve_tools(tools)
    args = _as_tuple(args)
    kwargs = dict(kwargs or {})
    _check_arguments(args, kwargs)
    call = _Call(model, args, kwargs)
    tensors = call.tensors()
    with _model_unchanged(model), torch.no_grad(), _refusing_unportable(), \
            apply(_ExportOf(tools)), controls.disabled():
        call(*tensors)   # the analysis run: actions recorded on real tensors
        proto = _trace_to_onnx(
            call, tensors, opset or DEFAULT_OPSET,
            input_names or _input_names(model, args, kwargs, call.slots),
            output_names or call.output_names, dynamic_axes)
    return _finish(proto, tools, ir_version, f)


class _ExportOf(Tool):
    """The exported tools, as one new tool: applying it opens a new session,
    so the export analyses the model afresh instead of replaying actions
    cached by earlier ``apply`` scopes (e.g. a quantization tool's observers,
    recorded before it was frozen). The tools keep their own state."""

    def __init__(self, tools):
        super().__init__()
        self.depends_on(*tools)


def _trace_to_onnx(call, tensors, opset, input_names, output_names, dynamic_axes):
    buffer = io.BytesIO()
    try:
        with warnings.catch_warnings():
            # torch deprecates this exporter (see the module docstring for why
            # it is used); its notes are not the user's to act on
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(call, tensors, buffer, dynamo=False, opset_version=opset,
                              input_names=list(input_names), output_names=list(output_names),
                              dynamic_axes=dynamic_axes, do_constant_folding=True,
                              training=torch.onnx.TrainingMode.EVAL)
    except Exception as exc:
        amanda_error = _amanda_error_in(exc)
        if amanda_error is not None:
            raise amanda_error from exc
        raise BackendError(f"amanda.export: torch.onnx.export could not export "
                           f"{type(call.model).__name__}: {type(exc).__name__}: {exc}") from exc
    return onnx.load_from_string(buffer.getvalue())


def _finish(proto, tools, ir_version, f):
    _strip_prefix(proto.graph, "model.")
    proto.ir_version = min(proto.ir_version, ir_version)
    names = ", ".join(describe(t) for t in resolve_tools(tools)) or "none"
    proto.metadata_props.add(key="amanda.tools", value=names)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except onnx.checker.ValidationError as exc:
        raise BackendError(f"amanda.export: the exported model fails onnx.checker: {exc}") from exc
    if f is not None:
        if isinstance(f, (str, os.PathLike)):
            onnx.save_model(proto, f)
        else:
            f.write(proto.SerializeToString())
    return proto


# -- refusing what an exported graph cannot hold --------------------------------

@contextlib.contextmanager
def _refusing_unportable():
    """Install the driver's export guard for this thread."""
    checked = {}
    saved = _routines.EXPORTING.guard
    _routines.EXPORTING.guard = lambda action, selected, where: _guard(action, selected, where,
                                                                     checked)
    try:
        yield
    finally:
        _routines.EXPORTING.guard = saved


@contextlib.contextmanager
def _guard(action, selected, where, checked):
    """Refuse a routine an exported graph cannot hold, before it runs.

    A routine must be marked portable and stay inside the portable vocabulary,
    checked once per action by tracing it symbolically as the graph backends
    do; so it reads no value of the tensors it receives. The values it may
    still read are its keyword arguments', fixed when the action was
    recorded, so torch's warnings that such values become constants of the
    trace are expected and silenced.
    """
    if id(action) not in checked:
        _check_portable(action, selected, where)
        checked[id(action)] = action   # keeps the id valid for the export
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        yield


def _check_portable(action, selected, where):
    from amanda import portable
    what = f"{action.kind} routine"
    if not portable.is_portable(action.func):
        raise routine_error(action, where, "is not portable, so amanda.export cannot put "
                            "it in the ONNX graph (it would run once while tracing and leave "
                            "constants behind): write it with tensor operations and "
                            "amanda.portable functions and mark it @amanda.portable.routine",
                            what=what)
    specs = [(str(t.dtype).replace("torch.", ""), list(t.shape)) for t in selected]
    try:
        portable.trace(action.func, specs, action.kwargs)
    except portable.PortableError as exc:
        raise routine_error(action, where, f"cannot be exported: {exc}", what=what) from exc


# -- arguments, names and outputs ----------------------------------------------

def _as_tuple(args):
    if isinstance(args, torch.Tensor):
        return (args,)
    if isinstance(args, list):
        return tuple(args)
    if not isinstance(args, tuple):
        raise AmandaError(f"amanda.export: args must be a tensor or a tuple of arguments, "
                          f"got {type(args).__name__}")
    return args


def _check_arguments(args, kwargs):
    for where, value in [(f"args[{i}]", a) for i, a in enumerate(args)] + \
            [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]:
        if isinstance(value, (list, tuple, dict)) and _holds_tensor(value):
            raise AmandaError(f"amanda.export: {where} is a container of tensors; pass the "
                              "tensors as separate arguments")


def _holds_tensor(value):
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, (list, tuple)) and any(_holds_tensor(v) for v in value)


def _input_names(model, args, kwargs, slots):
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = []
    for side, key in slots:
        if side == "kwarg":
            names.append(key)
        elif key < len(positional):
            names.append(positional[key])
        else:
            names.append(f"input_{key}")
    return names


def _flatten_named(value, name, out):
    """Append (name, tensor) for every tensor of ``value``, depth first."""
    if isinstance(value, torch.Tensor):
        out.append((name or "output", value))
    elif isinstance(value, dict):   # includes transformers' ModelOutput
        for key, item in value.items():
            _flatten_named(item, f"{name}.{key}" if name else str(key), out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _flatten_named(item, f"{name}.{i}" if name else f"output_{i}", out)


def _strip_prefix(graph, prefix):
    """Name initializers as the user's model names its parameters
    (``encoder.layer.0...``), not as the export wrapper does (``model.encoder...``)."""
    taken = {i.name for i in graph.initializer} | {i.name for i in graph.input}
    renames = {}
    for init in graph.initializer:
        if init.name.startswith(prefix):
            new = init.name[len(prefix):]
            if new and new not in taken:
                renames[init.name] = new
                taken.add(new)
    if not renames:
        return
    for init in graph.initializer:
        init.name = renames.get(init.name, init.name)
    for value in list(graph.input) + list(graph.value_info):
        value.name = renames.get(value.name, value.name)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]


def _amanda_error_in(exc):
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, AmandaError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def _model_unchanged(model):
    """Export in eval mode and restore every module's train/eval flag."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training
