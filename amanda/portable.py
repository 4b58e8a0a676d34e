"""Portable routines: instrumentation routines that lower natively everywhere.

A routine written with ordinary tensor arithmetic — masks, offsets, clipping,
comparisons, casts, quantize/dequantize, identity — means the same thing on
every backend, so amanda does not need to call back into Python to run it:

* PyTorch eager calls it with ``torch.Tensor`` values, as any routine;
* the TensorFlow runtime calls it once with the symbolic ``tf.Tensor`` values of
  the instrumented copy, so it becomes TF ops in the graph;
* the ONNX runtime traces it (:func:`trace`) into a small amanda IR graph and
  emits ONNX nodes and initializers;
* :func:`amanda.export` traces it into the exported ONNX model.

A routine is recognised as portable when it is marked with :func:`routine`::

    from amanda import portable

    @portable.routine
    def mask_weight(weight, mask):
        return weight * mask

An unmarked routine that is plain tensor arithmetic is recognised too
(:mod:`amanda.portable_infer`; :func:`explain` says which way a routine went,
``infer = False`` or :func:`hosted` keeps routines in Python).

Marking is a promise that the routine computes its results only from its
tensor arguments and keyword arguments, with Python operators on tensors and
the functions of this module (the *vocabulary*): it keeps no state and has no
side effects, because on graph backends it runs once, while the graph is built,
not at every execution. A routine that breaks the promise in a detectable way
(reads a value with ``.numpy()``, uses a tensor in an ``if``, calls a framework
function) makes :func:`trace` raise :class:`PortableError` naming it.

Vocabulary: the operators ``+ - * / ** -x abs(x) < <= > >= == != & | ~`` and
:func:`abs`, :func:`where`, :func:`clip`, :func:`minimum`, :func:`maximum`,
:func:`cast`, :func:`round`, :func:`floor`, :func:`ceil`, :func:`sqrt`,
:func:`exp`, :func:`log`, :func:`sign`, :func:`identity`, :func:`quantize`,
:func:`dequantize`, :func:`fake_quant`. Each dispatches on its arguments: a
``torch.Tensor`` gets torch ops, a TensorFlow tensor TF ops, a NumPy array
NumPy, a traced value records an IR op.
"""

from __future__ import annotations

import builtins
import sys

import numpy as np

from amanda.errors import AmandaError, describe
from amanda.portable_infer import Verdict, explain, inference  # noqa: F401
from amanda.runtime import backends

NAMESPACE = "amanda/portable"
_MARK = "__amanda_portable__"


class PortableError(AmandaError):
    """A routine marked portable did something outside the vocabulary."""


#: Whether unmarked routines are examined and lowered natively when they are
#: pure tensor arithmetic (:mod:`amanda.portable_infer`); see also `inference`.
infer = True


def routine(func):
    """Mark ``func`` as a portable routine and return it unchanged."""
    setattr(getattr(func, "__func__", func), _MARK, True)
    return func


def hosted(func):
    """Mark ``func`` as never portable (always a Python callback) and return it."""
    setattr(getattr(func, "__func__", func), _MARK, False)
    return func


def is_portable(func):
    """Whether ``func`` (a function, or a bound method of one) lowers natively:
    it is marked with `routine`, or unmarked and inferred to be pure tensor
    arithmetic while `infer` is on (:func:`explain` says why)."""
    mark = getattr(getattr(func, "__func__", func), _MARK, None)
    if mark is not None or not infer:
        return bool(mark)
    from amanda.portable_infer import verdict
    return verdict(func).portable


# ---------------------------------------------------------------------------
# dispatch

def _backend(*values):
    """'sym', 'torch', 'tensorflow' or 'numpy' for the given arguments."""
    found = "numpy"
    for value in values:
        if isinstance(value, Sym):
            return "sym"
        module = type(value).__module__
        if module.startswith("torch"):
            found = "torch"
        elif found == "numpy" and (module.startswith("tensorflow") or module.startswith("keras")):
            found = "tensorflow"
    return found


