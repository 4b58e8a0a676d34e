"""Instrumentation-point coverage: amanda's op-level points vs module hooks.

The paper's Fig. 9 counts the forward and backward instrumentation points
amanda offers on a model and those PyTorch module hooks offer. amanda has a
point at every op call (``torch.*``, ``F.*``, Tensor methods and operators) and
at every autograd node an op creates, gradient accumulators included. Module
hooks only see module boundaries: ops called functionally inside a module's
``forward`` (the residual ``+``, attention's ``matmul``/``softmax``, a
``reshape``) have no hook of their own.

* :class:`CoverageTool` counts amanda's points by op name (public API only).
* :func:`module_hook_coverage` counts what module hooks see on the same step.
* :func:`compare_coverage` runs both on a model spec of :mod:`amanda.models`.

Example::

    from amanda.tools.coverage import compare_coverage
    report = compare_coverage("cnn")
    report["amanda_forward"], report["hooks_forward"]     # 11, 10
"""

from __future__ import annotations

import collections
import contextlib
import warnings

import amanda

OUTSIDE = "outside_model"


class CoverageTool(amanda.Tool):
    """Count forward and backward instrumentation points by op name.

    Points are counted by analysis routines, which amanda runs once per point
    (at its first execution; later executions replay cached actions): apply
    the tool over one step to count the points of that step.

    Attributes:
        forward: forward op name (``conv2d``, ``add``) -> points.
        backward: autograd node name (``ConvolutionBackward0``,
            ``AccumulateGrad``) -> points.
        forward_by_module: ``(module path, op name)`` -> forward points; the
            path is the innermost module running the op (``""`` the root
            module, None outside any module).
    """

    def __init__(self):
        super().__init__()
        self.forward = collections.Counter()
        self.backward = collections.Counter()
        self.forward_by_module = collections.Counter()
        self.add_inst_for_op(self.forward_analysis)
        self.add_inst_for_op(self.backward_analysis, backward=True)

    @property
    def forward_points(self):
        return sum(self.forward.values())

    @property
    def backward_points(self):
        return sum(self.backward.values())

    def forward_analysis(self, context):
        name = context.get_op_name()
        self.forward[name] += 1
        self.forward_by_module[(context.get_module_path(), name)] += 1

    def backward_analysis(self, context):
        self.backward[context.get_backward_op().__name__] += 1


# -- module hooks ----------------------------------------------------------------------

