"""Weight pruning: unstructured magnitude, N:M and channel-wise; static or dynamic.

:class:`Pruner` masks the weight of every convolution and linear layer as the
op reads it, and masks the weight's gradient, so the model trains with pruned
weights without its parameters or source being touched:

* **forward**: ``insert_before_op`` on the weight input with the portable
  routine :func:`mask_weight` (``weight * mask``): the op computes with the
  pruned weight. The parameter itself keeps its values.
* **backward**: ``insert_after_backward_op`` on the backward op that computes
  the weight's gradient (``context["weight_grad"]``) with :func:`mask_grad`
  (``grad * mask``): pruned weights get a zero gradient, so an optimizer
  without weight decay never moves them.

Patterns (masks are computed in NumPy on the weight in its backend's layout;
:data:`LAYOUT_RULES` say where the output and input channels are):

* ``"unstructured"``: the ``sparsity`` fraction of weights with the smallest
  magnitude (rounded to the nearest count);
* ``"N:M"`` (e.g. ``"2:4"``): in every group of ``M`` consecutive weights
  along the input-channel axis, the ``N`` largest by magnitude are kept (the
  pattern sparse tensor cores run); layers whose input dimension is not a
  multiple of ``M`` are skipped and reported;
* ``"channel"``: the ``sparsity`` fraction of output channels with the
  smallest L1 norm.

Schedules: *static* (``update_every=None``) computes each mask once, from the
weight at the op's first execution (eager) or when the graph is rewritten
(TensorFlow), and uses portable routines that graph backends lower natively.
*Dynamic* (``update_every=k``) recomputes the mask from the weight's current
value every ``k`` executions of the op, in a routine that keeps state (a
callback in graph backends); ``sparsity`` may then be a function of the number
of updates so far (gradual pruning).

The tool is written once against :class:`~amanda.tools.mapping.MappingTool`
rules (:data:`amanda.tools.mapping_rules.WEIGHT_RULES` and
:data:`LAYOUT_RULES`): it runs on PyTorch eager and on TensorFlow graphs
(``tf.compat.v1`` sessions, training ops included). See ``docs/tools/pruning.md``.
"""

from __future__ import annotations

import re

import numpy as np

import amanda
from amanda import portable
from amanda.errors import AmandaError
from amanda.runtime import vocabulary
from amanda.runtime.tool_support import support_for
from amanda.tools import mapping_rules, mapping_tables
from amanda.tools._module_path import module_path_of
from amanda.tools.mapping import MappingTool

__all__ = ["Pruner", "PrunedLayer", "magnitude_mask", "nm_mask", "channel_mask",
           "mask_weight", "mask_grad", "LAYOUT_RULES", "PRUNED_TYPES"]

#: Canonical op types pruned by default (those the mapping rules give a weight).
PRUNED_TYPES = ("conv2d", "depthwise_conv2d", "linear", "addmm", "mm", "matmul")

#: Matrix products pruned where an operand is a 2-D parameter laid out
#: (in, out) (transformers' ``Conv1D``: ``torch.addmm(b, x, W)``): the
#: operand's position (the backend says whether it is a parameter, and
#: which gradient of each backward op is that operand's).
PARAMETER_PRODUCTS = {"addmm": 2, "mm": 1, "matmul": 1}


# -- masks (NumPy, any layout) ---------------------------------------------------------

def _float_dtype(weight):
    return weight.dtype if weight.dtype.kind == "f" else np.dtype(np.float32)


def _count(sparsity, total):
    if not 0.0 <= sparsity <= 1.0:
        raise AmandaError(f"Pruner: sparsity must be between 0 and 1, got {sparsity!r}")
    return int(np.round(sparsity * total))


def magnitude_mask(weight, sparsity):
    """Unstructured magnitude mask: 0 for the ``round(sparsity * size)``
    weights of smallest magnitude (ties: the first ones), 1 elsewhere.

    Args:
        weight: a NumPy array.
        sparsity: fraction of weights to prune, in [0, 1].

    Returns:
        A mask of ``weight``'s shape and (float) dtype.
    """
    weight = np.asarray(weight)
    flat = np.abs(weight).reshape(-1)
    mask = np.ones(flat.size, _float_dtype(weight))
    pruned = _count(sparsity, flat.size)
    if pruned:
        mask[np.argsort(flat, kind="stable")[:pruned]] = 0
    return mask.reshape(weight.shape)