def _ops(kind):
    """The vocabulary module of the backend whose tensors ``kind`` names (a
    top-level module, as `_backend` gives it: the descriptor's
    ``portable_ops``), or None (NumPy, traced values)."""
    backend = _OPS_BACKENDS.get(kind)
    if backend is None:
        backend = next((b for b in backends.all_backends()
                        if kind in b.value_modules and b.portable_ops is not None), False)
        if kind != "numpy" and kind != "sym":
            _OPS_BACKENDS[kind] = backend
    return backend.part("portable_ops") if backend else None


_OPS_BACKENDS = {}   # kind -> its backend (False: none), found once


def _like(value, reference):
    """``value`` (a scalar or array) as a tensor of ``reference``'s backend and dtype."""
    ops = _ops(_backend(reference))
    if ops is not None:
        return ops.like(value, reference)
    return np.asarray(value, dtype=np.asarray(reference).dtype)


def _unary(name, numpy_func):
    def function(x):
        kind = _backend(x)
        if kind == "sym":
            return x._unary(name)
        ops = _ops(kind)
        if ops is not None:
            return ops.unary(name, x)
        return numpy_func(np.asarray(x))
    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"Element-wise ``{name}`` of a tensor of any backend."
    return function


abs = _unary("abs", np.abs)
floor = _unary("floor", np.floor)
ceil = _unary("ceil", np.ceil)
sqrt = _unary("sqrt", np.sqrt)
exp = _unary("exp", np.exp)
log = _unary("log", np.log)
sign = _unary("sign", np.sign)
round = _unary("round", np.round)   # half to even everywhere
round.__doc__ = "Element-wise rounding, halves to even (as torch, TF, NumPy and ONNX do)."


def identity(x):
    """``x`` unchanged: ``x`` itself in PyTorch and NumPy, an ``Identity`` op in
    TF and ONNX graphs (so an inserted no-op is visible in the graph)."""
    kind = _backend(x)
    if kind == "sym":
        return x._unary("identity")
    ops = _ops(kind)
    return x if ops is None else ops.identity(x)


def _pair(name, a, b):
    """Two operands as tensors of one backend, scalars taking the other's dtype."""
    kind = _backend(a, b)
    if kind in ("torch", "tensorflow"):
        tensor_a = _backend(a) == kind
        if not tensor_a:
            a = _like(a, b)
        elif _backend(b) != kind:
            b = _like(b, a)
    return kind, a, b


def _binary(name, numpy_func):
    def function(a, b):
        kind, a, b = _pair(name, a, b)
        if kind == "sym":
            return _sym_of(a, b)._binary(name, a, b)
        ops = _ops(kind)
        if ops is not None:
            return ops.binary(name, a, b)
        return numpy_func(a, b)
    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"Element-wise ``{name}`` of two tensors (broadcasting)."
    return function


minimum = _binary("minimum", np.minimum)
maximum = _binary("maximum", np.maximum)


def clip(x, lo, hi):
    """``x`` limited to ``[lo, hi]`` (scalars or broadcastable tensors)."""
    kind = _backend(x, lo, hi)
    if kind == "sym":
        return _sym_of(x, lo, hi)._nary("clip", (x, lo, hi))
    return minimum(maximum(x, lo), hi)


def where(condition, a, b):
    """Elements of ``a`` where ``condition`` holds, else of ``b``."""
    kind = _backend(condition, a, b)
    if kind == "sym":
        return _sym_of(condition, a, b)._nary("where", (condition, a, b))
    if kind in ("torch", "tensorflow"):
        reference = a if _backend(a) == kind else b
        if _backend(a) != kind:
            a = _like(a, reference)
        if _backend(b) != kind:
            b = _like(b, reference)
        if _backend(condition) != kind:
            condition = _like(condition, reference) != 0
        return _ops(kind).where(condition, a, b)
    return np.where(condition, a, b)


def cast(x, dtype):
    """``x`` converted to ``dtype`` (a name such as ``"float32"``, ``"int8"``, ``"bool"``)."""
    dtype = _dtype_name(dtype)
    kind = _backend(x)
    if kind == "sym":
        return x._cast(dtype)
    ops = _ops(kind)
    if ops is not None:
        return ops.cast(x, dtype)
    return np.asarray(x).astype(dtype)


