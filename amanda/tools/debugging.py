"""Debugging tools: find the first op producing NaN/Inf, and per-op statistics.

Both tools only observe (their routines return None) and work on every backend
whose routines receive PyTorch tensors or NumPy arrays (TensorFlow graph mode).
See ``docs/tools/debugging.md``.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

import amanda
from amanda.runtime.tool_support import for_value

__all__ = ["NanError", "NanReport", "NanDetector", "OpStatistics", "tensor_stats"]


# -- helpers accepting torch tensors and NumPy arrays ------------------------

def _stats_support(value):
    """The tool support of the backend whose tensor ``value`` is, where it
    computes statistics itself (PyTorch: ``has_nonfinite``, ``tensor_stats``);
    None for NumPy arrays and other values."""
    kind = type(value)
    if kind not in _STATS_SUPPORT:
        support = for_value(value)
        _STATS_SUPPORT[kind] = support if hasattr(support, "tensor_stats") else None
    return _STATS_SUPPORT[kind] if hasattr(value, "detach") else None


_STATS_SUPPORT = {}   # value type -> its backend's tool support, where it computes statistics


def _is_torch(value):
    """A framework tensor whose statistics its backend computes."""
    return _stats_support(value) is not None


def _is_array(value):
    """A tensor/array with numeric content (None, resources, strings: no)."""
    if value is None:
        return False
    if _is_torch(value):
        return True
    if isinstance(value, np.ndarray) or isinstance(value, np.generic):
        return value.dtype.kind in "biufc"
    return False


def _is_floating(value):
    if _is_torch(value):
        return value.is_floating_point() or value.is_complex()
    return np.asarray(value).dtype.kind in "fc"


def _has_nonfinite(value):
    """True when ``value`` (a tensor or array) holds a NaN or an Inf."""
    if not _is_array(value) or not _is_floating(value):
        return False
    if _is_torch(value):
        return _stats_support(value).has_nonfinite(value)
    return not bool(np.isfinite(np.asarray(value)).all())


def tensor_stats(value):
    """Statistics of a tensor or array as a dict of Python numbers.

    Keys: ``shape``, ``dtype``, ``numel``, ``min``, ``max``, ``mean``, ``std``
    (over the finite elements; None when there is none), ``nan``, ``inf`` (counts)
    and ``sparsity`` (fraction of exact zeros). None for a non-numeric value.
    """
    if not _is_array(value):
        return None
    if _is_torch(value):
        shape, dtype, numel, nan, inf, zeros, mn, mx, mean, std = \
            _stats_support(value).tensor_stats(value)
    else:
        a = np.asarray(value)
        shape, dtype = tuple(a.shape), str(a.dtype)
        a = np.abs(a) if a.dtype.kind == "c" else a
        a = a.astype(np.float64, copy=False)
        numel = int(a.size)
        nan = int(np.isnan(a).sum())
        inf = int(np.isinf(a).sum())
        zeros = int((a == 0).sum())
        finite = a[np.isfinite(a)]
        if finite.size:
            mn, mx = float(finite.min()), float(finite.max())
            mean, std = float(finite.mean()), float(finite.std())
        else:
            mn = mx = mean = std = None
    return {"shape": shape, "dtype": dtype, "numel": numel, "min": mn, "max": mx,
            "mean": mean, "std": std, "nan": nan, "inf": inf,
            "sparsity": zeros / numel if numel else 0.0}


def _to_numpy(value):
    if _is_torch(value):
        return value.detach().cpu().numpy().copy()
    return np.array(value, copy=True)


def _backward_op_name(op):
    """Name of a backward op: ``SqrtBackward0`` (PyTorch node), the gradient
    op's name (TensorFlow)."""
    if op is None:
        return None
    name = getattr(op, "name", None)
    if callable(name):
        return name()
    if isinstance(name, str):
        return name
    return type(op).__name__


def _backward_op_type(op):
    kind = getattr(op, "type", None)
    return kind if isinstance(kind, str) else _backward_op_name(op)


# -- NaN detection ----------------------------------------------------------

class NanError(amanda.AmandaError):
    """Raised by :class:`NanDetector` with ``raise_on_nan=True``.

    Attributes:
        report: the :class:`NanReport` of the first op producing NaN/Inf.
    """

    def __init__(self, report):
        self.report = report
        super().__init__(report.describe())


