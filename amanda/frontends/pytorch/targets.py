"""The table of call targets a PyTorch graph may name, and its resolver.

Ops of captured PyTorch graphs name what they call (``attrs["target"]``). When
a graph comes from a file that name is untrusted, so it is resolved only
within this table, never by importing or walking arbitrary attributes:

* operator overloads ``"<ns>.<op>.<overload>"`` (``"aten.conv2d.default"``):
  looked up in ``torch.ops`` and accepted only if they are ``OpOverload``
  objects, i.e. registered dispatcher operators; ``"higher_order.<name>"`` for
  ``torch.ops.higher_order`` operators;
* ``torch.<f>``: the native operator functions (``torch._C._VariableFunctions``),
  the operator functions of ``torch.functional`` (``einsum``, ``split``, ...)
  and the ``sym_*`` shape functions; ``torch.nn.functional.<f>`` functions
  defined there; the native ``torch.linalg``, ``torch.fft``, ``torch.special``
  and ``torch._C._nn`` functions;
* ``torch.Tensor.<m>``: the native Tensor methods and arithmetic dunders, plus
  the few Python-defined Tensor methods that compute (``split``, ``norm``...);
* ``operator.<f>`` arithmetic, comparison and indexing functions and a few
  ``math`` functions (shape arithmetic in exported graphs).

Whatever is not listed is refused, also names that start with ``torch.``:
``torch.load``, ``torch.save``, ``torch.hub.*``, ``torch.compile``,
``torch.jit.*``, ``torch.from_file`` and the like read files, run code or
change global state. ``operator.attrgetter``/``methodcaller``/``call`` are
refused too: with data arguments they reach any attribute or method.

Importing this module registers the table for the ``"pytorch"`` namespace
(`amanda.ir.targets`); the IR loads it on demand when a PyTorch graph is read.
"""

from __future__ import annotations

import inspect
import math
import operator

import torch

from amanda.ir.targets import TargetResolver, register_target_resolver

__all__ = ["DENIED", "TABLE", "TorchTargets", "check_attr_path", "is_allowed"]

#: Names refused even where the rule of their family would admit them: file
#: I/O, printing, and the Tensor methods that call a Python function argument.
DENIED = frozenset({"from_file", "_print", "load", "save", "compile", "apply_", "map_", "map2_", "_parse_to",
                    "_cufft_set_plan_cache_max_size"})

_OPERATOR_NAMES = (
    "abs add and_ concat contains eq floordiv ge getitem gt iadd iand iconcat ifloordiv ilshift "
    "imatmul imod imul index inv invert ior ipow irshift is_ is_not isub itruediv ixor le lshift "
    "lt matmul mod mul ne neg not_ or_ pos pow rshift sub truediv truth xor").split()
_MATH_NAMES = "ceil floor trunc sqrt exp log log2 fabs".split()

# Tensor dunders that compute; the rest (__reduce_ex__, __setstate__, __init_subclass__,
# __torch_function__...) run machinery, not arithmetic.
_TENSOR_DUNDERS = frozenset(
    f"__{name}__" for name in
    ("getitem setitem len contains add radd iadd sub rsub isub mul rmul imul truediv rtruediv "
     "itruediv div rdiv idiv floordiv rfloordiv ifloordiv mod rmod imod pow rpow ipow matmul "
     "rmatmul neg pos abs invert and rand iand or ror ior xor rxor ixor lshift rlshift ilshift "
     "rshift rrshift irshift eq ne lt le gt ge bool float int index").split())
# Python-defined Tensor methods that only compute on tensors.
_TENSOR_PYTHON = frozenset("norm lu stft istft split unique unique_consecutive unflatten resize "
                           "resize_as detach detach_ solve lstsq eig symeig dim_order".split())

_NATIVE_MODULES = ("_nn", "_linalg", "_fft", "_special")


class _Table:
    """Container path -> {attribute name: allowed object}, built on first use."""

    def __init__(self):
        self._entries = None

    def entries(self):
        if self._entries is None:
            self._entries = self._build()
        return self._entries

    def _build(self):
        native = _native_functions(torch._C._VariableFunctions)
        for name in torch.functional.__all__:
            native[name] = getattr(torch.functional, name)
        for name in dir(torch):
            if name.startswith("sym_") and callable(getattr(torch, name)):
                native[name] = getattr(torch, name)
        natives = {name: _native_functions(getattr(torch._C, name)) for name in _NATIVE_MODULES}
        bound = [value for table in [native, *natives.values()] for value in table.values()]
        functional = {name: obj for name, obj in vars(torch.nn.functional).items()
                      if not name.startswith("_") and callable(obj) and not isinstance(obj, type)
                      and (getattr(obj, "__module__", None) == "torch.nn.functional"
                           or any(obj is value for value in bound))}
        entries = {
            "torch": native,
            "torch._VariableFunctionsClass": native,   # how older files named native functions
            "torch.functional": {n: native[n] for n in torch.functional.__all__},
            "torch.nn.functional": functional,
            "torch.Tensor": _tensor_methods(),
            "operator": {n: getattr(operator, n) for n in _OPERATOR_NAMES if hasattr(operator, n)},
            "math": {n: getattr(math, n) for n in _MATH_NAMES},
        }
        entries["torch._C.TensorBase"] = entries["torch.Tensor"]
        entries["_operator"] = entries["operator"]
        for name, table in natives.items():
            entries[f"torch._C.{name}"] = table
            public = {"_linalg": "linalg", "_fft": "fft", "_special": "special"}.get(name)
            if public is not None:
                module = getattr(torch, public)
                entries[f"torch.{public}"] = {n: obj for n, obj in vars(module).items()
                                              if any(obj is value for value in table.values())}
        return {path: {n: obj for n, obj in table.items() if n not in DENIED}
                for path, table in entries.items()}


