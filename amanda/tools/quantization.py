"""Quantization-aware training (QAT) and post-training calibration.

:class:`QuantizationTool` fake-quantizes the weight and the activation (input
0) of every convolution and linear layer: each value is rounded to the grid
of a ``bits``-bit integer type and mapped back to floats,
``(clip(round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale``, so
the model computes with exactly the values an integer kernel would see.

* **Schemes** (:class:`QuantScheme`): 2 to 16 bits (8 and 4 are the usual),
  symmetric (signed grid, zero point 0) or asymmetric (unsigned grid, zero
  point chosen so the observed range fits), per tensor or per output channel.
* **Gradients** are straight-through: the fake-quant routines replace tensors
  with amanda's default autodiff isolation, so the gradient of a quantized
  tensor flows to the original as if the rounding were the identity (the STE
  of QAT). Backward ops themselves compute with the quantized values their
  forward op received.
* **Observers** (:class:`MinMaxObserver`, :class:`MovingAverageObserver`)
  track activation ranges. Post-training calibration is two phases: run data
  under ``amanda.apply(tool.calibration())`` (observe only, nothing changes),
  then under ``amanda.apply(tool)`` (fake-quantize with the calibrated
  ranges).
* **Portable**: the fake-quant routine is an :mod:`amanda.portable` routine
  (``portable.fake_quant``), so it lowers to native ops in TensorFlow and to
  ``QuantizeLinear``/``DequantizeLinear`` in ONNX.

Backends (through :class:`~amanda.tools.mapping.MappingTool` and
:data:`~amanda.tools.mapping_rules.WEIGHT_RULES` plus this module's
:data:`CHANNEL_RULES`):

* *eager* and *compiled* namespaces (PyTorch): routines run at every execution, so QAT
  tracks the weights as they train (weight ranges are re-measured before each
  use) and, until :meth:`QuantizationTool.freeze`, keeps observing activation
  ranges. No calibration is needed to start QAT.
* *graph* namespaces (TensorFlow ``tf.compat.v1`` graphs): scales and zero
  points are fixed when the graph is rewritten: weight ranges from the
  weights' values at that time, activation ranges from a calibration run
  (required; the error says so).

See ``docs/tools/quantization.md``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import amanda
from amanda import portable
from amanda.errors import AmandaError, ToolError
from amanda.runtime import vocabulary
from amanda.tools import mapping_rules, mapping_tables
from amanda.tools.mapping import MappingTool

__all__ = [
    "CHANNEL_RULES",
    "OBSERVERS",
    "QUANTIZED_TYPES",
    "Calibration",
    "MinMaxObserver",
    "MovingAverageObserver",
    "QParams",
    "QuantScheme",
    "QuantizationTool",
    "fake_quantize",
    "tensor_range",
]

#: Canonical op types quantized by default (weight and input 0).
QUANTIZED_TYPES = ("conv2d", "depthwise_conv2d", "linear")

# Smallest scale: keeps all-zero tensors (or channels) from dividing by zero.
_MIN_SCALE = float(np.finfo(np.float32).eps)


# -- schemes and the portable routine -----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How one kind of tensor is quantized.

    Args:
        bits: width of the integer grid (2 to 16).
        symmetric: signed grid ``[-2^(b-1), 2^(b-1) - 1]`` with zero point 0
            (``int8`` for 8 bits); otherwise unsigned ``[0, 2^b - 1]`` with
            a zero point (``uint8``).
        per_channel: one scale per output channel of a weight (the channel
            axis is given by :data:`CHANNEL_RULES`); activations are always
            per tensor.
    """

    bits: int = 8
    symmetric: bool = True
    per_channel: bool = False

    def __post_init__(self):
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or not 2 <= self.bits <= 16:
            raise AmandaError(f"QuantScheme: bits must be an int from 2 to 16, got {self.bits!r}")

    @property
    def qmin(self):
        """Smallest integer of the grid."""
        return -(1 << (self.bits - 1)) if self.symmetric else 0

    @property
    def qmax(self):
        """Largest integer of the grid."""
        return (1 << (self.bits - 1)) - 1 if self.symmetric else (1 << self.bits) - 1

    def qparams(self, low, high):
        """Scale and zero point for values in ``[low, high]``.

        The range is widened to include 0 (so 0 is exact). Symmetric:
        ``scale = max(|low|, high) / qmax``, zero point 0 (the largest
        magnitude lands exactly on ``±qmax``, never on a rounding tie, so every
        backend rounds it alike; ``qmin`` stays unused);
        asymmetric: ``scale = (high - low) / (qmax - qmin)``, ``zero_point =
        qmin - round(low / scale)``. Scales are at least float32's epsilon.

        Args:
            low, high: scalars, or 1-D arrays (one entry per channel).

        Returns:
            ``(scale, zero_point)``: float32 arrays shaped like ``low``; the
            zero point holds integers.
        """
        low = np.minimum(np.asarray(low, dtype=np.float64), 0.0)
        high = np.maximum(np.asarray(high, dtype=np.float64), 0.0)
        if self.symmetric:
            scale = np.maximum(np.maximum(-low, high) / self.qmax, _MIN_SCALE)
            zero_point = np.zeros_like(scale)
        else:
            scale = np.maximum((high - low) / (self.qmax - self.qmin), _MIN_SCALE)
            zero_point = np.clip(self.qmin - np.round(low / scale), self.qmin, self.qmax)
        return scale.astype(np.float32), zero_point.astype(np.float32)

    def describe(self):
        kind = "symmetric" if self.symmetric else "asymmetric"
        return f"{self.bits}-bit {kind} per-{'channel' if self.per_channel else 'tensor'}"