_INTEGER_RANGES = {"int8": (-128, 127), "uint8": (0, 255), "int16": (-32768, 32767),
                   "uint16": (0, 65535), "int32": (-2 ** 31, 2 ** 31 - 1)}


def _per_channel(value, x, axis):
    """Reshape a 1-D per-channel ``value`` so it broadcasts along ``axis`` of ``x``."""
    if axis is None or np.ndim(_shape_probe(value)) == 0:
        return value
    rank = len(x.shape)
    axis = axis % rank
    shape = [1] * rank
    shape[axis] = -1
    ops = _ops(_backend(value))
    if ops is not None:
        return ops.reshape(value, shape)
    return np.asarray(value).reshape(shape)


def _shape_probe(value):
    """An array of ``value``'s rank (and shape, where known: unknown sizes
    are 1), for rank and size tests; scalars and arrays are themselves."""
    shape = getattr(value, "shape", None)
    if shape is None:
        return np.asarray(value)
    return np.empty(tuple(d if _known(d) else 1 for d in shape))


def quantize(x, scale, zero_point, dtype="int8", axis=None):
    """``saturate(round(x / scale) + zero_point)`` as integers of ``dtype``.

    ``axis`` makes ``scale``/``zero_point`` per channel (1-D along that axis),
    as ONNX ``QuantizeLinear`` does.
    """
    dtype = _dtype_name(dtype)
    if isinstance(x, Sym):
        return x._nary("quantize", (x, scale, zero_point), dtype=dtype, axis=axis,
                       out_dtype=dtype, cast_scalars=False)
    lo, hi = _INTEGER_RANGES[dtype]
    scale, zero_point = _per_channel(scale, x, axis), _per_channel(zero_point, x, axis)
    return cast(clip(round(x / scale) + zero_point, lo, hi), dtype)


def dequantize(q, scale, zero_point, axis=None, dtype="float32"):
    """``(q - zero_point) * scale`` as floats of ``dtype``."""
    dtype = _dtype_name(dtype)
    if isinstance(q, Sym):
        return q._nary("dequantize", (q, scale, zero_point), dtype=dtype, axis=axis,
                       out_dtype=dtype, cast_scalars=False)
    scale, zero_point = _per_channel(scale, q, axis), _per_channel(zero_point, q, axis)
    return (cast(q, dtype) - zero_point) * scale