@dataclasses.dataclass
class NanReport:
    """The first op (in execution order) whose outputs held a NaN or an Inf.

    Attributes:
        op_name: the forward op's type name (``linear``, ``MatMul``); in a
            backward context, the forward op owning the backward op (None for
            a TF gradient op without owner).
        op_id: the forward op's stable id (the op name in TensorFlow).
        backward: True when a backward op produced it.
        backward_op_name: ``SqrtBackward0`` / the TF gradient op's name (backward only).
        backward_op_type: the TF gradient op's type (``SqrtGrad``) or the
            PyTorch node name (backward only).
        backward_op_id: the backward op's stable id (backward only).
        module_path: dotted module path where the backend knows it.
        namespace: the context's namespace.
        output_index: position of the first output (gradient input for a
            backward op) holding NaN/Inf among the op's outputs.
        output_stats: :func:`tensor_stats` of that output.
        input_stats: :func:`tensor_stats` of each input as the op received it
            (the incoming gradients for a backward op); None for inputs that
            are not numeric tensors (e.g. TF resource handles).
        execution: how many ops (forward + backward) had run before, in this
            tool's count (0-based index of the op's execution).
    """

    op_name: object
    op_id: object
    backward: bool
    backward_op_name: object
    backward_op_type: object
    backward_op_id: object
    module_path: object
    namespace: str
    output_index: int
    output_stats: dict
    input_stats: list
    execution: int

    def describe(self):
        side = "backward" if self.backward else "forward"
        text = f"NaN/Inf produced by {side} op {self.op_name!r} (id {self.op_id})"
        if self.backward:
            text += f" in backward op {self.backward_op_name!r}"
        text += f", module path {self.module_path!r}, namespace {self.namespace!r}"
        out = self.output_stats or {}
        text += (f"; output {self.output_index}: nan={out.get('nan')} inf={out.get('inf')}"
                 f" of {out.get('numel')}")
        for i, stats in enumerate(self.input_stats):
            if stats is None:
                text += f"; input {i}: -"
            else:
                text += (f"; input {i}: min={stats['min']} max={stats['max']} "
                         f"mean={stats['mean']} nan={stats['nan']} inf={stats['inf']}")
        return text

    __str__ = describe


class NanDetector(amanda.Tool):
    """Finds the first op whose outputs (forward) or gradient inputs (backward)
    hold a NaN or an Inf.

    Args:
        raise_on_nan: raise :class:`NanError` at that op instead of only recording.
        forward, backward: which ops to check.
        check_sources: also check ops without any numeric tensor input
            (constants, variable reads, placeholders, ``torch.zeros``). Off by
            default, so a NaN in a weight is reported at the first op
            computing with it, on every backend.
        input_stats: record statistics of the op's inputs (computed before
            each op, so in-place ops do not change them). Off saves one
            routine and a few reductions per input per op.

    Attributes:
        report: the :class:`NanReport`, or None while no NaN/Inf was seen.
        reports: every report since :meth:`reset` (only the first, unless
            ``record_all=True``).
        executions: ops checked so far.
    """

    def __init__(self, raise_on_nan=False, forward=True, backward=True,
                 check_sources=False, input_stats=True, record_all=False):
        super().__init__()
        self.raise_on_nan = raise_on_nan
        self.check_sources = check_sources
        self.input_stats = input_stats
        self.record_all = record_all
        self.reports = []
        self.executions = 0
        self._pending = {}
        if forward:
            self.add_inst_for_op(self._forward_analysis)
        if backward:
            self.add_inst_for_op(self._backward_analysis, backward=True)

    @property
    def report(self):
        return self.reports[0] if self.reports else None

    def reset(self):
        """Forget the reports (to look for the next first NaN)."""
        self.reports = []
        self.executions = 0
        self._pending.clear()

    def _done(self):
        return bool(self.reports) and not self.record_all

    def _forward_analysis(self, context):
        info = dict(op_name=context.get_op_name(), op_id=context.get_op_id(), backward=False,
                    backward_op_name=None, backward_op_type=None, backward_op_id=None,
                    module_path=context.get_module_path(), namespace=context.namespace)
        key = ("f", info["op_id"])
        context.insert_before_op(self._before, key=key)
        context.insert_after_op(self._after, key=key, info=info)

    def _backward_analysis(self, context):
        op = context.get_backward_op()
        info = dict(op_name=context.get_op_name() if context.get_op() is not None else None,
                    op_id=context.get_op_id(), backward=True,
                    backward_op_name=_backward_op_name(op), backward_op_type=_backward_op_type(op),
                    backward_op_id=context.get_backward_op_id(),
                    module_path=context.get_module_path(), namespace=context.namespace)
        key = ("b", context.get_backward_op_id())
        context.insert_before_backward_op(self._before, key=key)
        context.insert_after_backward_op(self._after, key=key, info=info)

    # instrumentation routines: observe only
    def _before(self, *inputs, key):
        if self._done():
            return None
        numeric = [_is_array(x) for x in inputs]
        stats = None
        if self.input_stats:
            stats = [tensor_stats(x) if ok else None for x, ok in zip(inputs, numeric)]
        self._pending[key] = (any(numeric), stats)
        return None

    def _after(self, *outputs, key, info):
        if self._done():
            return None
        has_inputs, stats = self._pending.pop(key, (True, None))
        execution = self.executions
        self.executions += 1
        if not has_inputs and not self.check_sources and not info["backward"]:
            return None
        for index, value in enumerate(outputs):
            if _has_nonfinite(value):
                report = NanReport(**info, output_index=index, output_stats=tensor_stats(value),
                                   input_stats=stats or [], execution=execution)
                self.reports.append(report)
                if self.raise_on_nan:
                    raise NanError(report)
                break
        return None