@portable.routine
def fake_quantize(x, scale, zero_point, qmin, qmax, axis=None):
    """The fake-quant instrumentation routine (portable: native in every backend).

    Returns ``(clip(round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale``,
    with ``scale``/``zero_point`` 1-D along ``axis`` when it is given.
    """
    return portable.fake_quant(x, scale, zero_point, qmin, qmax, axis=axis)


# -- observers ----------------------------------------------------------------------------

def tensor_range(value, axis=None):
    """``(min, max)`` of a tensor as float64 NumPy values.

    Args:
        value: a torch tensor or anything ``numpy.asarray`` takes.
        axis: None for the whole tensor, else the channel axis: the result
            is one min and one max per index along it.
    """
    if hasattr(value, "detach"):   # a torch tensor: reduce where it lives
        t = value.detach()
        if axis is not None:
            t = t.movedim(axis, 0).reshape(t.shape[axis], -1)
            low, high = t.amin(1), t.amax(1)
        else:
            low, high = t.min(), t.max()
        return (low.double().cpu().numpy(), high.double().cpu().numpy())
    a = np.asarray(value, dtype=np.float64)
    if axis is not None:
        a = np.moveaxis(a, axis, 0).reshape(a.shape[axis], -1)
        return a.min(axis=1), a.max(axis=1)
    return np.asarray(a.min()), np.asarray(a.max())


class MinMaxObserver:
    """Running minimum and maximum of every value observed.

    Attributes:
        min, max: the range so far (NumPy float64; None before the first
            observation).
        count: observations so far.
    """

    def __init__(self):
        self.min = self.max = None
        self.count = 0

    def observe(self, value):
        """Fold ``value``'s range into the running range."""
        low, high = tensor_range(value)
        if self.min is None:
            self.min, self.max = low, high
        else:
            self._combine(low, high)
        self.count += 1

    def _combine(self, low, high):
        self.min, self.max = np.minimum(self.min, low), np.maximum(self.max, high)

    @property
    def ready(self):
        return self.min is not None

    def reset(self):
        self.min = self.max = None
        self.count = 0

    def __repr__(self):
        return f"{type(self).__name__}(min={self.min}, max={self.max}, count={self.count})"


class MovingAverageObserver(MinMaxObserver):
    """Exponential moving average of each observation's min and max (less
    sensitive to one outlier batch than :class:`MinMaxObserver`).

    Args:
        momentum: weight of the newest observation (the first one is taken
            as is).
    """

    def __init__(self, momentum=0.1):
        super().__init__()
        if not 0.0 < momentum <= 1.0:
            raise AmandaError(f"MovingAverageObserver: momentum must be in (0, 1], got {momentum!r}")
        self.momentum = momentum

    def _combine(self, low, high):
        self.min = self.min + self.momentum * (low - self.min)
        self.max = self.max + self.momentum * (high - self.max)


