"""The op vocabulary: (backend, backend op type) -> canonical op type, and
what a canonical op looks like in each backend.

Built-in tools are written against canonical op types (``"conv2d"``,
``"linear"``, ``"depthwise_conv2d"``...). Each backend states its own op
facts in its *vocabulary module*, named by the ``vocabulary`` part of its
descriptor (:mod:`amanda.runtime.backends`) and loaded on first use; this
module is the framework-free lookup over them, reached by a context's
namespace or a backend name. It imports no framework, and neither do the
vocabulary modules.

A vocabulary module exposes:

* ``SPECS``: ``{canonical type: (ops, inputs, layouts, attrs)}``, how the
  backend spells each canonical op it has (see :class:`OpSpec`); where two
  rows name one op, the first row is the op's plain reading.
* ``TYPES``: ``{backend op type: canonical type}``, the types the mapping
  rule reports; any other op is named by its own type in snake case.
* ``op_type(context, op)`` -> the canonical type of a context's op (names
  ``SPECS`` leaves ambiguous are decided by the op's inputs: a ``MatMul``
  reading a weight is ``"linear"``).
* ``weight_layout(op, op_type, layout)`` -> the layout of the op's weight,
  ``layout`` (the row's) unless an attribute transposes it.
* ``weight_grad(op_type, forward_op, backward_op)`` -> the position of the
  weight's gradient among the backward op's outputs, or None.
* ``formula_type(op_type)`` -> the name of ``op_type`` in the FLOPs
  formula table (:mod:`amanda.tools.flops_formulas`).
* ``kernel_elements(op_type, weight_shape)`` -> the weight elements one
  output element of a convolution reads (FLOPs).
* ``contracted(op_type, input_shapes, op)`` -> the contracted dimension of
  a matrix product (FLOPs).
* ``WEIGHT_CHANNELS``: whether the pruning and quantization tools slice
  the backend's weights by channel (the axes: the ``O``/``I`` letters of the
  weight layouts).
* ``INITIALISER_TYPES``, ``INITIALISER_SCOPES``, ``FOLDED_TYPES`` and
  ``variable_of(op)``: what a graph drawing hides (initialisers and what
  only they read) and draws as parameters of their readers (constants,
  variables; the variable a read reads) (:mod:`amanda.tools.graph_view`).
* ``VARIADIC_ELEMENTWISE``: whether an element-wise op may take more than
  two inputs (ONNX ``Sum``/``Max``/``Min``/``Mean``).
* ``PARAM_READERS``: ``{canonical type: reader(op, values) -> params}``,
  the parameters an effective-path rule needs, from an IR op of the backend
  (:mod:`amanda.tools.effective_path_params`); a reader raises
  :class:`Unsupported` for a form the rules do not cover.
* ``check_params(op)``: raises :class:`Unsupported` for an IR op whose
  form no reader covers (a TF ``data_format`` other than ``NHWC``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from amanda.runtime import backends

__all__ = ["OpSpec", "Unsupported", "axes", "backend_of", "backend_ops",
           "backends_with_vocabulary", "canonical_type", "canonical_types", "lookup", "of",
           "pair", "row", "snake_case", "specs", "table"]


@dataclass(frozen=True)
class OpSpec:
    """How one backend spells one canonical op.

    Attributes:
        canonical: the canonical op type (``"conv2d"``).
        backend: the backend's name (``"onnx"``).
        ops: the backend's op names it covers (PyTorch function names,
            TF op types, ONNX op types).
        inputs: tensor role -> position among the op's inputs.
        layouts: tensor role -> layout (axis letters, ``N`` batch, ``C``
            channels, ``H``/``W`` spatial, ``O``/``I`` filter out/in channels,
            ``M`` depth multiplier, ``T`` tokens/features).
        attrs: canonical attribute name -> the backend's name (for PyTorch
            the function's parameter name).
    """

    canonical: str
    backend: str
    ops: tuple
    inputs: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)

    def position(self, role):
        """Input position of ``role`` (``"weight"``...), or None."""
        return self.inputs.get(role)

    def layout(self, role):
        """Layout of the tensor in ``role``, or None when it has none."""
        return self.layouts.get(role)

    def attr(self, name):
        """The backend's name for canonical attribute ``name``, or None."""
        return self.attrs.get(name)


class Unsupported(Exception):
    """An op in a form a vocabulary's reader does not cover (the tool turns
    it into its own error)."""