def fake_quant(x, scale, zero_point, qmin, qmax, axis=None):
    """Quantize then dequantize in floating point:
    ``(clip(round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale``.

    ``axis`` makes ``scale``/``zero_point`` per channel. In an ONNX lowering
    with an 8-bit range this becomes a ``QuantizeLinear``/``DequantizeLinear``
    pair.
    """
    if isinstance(x, Sym):
        return x._nary("fake_quant", (x, scale, zero_point), qmin=int(qmin), qmax=int(qmax),
                       axis=axis)
    ops = _ops(_backend(x))
    if ops is not None:
        # a framework's fused op where it has one (torch while exporting)
        fused = ops.fake_quant(x, scale, zero_point, qmin, qmax, axis,
                               to_numpy=_numpy, shape_probe=_shape_probe)
        if fused is not None:
            return fused
    scale, zero_point = _per_channel(scale, x, axis), _per_channel(zero_point, x, axis)
    scale, zero_point = _like(scale, x), _like(zero_point, x)
    return (clip(round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale


# ---------------------------------------------------------------------------
# tracing

_FLOAT = {"float16", "bfloat16", "float32", "float64"}


def _dtype_name(dtype):
    """A dtype name (``"float32"``) from a string, NumPy, torch or TF dtype."""
    if isinstance(dtype, str):
        return dtype
    name = getattr(dtype, "name", None)
    if isinstance(name, str):
        return name
    text = str(dtype)
    return text.replace("torch.", "").replace("<dtype: '", "").replace("'>", "")


def _numpy(value):
    """A framework tensor or array-like as a NumPy array (for constants)."""
    if isinstance(value, np.ndarray):
        return value
    module = type(value).__module__
    if module.startswith("torch"):
        return value.detach().cpu().numpy()
    if hasattr(value, "numpy"):
        try:
            return value.numpy()
        except Exception as exc:   # a symbolic TF tensor has no value
            raise PortableError(f"a keyword argument of type {type(value).__name__} has no "
                                "value to bake into the routine") from exc
    return np.asarray(value)


class Sym:
    """A traced tensor: Python operators and the vocabulary record IR ops."""

    __array_ufunc__ = None   # NumPy arrays defer to our reflected operators
    __slots__ = ("_tracer", "tensor")

    def __init__(self, tracer, tensor):
        self._tracer = tracer
        self.tensor = tensor

    @property
    def dtype(self):
        return self.tensor.attrs.get("dtype")

    @property
    def shape(self):
        shape = self.tensor.attrs.get("shape")
        if shape is None:
            raise PortableError("the shape of this traced tensor is not known")
        return tuple(shape)

    # --- recording helpers
    def _operand(self, value, like_dtype=True):
        if isinstance(value, Sym):
            return value.tensor
        return self._tracer.constant(value, self.dtype if like_dtype else None)

    def _unary(self, op_type):
        dtype = "bool" if op_type == "not" else self.dtype
        return self._tracer.op(op_type, [self.tensor], dtype, self.tensor.attrs.get("shape"))

    def _cast(self, dtype):
        return self._tracer.op("cast", [self.tensor], dtype, self.tensor.attrs.get("shape"),
                               dtype=dtype)

    def _binary(self, op_type, a, b, out_dtype=None):
        reference = a if isinstance(a, Sym) else b
        tensors = [reference._operand(v) for v in (a, b)]
        if out_dtype is None:
            out_dtype = _promote([t.attrs.get("dtype") for t in tensors])
        shape = _broadcast([t.attrs.get("shape") for t in tensors])
        return self._tracer.op(op_type, tensors, out_dtype, shape)

    def _nary(self, op_type, values, out_dtype=None, cast_scalars=True, **attrs):
        reference = next(v for v in values if isinstance(v, Sym))
        if op_type == "where":
            reference = next((v for v in values[1:] if isinstance(v, Sym)), reference)
        tensors = []
        for i, value in enumerate(values):
            if isinstance(value, Sym):
                tensors.append(value.tensor)
            elif op_type == "where" and i == 0:
                tensors.append(self._tracer.constant(np.asarray(value, dtype=bool), None))
            elif cast_scalars:
                tensors.append(reference._operand(value))
            else:
                tensors.append(self._tracer.constant(value, None))
        if out_dtype is None:
            out_dtype = reference.dtype
        if op_type in ("quantize", "dequantize", "fake_quant"):
            shape = values[0].tensor.attrs.get("shape")   # scale may be per channel
        else:
            shape = _broadcast([t.attrs.get("shape") for t in tensors])
        return self._tracer.op(op_type, tensors, out_dtype, shape, **attrs)

    # --- operators
    def __add__(self, other): return self._binary("add", self, other)
    def __radd__(self, other): return self._binary("add", other, self)
    def __sub__(self, other): return self._binary("sub", self, other)
    def __rsub__(self, other): return self._binary("sub", other, self)
    def __mul__(self, other): return self._binary("mul", self, other)
    def __rmul__(self, other): return self._binary("mul", other, self)
    def __truediv__(self, other): return self._binary("div", self, other)
    def __rtruediv__(self, other): return self._binary("div", other, self)
    def __pow__(self, other): return self._binary("pow", self, other)
    def __rpow__(self, other): return self._binary("pow", other, self)
    def __neg__(self): return self._unary("neg")
    def __pos__(self): return self
    def __abs__(self): return self._unary("abs")
    def __invert__(self): return self._unary("not")
    def __lt__(self, other): return self._binary("lt", self, other, "bool")
    def __le__(self, other): return self._binary("le", self, other, "bool")
    def __gt__(self, other): return self._binary("gt", self, other, "bool")
    def __ge__(self, other): return self._binary("ge", self, other, "bool")
    def __eq__(self, other): return self._binary("eq", self, other, "bool")  # noqa: D105
    def __ne__(self, other): return self._binary("ne", self, other, "bool")
    def __and__(self, other): return self._binary("and", self, other, "bool")
    def __rand__(self, other): return self._binary("and", other, self, "bool")
    def __or__(self, other): return self._binary("or", self, other, "bool")
    def __ror__(self, other): return self._binary("or", other, self, "bool")
    __hash__ = object.__hash__

    def __bool__(self):
        raise PortableError("a traced tensor's value was used in Python control flow "
                            "(if/while/and/or); use portable.where instead")

    def __array__(self, *args, **kwargs):
        raise PortableError("a traced tensor was converted to an array")

    def __float__(self):
        raise PortableError("a traced tensor was converted to a Python number")

    __int__ = __index__ = __float__

    def __getattr__(self, name):
        raise PortableError(f"traced tensors have no attribute {name!r} (portable routines "
                            "use operators and amanda.portable functions only)")

    def __repr__(self):
        return f"Sym({self.tensor.name}: {self.dtype}{self.tensor.attrs.get('shape')})"


def _sym_of(*values):
    return next(v for v in values if isinstance(v, Sym))


def _promote(dtypes):
    known = [d for d in dtypes if d is not None]
    if not known:
        return None
    if len(set(known)) == 1:
        return known[0]
    try:
        return np.result_type(*[np.dtype(d) for d in known]).name
    except TypeError:
        return known[0]


def _known(dim):
    return isinstance(dim, (int, np.integer)) and dim >= 0


def _broadcast(shapes):
    """The broadcast shape of traced tensors; a dimension the backend does
    not know (None: ONNX ``dim_param``, TF's unknown sizes) stays None unless
    a known size other than 1 decides it (broadcasting makes it that size
    or fails at run time, as the hosted routine would)."""
    if any(s is None for s in shapes):
        return None
    rank = max((len(s) for s in shapes), default=0)
    result = []
    for i in range(1, rank + 1):
        dims = [s[-i] for s in shapes if len(s) >= i]
        sizes = {int(d) for d in dims if _known(d) and d != 1}
        if len(sizes) > 1:
            raise PortableError(f"shapes {shapes} do not broadcast")
        if sizes:
            result.append(sizes.pop())
        elif all(_known(d) for d in dims):
            result.append(1)
        else:
            result.append(None)
    return result[::-1]


class _Tracer:
    def __init__(self, graph):
        self.graph = graph

    def op(self, op_type, inputs, out_dtype, shape, **attrs):
        op = self.graph.create_op(op_type, inputs, attrs=attrs, namespace=NAMESPACE)
        op.outputs[0].attrs.update(dtype=out_dtype, shape=None if shape is None else list(shape))
        return Sym(self, op.outputs[0])

    def constant(self, value, like_dtype):
        array = _numpy(value)
        if like_dtype is not None and (like_dtype in _FLOAT or array.dtype.kind in "iub"
                                       and np.dtype(like_dtype).kind in "iu"):
            array = array.astype(like_dtype)
        elif array.dtype == np.float64 and np.ndim(array) == 0 and like_dtype is None:
            array = array.astype(np.float32)
        elif array.dtype == np.int64 and np.ndim(array) == 0 and like_dtype is None:
            array = array.astype(np.int32)
        array = np.array(array, copy=True)
        op = self.graph.create_op("constant", [], attrs={"value": array}, namespace=NAMESPACE)
        op.outputs[0].attrs.update(dtype=array.dtype.name, shape=list(array.shape))
        return op.outputs[0]


def trace(func, inputs, kwargs=None, name=None):
    """Trace a portable routine into an amanda IR graph.

    Args:
        func: the routine.
        inputs: one ``(dtype, shape)`` per tensor the routine receives
            (``shape`` may be None).
        kwargs: the keyword arguments it is called with; arrays of any
            framework become ``constant`` ops.
        name: the graph's name (default: the routine's).

    Returns:
        An :class:`amanda.ir.Graph` in namespace ``"amanda/portable"`` whose
        inputs are the routine's tensors and whose outputs are its results (none
        when it returned None).

    Raises:
        PortableError: the routine left the vocabulary or returned something
            that is not a tensor.
    """
    from amanda.ir import Graph
    label = name or describe(func)
    graph = Graph(name=label, namespace=NAMESPACE)
    tracer = _Tracer(graph)
    args = [Sym(tracer, graph.add_input(f"in{i}", dtype=_dtype_name(dtype) if dtype else None,
                                        shape=None if shape is None else list(shape)))
            for i, (dtype, shape) in enumerate(inputs)]
    try:
        result = func(*args, **(kwargs or {}))
    except PortableError as exc:
        raise PortableError(f"portable routine {label} cannot be traced: {exc}") from exc
    except Exception as exc:
        raise PortableError(f"portable routine {label} cannot be traced: it raised "
                            f"{type(exc).__name__}: {exc} (only operators and "
                            "amanda.portable functions are allowed)") from exc
    if result is None:
        results = []
    elif isinstance(result, (list, tuple)):
        results = list(result)
    else:
        results = [result]
    outputs = []
    for i, value in enumerate(results):
        if value is None:
            value = args[i] if i < len(args) else None
            if value is None:
                raise PortableError(f"portable routine {label} returned None at position {i}")
        if not isinstance(value, Sym):
            raise PortableError(f"portable routine {label} returned {type(value).__name__}; "
                                "expected traced tensors")
        outputs.append(value.tensor)
    graph.set_outputs(outputs)
    return graph


def evaluate(graph, values):
    """Run a traced routine graph with NumPy ``values`` (a reference
    interpreter, used by tests and by backends that want a fallback)."""
    env = {id(t): np.asarray(v) for t, v in zip(graph.inputs, values)}
    for op in graph.ops:
        args = [env[id(t)] for t in op.inputs]
        env[id(op.outputs[0])] = _NUMPY_OPS[op.type](args, op.attrs)
    return [env[id(t)] for t in graph.outputs]


def _np_fake_quant(args, attrs):
    x, scale, zero = args
    scale = _per_channel(scale, x, attrs.get("axis"))
    zero = _per_channel(zero, x, attrs.get("axis"))
    q = np.clip(np.round(x / scale) + zero, attrs["qmin"], attrs["qmax"])
    return ((q - zero) * scale).astype(x.dtype)


_NUMPY_OPS = {
    "constant": lambda a, at: at["value"],
    "add": lambda a, at: a[0] + a[1], "sub": lambda a, at: a[0] - a[1],
    "mul": lambda a, at: a[0] * a[1], "div": lambda a, at: a[0] / a[1],
    "pow": lambda a, at: a[0] ** a[1], "neg": lambda a, at: -a[0],
    "abs": lambda a, at: np.abs(a[0]), "not": lambda a, at: ~a[0],
    "lt": lambda a, at: a[0] < a[1], "le": lambda a, at: a[0] <= a[1],
    "gt": lambda a, at: a[0] > a[1], "ge": lambda a, at: a[0] >= a[1],
    "eq": lambda a, at: a[0] == a[1], "ne": lambda a, at: a[0] != a[1],
    "and": lambda a, at: a[0] & a[1], "or": lambda a, at: a[0] | a[1],
    "where": lambda a, at: np.where(*a), "clip": lambda a, at: np.minimum(np.maximum(a[0], a[1]), a[2]),
    "minimum": lambda a, at: np.minimum(*a), "maximum": lambda a, at: np.maximum(*a),
    "cast": lambda a, at: a[0].astype(at["dtype"]),
    "round": lambda a, at: np.round(a[0]), "floor": lambda a, at: np.floor(a[0]),
    "ceil": lambda a, at: np.ceil(a[0]), "sqrt": lambda a, at: np.sqrt(a[0]),
    "exp": lambda a, at: np.exp(a[0]), "log": lambda a, at: np.log(a[0]),
    "sign": lambda a, at: np.sign(a[0]), "identity": lambda a, at: a[0],
    "quantize": lambda a, at: quantize(*a, dtype=at["dtype"], axis=at.get("axis")),
    "dequantize": lambda a, at: dequantize(*a, axis=at.get("axis"), dtype=at["dtype"]),
    "fake_quant": _np_fake_quant,
}

VOCABULARY = tuple(sorted(set(_NUMPY_OPS) - {"constant"}))

# keep the builtins we shadow reachable for callers that star-import
_builtin_abs, _builtin_round = builtins.abs, builtins.round
del sys