#: Observer kinds by name, for ``QuantizationTool(observer=...)``.
OBSERVERS = {"minmax": MinMaxObserver, "moving_average": MovingAverageObserver}


class QParams:
    """Scale and zero point of one quantized tensor, held as tensors of the
    backend (what the fake-quant routine receives as keyword arguments).

    In eager backends the tensors are updated in place as the range changes,
    so the recorded routine always reads the current values.

    Attributes:
        scheme: the :class:`QuantScheme`.
        axis: the channel axis, or None.
        scale, zero_point: backend tensors (torch tensors; NumPy arrays in
            TensorFlow graphs).
        low, high: the range they were computed from (NumPy).
    """

    __slots__ = ("_as_tensor", "axis", "high", "low", "scale", "scheme", "zero_point")

    def __init__(self, scheme, axis, as_tensor, low, high):
        self.scheme, self.axis, self._as_tensor = scheme, axis, as_tensor
        self.low, self.high = low, high
        scale, zero_point = scheme.qparams(low, high)
        self.scale, self.zero_point = as_tensor(scale), as_tensor(zero_point)

    def update(self, low, high):
        """Recompute from a new range, in place."""
        self.low, self.high = low, high
        scale, zero_point = self.scheme.qparams(low, high)
        for buffer, value in ((self.scale, scale), (self.zero_point, zero_point)):
            if hasattr(buffer, "copy_"):
                buffer.copy_(self._as_tensor(value))
            else:
                buffer[...] = value

    def routine_kwargs(self):
        """Keyword arguments of :func:`fake_quantize`."""
        return {"scale": self.scale, "zero_point": self.zero_point, "qmin": self.scheme.qmin,
                "qmax": self.scheme.qmax, "axis": self.axis}

    def numpy(self):
        """``(scale, zero_point)`` as NumPy arrays."""
        return self.scheme.qparams(self.low, self.high)


# -- mapping: where a weight's output channels are ------------------------------------------

def _channel_rule(context):
    """The output-channel axis of the layout of the op type's weight (PyTorch
    ``OIHW`` and ``(out, in)``: 0; TF ``HWIO``: 3, ``HWIM``: 2, ``(in, out)``:
    1), on backends whose vocabulary has ``WEIGHT_CHANNELS``."""
    if context.get("weight_input") is None:
        return
    words = vocabulary.of(context.namespace)
    if words is None or not words.WEIGHT_CHANNELS:
        return
    spec = vocabulary.row(context.namespace, context.get("type"))
    axes = mapping_tables.channel_axes(None if spec is None else spec.layout("weight"))
    if axes is not None:
        context["weight_channel_axis"] = axes[0]


#: Sets ``"weight_channel_axis"`` (the output-channel axis of the op's weight
#: in the backend's layout) on contexts of ops with a weight.
CHANNEL_RULES = [["", _channel_rule]]


def _is_eager(context):
    """Whether the op's routines run at every execution, reading the tensors
    they are given then: PyTorch eager and compiled graphs (where the
    fake-quant routine's scale and zero point are inputs of the graph, the
    tensors `QParams.update` changes in place), not a rewritten TF graph."""
    return context.namespace.endswith(("/eager", "/compiled"))


def _converter(context):
    """NumPy -> what the op's routines receive (weight's dtype and device)."""
    convert = context.get("as_tensor")
    if convert is not None:
        return convert
    sample = context.get_inputs()[0]
    new_tensor = getattr(sample, "new_tensor", None)   # torch: same dtype and device
    if new_tensor is not None:
        return lambda array: new_tensor(np.asarray(array))
    return lambda array: np.asarray(array, dtype=np.float32)


# -- the tools --------------------------------------------------------------------------------