def of(namespace):
    """The vocabulary module of a namespace's (or backend name's) backend,
    or None when the backend is unknown or has none."""
    backend = backends.for_namespace(namespace)
    if backend is None or backend.vocabulary is None:
        return None
    return backend.part("vocabulary")


def backends_with_vocabulary():
    """The names of the registered backends that have a vocabulary, in registry order."""
    return tuple(b.name for b in backends.all_backends() if b.vocabulary is not None)


_specs = {}     # backend name -> (vocabulary module, {canonical: OpSpec}, {op: OpSpec})


def _rows(name):
    vocabulary = of(name)
    cached = _specs.get(name)
    if cached is None or cached[0] is not vocabulary:
        rows, index = {}, {}
        for canonical, entry in (getattr(vocabulary, "SPECS", None) or {}).items():
            rows[canonical] = OpSpec(canonical, name, *entry)
            for op in rows[canonical].ops:
                index.setdefault(op, rows[canonical])
        cached = _specs[name] = (vocabulary, rows, index)
    return cached[1], cached[2]


def table():
    """``{canonical type: {backend: OpSpec}}`` over every vocabulary, the
    canonical types in the order the backends first name them."""
    merged = {}
    for name in backends_with_vocabulary():
        for canonical, spec in _rows(name)[0].items():
            merged.setdefault(canonical, {})[name] = spec
    return merged


def lookup(namespace, op_name, canonical=None):
    """The :class:`OpSpec` of a backend op, or None when no row names it.

    Args:
        namespace: a backend (``"onnx"``) or a full context namespace.
        op_name: the backend's op name (``"Conv"``, ``"conv2d"``, ``"Conv2D"``).
        canonical: pick this canonical type where the name is ambiguous
            (a ``MatMul`` is ``"linear"`` when its second input is a weight).
    """
    backend = backends.for_namespace(namespace)
    if backend is None:
        return None
    rows, index = _rows(backend.name)
    if canonical is not None:
        spec = rows.get(canonical)
        return spec if spec is not None and op_name in spec.ops else None
    return index.get(op_name)


def row(namespace, canonical):
    """The :class:`OpSpec` of ``canonical`` in a namespace's backend, or None."""
    backend = backends.for_namespace(namespace)
    return None if backend is None else _rows(backend.name)[0].get(canonical)


def backend_ops(namespace):
    """``{op name: OpSpec}`` of every op of one backend its rows name (a new
    dict; empty for a backend without a vocabulary)."""
    backend = backends.for_namespace(namespace)
    return {} if backend is None else dict(_rows(backend.name)[1])


def specs(canonical):
    """backend -> :class:`OpSpec` for one canonical type."""
    return dict(table().get(canonical, {}))


def canonical_types(namespace, op_name):
    """Every canonical type whose row of a namespace's backend names
    ``op_name`` (an ONNX ``MatMul`` is ``{"linear", "matmul"}``)."""
    backend = backends.for_namespace(namespace)
    rows = {} if backend is None else _rows(backend.name)[0]
    return {canonical for canonical, spec in rows.items() if op_name in spec.ops}


def backend_of(value):
    """The name of the backend whose tensor, program or model ``value`` is
    (a TF ``Session``, an ``onnx.ModelProto``), or None."""
    backend = backends.for_value(value) or backends.for_program(value)
    return None if backend is None else backend.name


def snake_case(name):
    """``"Rsqrt"`` -> ``"rsqrt"``, ``"BiasAdd"`` -> ``"bias_add"``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def canonical_type(namespace, op_name):
    """The canonical type the backend's ``TYPES`` gives ``op_name``, else
    ``op_name`` in snake case."""
    vocabulary = of(namespace)
    found = None if vocabulary is None else vocabulary.TYPES.get(op_name)
    return found if found is not None else snake_case(op_name)


def pair(value, default):
    """A spatial parameter (an int, or a list of one or two) as ``(h, w)``."""
    if value is None or value == []:
        value = default
    if isinstance(value, (list, tuple)):
        value = [int(v) for v in value]
        return (value[0], value[0]) if len(value) == 1 else tuple(value[:2])
    return (int(value), int(value))


def axes(value, rank):
    """Reduction axes (a scalar or a list, maybe negative) as sorted non-negative ints."""
    return tuple(sorted({int(a) % rank for a in np.atleast_1d(np.asarray(value))}))