TABLE = _Table()


def _native_functions(container):
    """The operator functions bound from C++ in ``container`` (a module or class)."""
    found = {}
    for name in dir(container):
        if name.startswith("__") or name.startswith("_test"):
            continue
        obj = getattr(container, name, None)
        if inspect.isbuiltin(obj):
            found[name] = obj
    return found


def _tensor_methods():
    found = {}
    for name, raw in vars(torch._C.TensorBase).items():
        if name.startswith("_") and name not in _TENSOR_DUNDERS:
            continue
        if type(raw).__name__ in ("method_descriptor", "wrapper_descriptor"):
            found[name] = getattr(torch.Tensor, name)
    for name, raw in vars(torch.Tensor).items():
        if name in _TENSOR_PYTHON or (name in _TENSOR_DUNDERS and inspect.isfunction(raw)):
            found[name] = getattr(torch.Tensor, name)
    return found


def is_allowed(obj):
    """Whether ``obj`` is a call target of the table (by identity)."""
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return True
    return any(value is obj for table in TABLE.entries().values() for value in table.values())


def _identifier(part, dunders=frozenset()):
    return part.isidentifier() and (not part.startswith("__") or part in dunders)


class TorchTargets(TargetResolver):
    """Resolves PyTorch call target names within the table (see the module docstring)."""

    def resolve(self, name):
        """Returns the operator named ``name``.

        Raises:
            LookupError: ``name`` is not an operator of the table.
        """
        if not isinstance(name, str) or len(name) > 300:
            raise LookupError("a target name is a short string")
        path, _, attr = name.rpartition(".")
        table = TABLE.entries().get(path)
        if table is not None:
            if attr in table:
                return table[attr]
            raise LookupError(f"{path} has no allowed operator {attr!r}")
        parts = name.split(".")
        if not all(_identifier(p) for p in parts):
            raise LookupError("each part of a target name is an identifier, none a dunder name")
        if len(parts) == 2 and parts[0] == "higher_order":
            return _higher_order(parts[1])
        if len(parts) == 3 and not parts[0].startswith(("torch", "operator", "_operator", "math")):
            return _overload(*parts)
        raise LookupError("only torch.ops overloads ('aten.add.Tensor'), torch / torch.nn.functional / "
                          "torch.Tensor operators and operator functions may be called")

    def check_graph(self, graph):
        """Checks the attribute paths and argument markers a lowered graph would resolve.

        Raises:
            LookupError: A parameter/buffer/attr input or a buffer mutation names
                a path that is not plain attribute names, or an op's arguments
                hold a marker outside the dtypes, layouts, memory formats and
                devices.
        """
        from amanda.frontends.pytorch.graph import decode_args

        for tensor in graph.inputs:
            if tensor.attrs.get("kind") in ("parameter", "buffer", "attr"):
                check_attr_path(tensor.attrs.get("target"), f"input {tensor.name!r}")
        for target in graph.attrs.get("output_targets") or ():
            check_attr_path(target, "an output target")
        for op in graph:
            if "target" in op.attrs and op.type != "amanda.routine":
                try:
                    decode_args(op.attrs.get("args", []), op.inputs)
                    decode_args(op.attrs.get("kwargs", {}), op.inputs)
                except Exception as error:  # noqa: BLE001 - any failure means bad data
                    raise LookupError(f"op {op.name!r} has arguments that do not decode: "
                                      f"{getattr(error, 'args', [error])[0]}") from None


def check_attr_path(path, where="an attribute path"):
    """Refuses a module attribute path that is not plain names (``"encoder.layer.0.weight"``).

    None (no path) is accepted.

    Raises:
        LookupError: A part is empty, not an identifier-like name, or a dunder
            name, through which ``getattr`` would reach globals and code.
    """
    if path is None:
        return
    if not isinstance(path, str) or not all(
            part and (part.isidentifier() or part.isdigit()) and not part.startswith("__")
            for part in path.split(".")):
        raise LookupError(f"{where} names {path!r}, which is not a path of module attribute names")


def _higher_order(name):
    try:
        obj = getattr(torch.ops.higher_order, name)
    except Exception:  # noqa: BLE001 - torch raises several kinds for unknown names
        obj = None
    if not isinstance(obj, torch._ops.HigherOrderOperator):
        raise LookupError(f"torch.ops.higher_order has no operator {name!r}")
    return obj


def _overload(namespace, op_name, overload):
    if op_name in DENIED:
        raise LookupError(f"{op_name!r} is refused (it reads files or prints)")
    try:
        space = getattr(torch.ops, namespace)
        packet = getattr(space, op_name) if isinstance(space, torch._ops._OpNamespace) else None
        obj = getattr(packet, overload) if isinstance(packet, torch._ops.OpOverloadPacket) else None
    except Exception:  # noqa: BLE001 - unknown operators raise AttributeError or RuntimeError
        obj = None
    if not isinstance(obj, torch._ops.OpOverload):
        raise LookupError(f"torch.ops has no operator overload {namespace}.{op_name}.{overload}")
    return obj


RESOLVER = TorchTargets()
register_target_resolver("pytorch", RESOLVER)