# -- statistics ---------------------------------------------------------------

def _matches(selector, context):
    """``selector``: None (all), a callable on the context, or a string / a
    collection of strings matched against the op name, op id and module path."""
    if selector is None:
        return True
    if callable(selector):
        return bool(selector(context))
    names = {context.get_op_name(), str(context.get_op_id()), context.get_module_path()}
    if isinstance(selector, str):
        selector = (selector,)
    return any(s in names for s in selector)


class OpStatistics(amanda.Tool):
    """Output statistics of forward ops, aggregated by op id.

    Args:
        op_types: which ops to collect: None (all), op names (``"relu"``,
            ``"MatMul"``), op ids, module paths, or a callable on the context.
        dump_ops: same kind of filter; these ops' last outputs are kept (as
            NumPy copies) for :meth:`to_npz`. None: keep none.

    Per execution and numeric output, :func:`tensor_stats` is computed; the
    aggregate per (op id, output) holds ``calls``, the mean over calls of
    ``mean``, ``std`` and ``sparsity``, the min of ``min`` and the max of
    ``max``, the NaN/Inf totals and the ``last`` execution's statistics.
    """

    def __init__(self, op_types=None, dump_ops=None):
        super().__init__()
        self.op_types = op_types
        self.dump_ops = dump_ops
        self._stats = {}
        self._dumps = {}
        self.add_inst_for_op(self._analysis)

    def _analysis(self, context):
        if not _matches(self.op_types, context):
            return
        info = {"op_id": context.get_op_id(), "op_name": context.get_op_name(),
                "module_path": context.get_module_path(), "namespace": context.namespace}
        dump = self.dump_ops is not None and _matches(self.dump_ops, context)
        context.insert_after_op(self._collect, info=info, dump=dump)

    def _collect(self, *outputs, info, dump):
        for index, value in enumerate(outputs):
            stats = tensor_stats(value)
            if stats is None:
                continue
            key = (info["op_id"], index)
            entry = self._stats.get(key)
            if entry is None:
                entry = self._stats[key] = dict(info, output=index, calls=0, _mean=0.0,
                                                _std=0.0, _sparsity=0.0, min=None, max=None,
                                                nan=0, inf=0)
            entry["calls"] += 1
            entry["_mean"] += stats["mean"] or 0.0
            entry["_std"] += stats["std"] or 0.0
            entry["_sparsity"] += stats["sparsity"]
            if stats["min"] is not None:
                entry["min"] = stats["min"] if entry["min"] is None else min(entry["min"], stats["min"])
                entry["max"] = stats["max"] if entry["max"] is None else max(entry["max"], stats["max"])
            entry["nan"] += stats["nan"]
            entry["inf"] += stats["inf"]
            entry["last"] = stats
            if dump:
                self._dumps[key] = _to_numpy(value)
        return None

    def report(self):
        """One dict per (op id, output), in first-execution order: ``op_id``,
        ``op_name``, ``module_path``, ``namespace``, ``output``, ``calls``,
        ``mean``, ``std``, ``sparsity`` (averaged over calls), ``min``, ``max``,
        ``nan``, ``inf`` (totals) and ``last`` (the last call's statistics)."""
        result = []
        for entry in self._stats.values():
            calls = entry["calls"]
            row = {k: v for k, v in entry.items() if not k.startswith("_")}
            row.update(mean=entry["_mean"] / calls, std=entry["_std"] / calls,
                       sparsity=entry["_sparsity"] / calls)
            result.append(row)
        return result

    def npz_key(self, op_id, output=0):
        """The key of an op's output in :meth:`to_npz`'s file."""
        return re.sub(r"[^0-9A-Za-z_.-]", "_", str(op_id)) + f"__{output}"

    def dumped(self):
        """The kept last outputs, by ``(op_id, output)``."""
        return dict(self._dumps)

    def to_npz(self, path):
        """Write the ``dump_ops`` ops' last outputs to ``path`` (``np.savez``),
        keyed by :meth:`npz_key`. Returns the list of keys written."""
        arrays = {self.npz_key(op_id, out): value for (op_id, out), value in self._dumps.items()}
        np.savez(path, **arrays)
        return list(arrays)

    def reset(self):
        self._stats.clear()
        self._dumps.clear()