@contextlib.contextmanager
def _hooked(model, register, make_hook):
    """Register ``make_hook(path, module)`` with ``module.<register>`` on every
    module of ``model``; remove them all on exit."""
    handles = []
    try:
        for path, module in model.named_modules():
            handles.append(getattr(module, register)(make_hook(path, module)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _count_calls(model, step, register):
    """Run ``step`` with a counting hook registered by ``register`` on every
    module. Returns (calls by module path, calls by module type, error)."""
    by_path, by_type = collections.Counter(), collections.Counter()

    def make_hook(path, module):
        kind = type(module).__name__

        def hook(*_):
            by_path[path] += 1
            by_type[kind] += 1
        return hook

    try:
        # torch warns about hooks it cannot fire (a root returning a ModelOutput,
        # a first module whose inputs need no gradient): expected here.
        with warnings.catch_warnings(), _hooked(model, register, make_hook):
            warnings.simplefilter("ignore", UserWarning)
            step()
    except Exception as exc:  # reported, not hidden: hooks cannot instrument this model
        return None, None, f"{type(exc).__name__}: {exc}".strip()
    return by_path, by_type, None


def module_hook_coverage(model, step):
    """Count the instrumentation points module hooks offer on one step.

    Three runs of ``step``: forward (pre-)hooks on every module (root included),
    then full backward hooks (``register_full_backward_hook``) on every module,
    then full backward pre-hooks (``register_full_backward_pre_hook``). A kind
    of hook that makes the step raise (e.g. full backward hooks on a module
    whose output is modified in place, as transformers' ResNet-50 does) is
    reported as ``None`` with the error kept; nothing is substituted for it.

    Args:
        model: a ``torch.nn.Module``.
        step: a zero-argument callable running forward, loss and backward of
            ``model`` (e.g. ``workload.run``).

    Returns:
        A dict: ``forward`` (hook calls), ``forward_calls`` (module path ->
        calls), ``forward_by_type`` (module type -> calls), ``backward``,
        ``backward_by_type``, ``backward_error``, ``backward_pre``,
        ``backward_pre_error``, and ``forward_leaf``
        (forward hook calls on modules without children, the only ones that
        can stand for an op).
    """
    forward_calls, forward_by_type, _ = _count_calls(model, step, "register_forward_hook")
    backward_calls, backward_by_type, backward_error = _count_calls(
        model, step, "register_full_backward_hook")
    pre_calls, _, pre_error = _count_calls(model, step, "register_full_backward_pre_hook")
    return {
        "forward": sum(forward_calls.values()),
        "forward_calls": dict(forward_calls),
        "forward_by_type": dict(forward_by_type),
        "backward": None if backward_calls is None else sum(backward_calls.values()),
        "backward_by_type": None if backward_by_type is None else dict(backward_by_type),
        "backward_error": backward_error,
        "backward_pre": None if pre_calls is None else sum(pre_calls.values()),
        "backward_pre_error": pre_error,
        "forward_leaf": sum(forward_calls[path] for path, m in model.named_modules()
                            if not any(m.children())),
    }


# -- which forward points a module hook stands for -----------------------------------------

def classify_forward_points(forward_by_module, model, forward_calls):
    """Split amanda's forward points by what module hooks can do about them.

    An op is attributed to the innermost module running it (its module path
    names a module of ``model.named_modules()``):

    * ``covered``: it runs in a leaf module (no children) that runs exactly
      one op per call (ops / forward hook calls == 1), e.g. ``conv2d`` in
      ``nn.Conv2d``: the module's hook is the op's hook.
    * ``partial``: it runs in a leaf module running several ops per call
      (``nn.RNN``, GPT-2's ``Conv1D``): the hook sees the module's boundary,
      not each op.
    * ``functional``: it runs directly in the ``forward`` of a module with
      children (the residual ``add``, attention's ``matmul``, a ``reshape``):
      no module hook corresponds to it. These are the ops missed by hooks.
    * ``outside_model``: it runs outside any module (the step's loss).
    * ``unresolved``: its module path names no module of ``model`` (present
      only when non-empty).

    Args:
        forward_by_module: ``(module path, op name)`` -> points, as counted by
            :class:`CoverageTool`.
        model: the ``torch.nn.Module`` the points were counted on.
        forward_calls: path in ``model.named_modules()`` -> forward hook calls,
            as returned by :func:`module_hook_coverage`.

    Returns:
        ``{category: {op name: points}}``.
    """
    modules = {path: [(path, m)] for path, m in model.named_modules()}
    ops_in = collections.Counter()
    for (path, _), n in forward_by_module.items():
        ops_in[path] += n
    result = {k: collections.Counter() for k in ("covered", "partial", "functional", OUTSIDE)}
    for (path, name), n in forward_by_module.items():
        if path is None:
            kind = OUTSIDE
        elif path not in modules:
            kind = "unresolved"
        elif all(not any(m.children()) for _, m in modules[path]):
            calls = sum(forward_calls.get(p, 0) for p, _ in modules[path])
            kind = "covered" if ops_in[path] == calls else "partial"
        else:
            kind = "functional"
        result.setdefault(kind, collections.Counter())[name] += n
    return {k: dict(sorted(v.items())) for k, v in result.items()}


def compare_coverage(spec):
    """Count amanda's and module hooks' points on one step of a model.

    Args:
        spec: a model spec of :mod:`amanda.models` (``"bert"``,
            ``"path/to/file.py:factory"``) or a loaded
            :class:`~amanda.models.Workload`.

    Returns:
        A JSON-ready dict:

        * ``model``; ``amanda_forward`` / ``amanda_backward``: amanda's points;
        * ``hooks_forward``: forward hook calls on every module;
          ``hooks_forward_leaf``: those on modules without children;
          ``hooks_backward``: full backward hook calls, None if they fail, the
          error in ``hooks_error``; ``hooks_backward_pre`` /
          ``hooks_backward_pre_error``: the same for full backward pre-hooks;
        * ``amanda_forward_by_op`` / ``amanda_backward_by_op``: amanda's points
          by op name / autograd node name;
        * ``forward_coverage``: points per category of
          :func:`classify_forward_points`; ``missed_by_hooks``: its
          ``functional`` ops by name (op -> points); ``partially_covered``: its
          ``partial`` ops.
    """
    from amanda import models
    work = models.load(spec) if isinstance(spec, str) else spec
    tool = CoverageTool()
    with amanda.apply(tool):
        work.run()
    hooks = module_hook_coverage(work.model, work.run)
    kinds = classify_forward_points(tool.forward_by_module, work.model, hooks["forward_calls"])
    return {
        "model": work.name,
        "amanda_forward": tool.forward_points,
        "amanda_backward": tool.backward_points,
        "hooks_forward": hooks["forward"],
        "hooks_forward_leaf": hooks["forward_leaf"],
        "hooks_backward": hooks["backward"],
        "hooks_error": hooks["backward_error"],
        "hooks_backward_pre": hooks["backward_pre"],
        "hooks_backward_pre_error": hooks["backward_pre_error"],
        "amanda_forward_by_op": dict(tool.forward.most_common()),
        "amanda_backward_by_op": dict(tool.backward.most_common()),
        "hooks_forward_by_type": hooks["forward_by_type"],
        "forward_coverage": {k: sum(v.values()) for k, v in kinds.items()},
        "missed_by_hooks": kinds["functional"],
        "partially_covered": kinds["partial"],
    }