def nm_mask(weight, n, m, axis):
    """N:M mask: in every group of ``m`` consecutive weights along ``axis``,
    the ``n`` of largest magnitude are kept (ties: the first ones).

    Args:
        weight: a NumPy array.
        n, m: keep ``n`` of every ``m``.
        axis: the axis the groups run along (the input channels).

    Returns:
        The mask, or None when the axis' length is not a multiple of ``m``.
    """
    weight = np.asarray(weight)
    moved = np.moveaxis(np.abs(weight), axis, -1)
    length = moved.shape[-1]
    if length % m:
        return None
    groups = moved.reshape(moved.shape[:-1] + (length // m, m))
    order = np.argsort(-groups, axis=-1, kind="stable")
    mask = np.zeros(groups.shape, _float_dtype(weight))
    np.put_along_axis(mask, order[..., :n], 1, axis=-1)
    return np.moveaxis(mask.reshape(moved.shape), -1, axis)


def channel_mask(weight, sparsity, axis):
    """Channel-wise mask: the ``round(sparsity * channels)`` output channels
    (indices along ``axis``) of smallest L1 norm are zeroed entirely.

    Args:
        weight: a NumPy array.
        sparsity: fraction of channels to prune, in [0, 1].
        axis: the output-channel axis.

    Returns:
        A mask of ``weight``'s shape and (float) dtype.
    """
    weight = np.asarray(weight)
    moved = np.moveaxis(np.abs(weight), axis, 0)
    norms = moved.reshape(moved.shape[0], -1).sum(axis=1)
    keep = np.ones(moved.shape[0], _float_dtype(weight))
    pruned = _count(sparsity, keep.size)
    if pruned:
        keep[np.argsort(norms, kind="stable")[:pruned]] = 0
    shape = [1] * weight.ndim
    shape[axis] = keep.size
    return np.broadcast_to(keep.reshape(shape), weight.shape).copy()


# -- portable instrumentation routines ------------------------------------------------------

@portable.routine
def mask_weight(weight, mask):
    """Forward routine: the weight as the op sees it, ``weight * mask``."""
    return weight * mask


@portable.routine
def mask_grad(grad, mask):
    """Backward routine: the weight's gradient with pruned entries zeroed."""
    return grad * mask


# -- mapping: where a weight's output and input channels are ------------------------------

def _layout_rule(context):
    """The channel axes of the weight's layout (``context["weight_layout"]``:
    PyTorch ``OIHW`` and ``(out, in)``; TF ``HWIO``, ``HWIM`` and ``(in,
    out)``, or ``(out, in)`` for a ``MatMul`` with ``transpose_b``), on
    backends whose vocabulary has ``WEIGHT_CHANNELS``."""
    if not context.is_forward() or context.get("weight_input") is None:
        return
    words = vocabulary.of(context.namespace)
    axes = mapping_tables.channel_axes(context.get("weight_layout")) \
        if words is not None and words.WEIGHT_CHANNELS else None
    if axes is not None:
        context["weight_channel_axis"], context["weight_input_axis"] = axes


#: Set ``"weight_channel_axis"`` (output channels) and ``"weight_input_axis"``
#: (input channels; None for depthwise convolutions) on forward contexts of
#: ops with a weight, in the backend's weight layout.
LAYOUT_RULES = [["", _layout_rule]]


# -- the tool --------------------------------------------------------------------------------

class PrunedLayer:
    """One pruned op: its identity, its mask and how it was computed.

    Attributes:
        key: ``(namespace, op id)``.
        op_id, type, module: the op's id, canonical type and module path
            (PyTorch) or name scope (TF).
        shape: the weight's shape in the backend's layout.
        mask: the current mask (NumPy, weight layout).
        mask_tensor: the same as the backend's routines receive it.
        updates: how many times the mask was computed.
        calls: forward executions seen by the dynamic routine.
    """

    __slots__ = ("key", "op_id", "type", "module", "shape", "mask", "mask_tensor", "updates",
                 "calls", "as_tensor", "axes")

    def __init__(self, key, op_id, op_type, module, shape, as_tensor, axes):
        self.key, self.op_id, self.type, self.module = key, op_id, op_type, module
        self.shape, self.as_tensor, self.axes = tuple(shape), as_tensor, axes
        self.mask = self.mask_tensor = None
        self.updates = self.calls = 0

    @property
    def sparsity(self):
        """Fraction of zeros in the mask."""
        return float((self.mask == 0).mean()) if self.mask is not None else 0.0

    def __repr__(self):
        return f"<PrunedLayer {self.type} {self.op_id} sparsity={self.sparsity:.3f}>"


def _pattern(pattern):
    """``("unstructured" | "channel", None)`` or ``("nm", (n, m))``."""
    if pattern in ("unstructured", "channel"):
        return pattern, None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(pattern))
    if match:
        n, m = int(match.group(1)), int(match.group(2))
        if 0 < n <= m:
            return "nm", (n, m)
    raise AmandaError(f"Pruner: pattern must be 'unstructured', 'channel' or 'N:M' with "
                      f"0 < N <= M (e.g. '2:4'), got {pattern!r}")


def _parameter_operand(context):
    """``(position, weight (NumPy copy), as_tensor, (out axis, in axis))``
    for a matrix product (`PARAMETER_PRODUCTS`) whose operand is a 2-D
    parameter (the backend says: ``parameter_operand``), else None."""
    position = PARAMETER_PRODUCTS.get(context.get("type"))
    support = None if position is None else support_for(context.namespace)
    found = None if support is None else support.parameter_operand(context, position)
    if found is None:
        return None
    weight, as_tensor = found
    return position, weight, as_tensor, (1, 0)


def _to_numpy(value):
    if hasattr(value, "detach"):   # a torch tensor
        return value.detach().cpu().numpy()
    return np.asarray(value)


class Pruner(amanda.Tool):
    """Prune the weights of convolutions and linear layers, forward and backward.

    Args:
        pattern: ``"unstructured"`` (magnitude), ``"channel"`` (L1 of output
            channels) or ``"N:M"`` such as ``"2:4"``.
        sparsity: fraction to prune (weights or channels; ignored for N:M,
            whose sparsity is ``1 - N/M``). With ``update_every``, may be a
            function of the number of mask updates so far (0 at the first)
            returning the fraction: a gradual schedule.
        update_every: None for a static mask (computed once per op);
            ``k`` to recompute it from the current weight every ``k``
            executions of the op (dynamic pruning).
        mask_grads: also mask the weights' gradients (pruned weights then
            never move). With False and a dynamic mask, pruned weights keep
            training (straight-through) and may come back at the next update.
        op_types: canonical op types to prune (:data:`PRUNED_TYPES`).
        select: optional ``select(context) -> bool`` choosing the ops to prune
            among those (e.g. skip the classifier).

    Attributes:
        layers: op key -> :class:`PrunedLayer`, in analysis order.
        skipped: op key -> ``dict(op_id, type, module, reason)`` for each op
            of a pruned type left dense (the pattern does not fit its weight).

    Raises:
        AmandaError: an invalid pattern, sparsity or ``update_every``.

    Example::

        pruner = Pruner("2:4")
        for x, y in data:
            with amanda.apply(pruner):
                loss = F.cross_entropy(model(x), y)
                loss.backward()
            optimizer.step(); optimizer.zero_grad()
        print(pruner.table())
    """

    def __init__(self, pattern="unstructured", sparsity=0.5, update_every=None, mask_grads=True,
                 op_types=PRUNED_TYPES, select=None):
        super().__init__()
        self.pattern, self.nm = _pattern(pattern)
        self.pattern_name = pattern if self.nm is None else f"{self.nm[0]}:{self.nm[1]}"
        if not callable(sparsity):
            _count(float(sparsity), 1)   # validates the range
        if update_every is not None and (not isinstance(update_every, int)
                                         or isinstance(update_every, bool) or update_every < 1):
            raise AmandaError(f"Pruner: update_every must be None or a positive int, "
                              f"got {update_every!r}")
        if callable(sparsity) and update_every is None:
            raise AmandaError("Pruner: a sparsity schedule (a function) needs update_every")
        self.sparsity = sparsity
        self.update_every = update_every
        self.mask_grads = mask_grads
        self.op_types = frozenset(op_types)
        self.select = select
        self.layers = {}
        self.skipped = {}
        self.depends_on(MappingTool(rules=mapping_rules.WEIGHT_RULES + LAYOUT_RULES))
        self.add_inst_for_op(self.forward_analysis)
        if mask_grads:
            self.add_inst_for_op(self.backward_analysis, backward=True, require_outputs=True)

    # -- masks ----------------------------------------------------------------------
    def _fraction(self, updates):
        sparsity = self.sparsity(updates) if callable(self.sparsity) else self.sparsity
        return float(sparsity)

    def compute_mask(self, weight, layer):
        """The mask for ``weight`` (NumPy, in ``layer``'s layout), or None when
        the pattern does not apply to the layer."""
        out_axis, in_axis = layer.axes
        if self.nm is not None:
            if in_axis is None:
                return None
            return nm_mask(weight, *self.nm, axis=in_axis)
        fraction = self._fraction(layer.updates)
        if self.pattern == "channel":
            return channel_mask(weight, fraction, out_axis)
        return magnitude_mask(weight, fraction)

    def _update(self, layer, weight):
        mask = self.compute_mask(weight, layer)
        layer.mask = mask
        layer.mask_tensor = layer.as_tensor(mask)
        layer.updates += 1

    # -- analysis -------------------------------------------------------------------
    def forward_analysis(self, context):
        position = context.get("weight_input")
        if context.get("type") not in self.op_types:
            return
        if position is None:
            found = _parameter_operand(context)
            if found is None:
                return
            position, weight, as_tensor, axes = found
        else:
            weight, as_tensor = context["weight"], context["as_tensor"]
            axes = (context.get("weight_channel_axis"), context.get("weight_input_axis"))
        if self.select is not None and not self.select(context):
            return
        key = (context.namespace, context.get_op_id())
        layer = PrunedLayer(key, context.get_op_id(), context["type"], module_path_of(context),
                            weight.shape, as_tensor, axes)
        if self.compute_mask(weight, layer) is None:
            self.skipped[key] = {"op_id": layer.op_id, "type": layer.type, "module": layer.module,
                                 "reason": f"{self.pattern_name} needs an input dimension "
                                           f"divisible by {self.nm[1]}; weight shape "
                                           f"{tuple(weight.shape)}"}
            return
        self._update(layer, weight)
        self.layers[key] = layer
        context["prune_layer"] = layer
        if self.update_every is None:
            context.insert_before_op(mask_weight, inputs=[position], mask=layer.mask_tensor)
        else:
            context.insert_before_op(self.dynamic_mask_weight, inputs=[position], layer=layer)

    def backward_analysis(self, context):
        layer = context.get("prune_layer")
        position = context.get("weight_grad")
        if layer is not None and layer.type in PARAMETER_PRODUCTS:
            support = support_for(context.namespace)
            position = None if support is None else support.operand_grad(context.get_backward_op())
        if layer is None or position is None:
            return
        grads = context.get_grad_inputs()
        if position >= len(grads) or grads[position] is None:   # a frozen weight
            return
        if self.update_every is None:
            context.insert_after_backward_op(mask_grad, grad_inputs=[position],
                                             mask=layer.mask_tensor)
        else:
            context.insert_after_backward_op(self.dynamic_mask_grad, grad_inputs=[position],
                                             layer=layer)

    # -- dynamic routines (keep state: callbacks in graph backends) -------------------------
    def dynamic_mask_weight(self, weight, layer):
        """Recompute ``layer``'s mask from ``weight`` every ``update_every``
        executions, then return ``weight * mask``."""
        if layer.calls and layer.calls % self.update_every == 0:
            self._update(layer, _to_numpy(weight))
        layer.calls += 1
        return weight * layer.mask_tensor

    def dynamic_mask_grad(self, grad, layer):
        """The weight's gradient masked with ``layer``'s current mask."""
        return grad * layer.mask_tensor

    # -- report ---------------------------------------------------------------------
    def masks(self):
        """Op key -> the current mask (NumPy, in the weight's layout)."""
        return {key: layer.mask for key, layer in self.layers.items()}

    def report(self):
        """The sparsity report.

        Returns:
            ``{"layers": [...], "total": {...}, "skipped": [...]}``: one dict
            per pruned op (``op_id``, ``type``, ``module``, ``shape``,
            ``numel``, ``pruned``, ``sparsity``, ``updates``), the totals over
            them (``numel``, ``pruned``, ``sparsity``) and the skipped ops
            (:attr:`skipped`'s values).
        """
        rows = []
        for layer in self.layers.values():
            numel = int(layer.mask.size)
            pruned = int((layer.mask == 0).sum())
            rows.append({"op_id": layer.op_id, "type": layer.type, "module": layer.module,
                         "shape": layer.shape, "numel": numel, "pruned": pruned,
                         "sparsity": pruned / numel if numel else 0.0, "updates": layer.updates})
        numel = sum(r["numel"] for r in rows)
        pruned = sum(r["pruned"] for r in rows)
        return {"layers": rows,
                "total": {"numel": numel, "pruned": pruned,
                          "sparsity": pruned / numel if numel else 0.0},
                "skipped": list(self.skipped.values())}

    def table(self):
        """The sparsity report as a text table."""
        report = self.report()
        labels = [str(r["module"] or r["op_id"]) for r in report["layers"]]
        width = max([len("layer")] + [len(label) for label in labels])
        head = f"{'layer':<{width}}  {'type':<16}  {'shape':<20}  {'pruned':>12}  {'sparsity':>8}"
        rule = "-" * len(head)
        lines = [f"pattern {self.pattern_name}, "
                 + ("static mask" if self.update_every is None
                    else f"mask recomputed every {self.update_every} executions"), head, rule]
        for label, r in zip(labels, report["layers"]):
            lines.append(f"{label:<{width}}  {r['type']:<16}  {str(r['shape']):<20}  "
                         f"{r['pruned']:>12,}  {r['sparsity']:>8.1%}")
        total = report["total"]
        lines += [rule, f"{'total':<{width}}  {'':<16}  {'':<20}  {total['pruned']:>12,}  "
                        f"{total['sparsity']:>8.1%}"]
        for entry in report["skipped"]:
            lines.append(f"skipped {entry['module'] or entry['op_id']}: {entry['reason']}")
        return "\n".join(lines)

    def __repr__(self):
        total = self.report()["total"]
        return (f"Pruner({self.pattern_name}, {len(self.layers)} layers, "
                f"sparsity {total['sparsity']:.3f})")