class QuantizationTool(amanda.Tool):
    """Fake-quantize weights and activations of convolutions and linear layers.

    Args:
        weight: the weights' :class:`QuantScheme`, or None to leave weights
            in float (default: 8-bit symmetric per-channel).
        activation: the scheme of each op's input 0, or None (default: 8-bit
            asymmetric per-tensor).
        observer: ``"moving_average"`` or ``"minmax"`` (:data:`OBSERVERS`),
            used for activation ranges.
        momentum: the moving average's weight of a new observation.
        op_types: canonical op types to quantize (:data:`QUANTIZED_TYPES`).

    Attributes:
        frozen: after :meth:`freeze`, activation ranges no longer change.
        observers: op key -> activation observer.
        qparams: ``(op key, "weight" | "activation")`` -> :class:`QParams`.
        ops: op key -> ``dict(name, type, module)`` of every quantized op;
            an op key is ``(namespace, op id)``.

    Example::

        tool = QuantizationTool(weight=QuantScheme(4, per_channel=True))
        with amanda.apply(tool):
            for x, y in data:
                loss = F.cross_entropy(model(x), y); loss.backward(); opt.step()
    """

    def __init__(self, weight=QuantScheme(8, symmetric=True, per_channel=True),
                 activation=QuantScheme(8, symmetric=False), observer="moving_average",
                 momentum=0.1, op_types=QUANTIZED_TYPES):
        super().__init__()
        if observer not in OBSERVERS:
            raise AmandaError(f"QuantizationTool: observer must be one of {sorted(OBSERVERS)}, "
                              f"got {observer!r}")
        for name, scheme in (("weight", weight), ("activation", activation)):
            if scheme is not None and not isinstance(scheme, QuantScheme):
                raise AmandaError(f"QuantizationTool: {name} must be a QuantScheme or None, "
                                  f"got {scheme!r}")
        self.weight, self.activation = weight, activation
        self.observer, self.momentum = observer, momentum
        self.op_types = frozenset(op_types)
        self.frozen = False
        self.observers = {}
        self.qparams = {}
        self.ops = {}
        self._sites = {}   # (namespace, module path, op name) -> op keys
        self._calibration = None
        self.depends_on(MappingTool(rules=mapping_rules.WEIGHT_RULES + CHANNEL_RULES))
        self.add_inst_for_op(self.forward_analysis)

    # -- phases ---------------------------------------------------------------
    def calibration(self):
        """The calibration phase: a tool that only observes activation ranges
        (into :attr:`observers`). Apply it over representative data before
        applying this tool; the same object every call."""
        if self._calibration is None:
            self._calibration = Calibration(self)
        return self._calibration

    def freeze(self):
        """Stop observing activations: their scales and zero points keep
        their current values (for evaluation and export after QAT). Weights
        are always quantized from their current range."""
        self.frozen = True

    def new_observer(self):
        if self.observer == "moving_average":
            return MovingAverageObserver(self.momentum)
        return MinMaxObserver()

    # -- analysis -------------------------------------------------------------
    def forward_analysis(self, context):
        op_type = context.get("type")
        if op_type not in self.op_types:
            return
        key = self._resolve((context.namespace, context.get_op_id()), context)
        self.note_op(key, context)
        if self.activation is not None:
            self._quantize_activation(context, key)
        position = context.get("weight_input")
        if self.weight is not None and position is not None:
            self._quantize_weight(context, key, position)

    def note_op(self, key, context):
        if key not in self.ops:
            self.ops[key] = {"name": context.get_op_name(), "type": context.get("type"),
                             "module": context.get_module_path()}
            self._sites.setdefault(self._site(context), []).append(key)

    @staticmethod
    def _site(context):
        return (context.namespace, context.get_module_path(), context.get_op_name())

    def _resolve(self, key, context):
        """An op never seen before takes the key of the only calibrated op
        with its module path and op name, if there is one: a PyTorch op id
        includes the call site of the innermost module whose code is the
        user's, so a bare ``nn.Linear`` calibrated in one place and evaluated
        in another gets two ids."""
        if key in self.ops or (_is_eager(context) and not self.frozen):
            return key
        known = [k for k in self._sites.get(self._site(context), ()) if k in self.observers]
        return known[0] if len(known) == 1 else key

    def _quantize_weight(self, context, key, position):
        axis = context.get("weight_channel_axis") if self.weight.per_channel else None
        low, high = tensor_range(context["weight"], axis)
        qparams = self.qparams[(key, "weight")] = QParams(self.weight, axis, _converter(context),
                                                          low, high)
        if _is_eager(context) and not self.frozen:
            # recorded while training; frozen, the weight's range is measured
            # here once (what an export, which needs portable routines only, does)
            context.insert_before_op(self.track_weight, inputs=[position], qparams=qparams)
        context.insert_before_op(fake_quantize, inputs=[position], **qparams.routine_kwargs())

    def _quantize_activation(self, context, key):
        observer = self.observers.get(key)
        tracking = _is_eager(context) and not self.frozen
        if not tracking and (observer is None or not observer.ready):
            raise ToolError("the activation range of this op was never observed: apply "
                            "tool.calibration() over some data first (or pass activation=None)",
                            tool=self, routine=self.forward_analysis,
                            op_name=context.get_op_name(), op_id=context.get_op_id(),
                            namespace=context.namespace)
        if observer is None:
            observer = self.observers[key] = self.new_observer()
        low, high = (observer.min, observer.max) if observer.ready else (0.0, 0.0)
        qparams = self.qparams[(key, "activation")] = QParams(self.activation, None,
                                                              _converter(context), low, high)
        if tracking:
            context.insert_before_op(self.track_activation, inputs=[0], observer=observer,
                                     qparams=qparams)
        context.insert_before_op(fake_quantize, inputs=[0], **qparams.routine_kwargs())

    # -- instrumentation routines (observe only; eager backends) ---------------
    def track_weight(self, weight, qparams):
        """Re-measure a weight's range before it is fake-quantized (also when
        frozen: a weight is always quantized from its own range, as an export
        or a graph rewrite of the same weights would)."""
        qparams.update(*tensor_range(weight, qparams.axis))

    def track_activation(self, value, observer, qparams):
        """Fold an activation into its observer and refresh its scale."""
        if not self.frozen:
            observer.observe(value)
            qparams.update(observer.min, observer.max)

    # -- report ---------------------------------------------------------------
    def report(self):
        """One dict per quantized op: ``name``, ``type``, ``module``, and per
        quantized tensor (``weight``, ``activation``) its scheme, range
        (``min``/``max``, per channel for per-channel weights), ``scale`` and
        ``zero_point`` as lists."""
        rows = []
        for key, info in self.ops.items():
            row = {"op_id": str(key[1]), "namespace": key[0], **info}
            for kind in ("activation", "weight"):
                qparams = self.qparams.get((key, kind))
                if qparams is None:
                    continue
                scale, zero_point = qparams.numpy()
                row[kind] = {"scheme": qparams.scheme.describe(), "axis": qparams.axis,
                             "min": np.asarray(qparams.low).tolist(),
                             "max": np.asarray(qparams.high).tolist(),
                             "scale": scale.tolist(), "zero_point": zero_point.tolist()}
            rows.append(row)
        return rows

    def __repr__(self):
        parts = [f"weight={self.weight.describe() if self.weight else None}",
                 f"activation={self.activation.describe() if self.activation else None}",
                 f"ops={len(self.ops)}"]
        return f"QuantizationTool({', '.join(parts)}{', frozen' if self.frozen else ''})"


class Calibration(amanda.Tool):
    """The calibration phase of a :class:`QuantizationTool`: observes the
    input 0 of the ops it would quantize, changes nothing. Get it with
    :meth:`QuantizationTool.calibration`."""

    def __init__(self, quantization):
        super().__init__()
        self.quantization = quantization
        self.depends_on(MappingTool(rules=mapping_rules.RULES))
        self.add_inst_for_op(self.forward_analysis)

    def forward_analysis(self, context):
        owner = self.quantization
        if context.get("type") not in owner.op_types or owner.activation is None:
            return
        key = (context.namespace, context.get_op_id())
        owner.note_op(key, context)
        observer = owner.observers.get(key)
        if observer is None:
            observer = owner.observers[key] = owner.new_observer()
        context.insert_before_op(self.observe, inputs=[0], observer=observer)

    def observe(self, value, observer):
        """Instrumentation routine: fold the value into the op's observer."""
        observer.observe(value)
