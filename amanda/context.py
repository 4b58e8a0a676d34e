"""The instrumentation context handed to analysis routines.

An :class:`OpContext` is a ``dict`` (tools share state through its keys) plus
inspection methods for the op at hand and the verbs that record *actions*.
Actions are replayed by the backend runtime each time the op executes.
"""

from __future__ import annotations

from amanda import controls
from amanda.errors import ToolError
from amanda.runtime.observation import hosting

# Action kinds. Forward kinds are recorded from forward contexts, backward kinds
# from backward contexts.
BEFORE_OP = "before_op"
AFTER_OP = "after_op"
REPLACE_OP = "replace_op"
BEFORE_BACKWARD = "before_backward_op"
AFTER_BACKWARD = "after_backward_op"
REPLACE_BACKWARD = "replace_backward_op"

FORWARD_KINDS = (BEFORE_OP, AFTER_OP, REPLACE_OP)
BACKWARD_KINDS = (BEFORE_BACKWARD, AFTER_BACKWARD, REPLACE_BACKWARD)


class Action:
    """One recorded instrumentation action.

    Attributes:
        kind: one of the kind constants of this module.
        func: the instrumentation routine.
        positions: tuple of selected tensor positions, or None for all.
        kwargs: extra keyword arguments passed to ``func``.
        ad: whether the routine is differentiated (``amanda.ad_enabled``).
        tool: the tool whose analysis routine recorded the action.
        in_run: recorded inside ``hosted_observation()``: an observe-only
            routine of a graph backend runs inside the run, next to its op,
            never after it (a routine whose timing matters, e.g. a timer).
    """

    __slots__ = ("kind", "func", "positions", "kwargs", "ad", "tool", "in_run", "__weakref__")

    def __init__(self, kind, func, positions, kwargs, ad, tool, in_run=False):
        self.kind = kind
        self.func = func
        self.positions = positions
        self.kwargs = kwargs
        self.ad = ad
        self.tool = tool
        self.in_run = in_run

    def __repr__(self):
        name = getattr(self.func, "__qualname__", repr(self.func))
        return f"Action({self.kind}, {name}, positions={self.positions})"


_NOT_AVAILABLE = object()


class Deferred:
    """Values a backend makes only when a routine asks for them: given to
    `OpContext._set_values`, ``make()`` is called on the first
    ``get_inputs()`` (& co.) of that point and its result kept. A backend
    whose values cost something to make (ONNX builds a ``ValueInfoProto``
    per tensor) spends nothing for tools that never read them."""

    __slots__ = ("make",)

    def __init__(self, make):
        self.make = make

# Names accepted by OpContext._set_values -> the slot each one fills.
_VALUE_SLOTS = {"inputs": "_inputs", "outputs": "_outputs",
                "grad_outputs": "_grad_outputs", "grad_inputs": "_grad_inputs"}


class OpContext(dict):
    """Context of one op (or one backward op) for analysis routines.

    Backends fill the private slots; tools only use the methods. Values that a
    routine could not see at its instrumentation point (e.g. outputs in a
    routine registered with ``require_outputs=False``) raise a clear error.
    """

    __slots__ = ("namespace", "_op", "_op_id", "_op_name", "_inputs", "_outputs",
                 "_backward_op", "_backward_op_id", "_grad_outputs", "_grad_inputs",
                 "_is_backward", "_actions", "_ir_op", "_graph", "_module_path",
                 "_tool", "_routine", "_recording", "_recomputation")

    def __init__(self, namespace, op, op_id, op_name, *, backward_op=None,
                 backward_op_id=None, module_path=None, parent=None):
        super().__init__(parent or ())
        self.namespace = namespace
        self._op = op
        self._op_id = op_id
        self._op_name = op_name
        self._backward_op = backward_op
        self._backward_op_id = backward_op_id
        self._is_backward = backward_op_id is not None
        self._module_path = module_path
        self._inputs = self._outputs = _NOT_AVAILABLE
        self._grad_outputs = self._grad_inputs = _NOT_AVAILABLE
        self._actions = []
        self._ir_op = None
        self._graph = None
        self._tool = None
        self._routine = None
        self._recording = False
        self._recomputation = False

    # -- inspection --------------------------------------------------------
    def get_op(self):
        """The backend's op: a torch callable, a ``tf.Operation``, an
        ``onnx.NodeProto``. In a backward context, the forward op that owns the
        backward op."""
        return self._op

    def get_op_id(self):
        """Stable id of the (forward) op: the same op gets the same id in every
        iteration."""
        return self._op_id

    def get_op_name(self):
        """The op's type name in its backend (``conv2d``, ``Conv2D``, ``Conv``)."""
        return self._op_name

    def get_backward_op(self):
        """The backend's backward op, or None in a forward context."""
        return self._backward_op

    def get_backward_op_id(self):
        """Stable id of the backward op, or None in a forward context."""
        return self._backward_op_id

    def get_inputs(self):
        """The forward op's input tensors (forward contexts)."""
        return self._available("_inputs", "inputs")

    def get_outputs(self):
        """The forward op's outputs; needs ``require_outputs=True``."""
        return self._available("_outputs", "outputs")

    def get_grad_outputs(self):
        """Gradients w.r.t. the forward op's outputs (the backward op's inputs)."""
        return self._available("_grad_outputs", "grad_outputs")

    def get_grad_inputs(self):
        """Gradients w.r.t. the forward op's inputs (the backward op's outputs);
        needs ``require_outputs=True``."""
        return self._available("_grad_inputs", "grad_inputs")

    def is_forward(self):
        return not self._is_backward

    def is_backward(self):
        return self._is_backward

    def is_recomputation(self):
        """Whether this execution of a forward op recomputes an earlier one
        (activation checkpointing recomputes forward ops during backward).
        A recomputed op has the id of its first execution and replays its
        actions, so values stay those of the forward pass."""
        return self._recomputation

    def get_module_path(self):
        """Where the op sits in the model, on every backend.

        PyTorch: the dotted path of the innermost module running the op
        (``""`` for the root module). TensorFlow: the op's name scope
        (``"dense_1"`` for ``"dense_1/MatMul"``). ONNX: the module path a
        PyTorch exporter encoded in the node name. None outside any module.
        The rule is the backend's (:mod:`amanda.runtime.tool_support`).
        """
        if self._module_path is not None:   # recorded by the runtime
            return self._module_path
        from amanda.runtime.tool_support import module_path_from_op
        return module_path_from_op(self)

    def get_ir_op(self):
        """The op lifted into the amanda IR, where a graph is being traced."""
        return self._ir_op

    def get_graph(self):
        """The amanda IR graph the op belongs to, where one is being traced."""
        return self._graph

    # -- backend side -------------------------------------------------------
    # Frontends, passes and runtimes fill a context through these methods rather
    # than by writing its slots, so the slots can change without touching them.

    def _set_values(self, **values):
        """Sets what ``get_inputs()`` & co. return (backends only).

        Args:
            **values: any of ``inputs``, ``outputs``, ``grad_outputs`` and
                ``grad_inputs``; None hides values the routines may no longer
                use (the context outlives the point it was made for); a
                `Deferred` makes them on first use.

        Raises:
            TypeError: an unknown name.
        """
        for name, value in values.items():
            slot = _VALUE_SLOTS.get(name)
            if slot is None:
                raise TypeError(f"OpContext has no values named {name!r}; "
                                f"expected one of {', '.join(_VALUE_SLOTS)}")
            setattr(self, slot, value)

    def _forget_values(self):
        """Drops every tensor the context holds, so it keeps none alive."""
        self._inputs = self._outputs = None
        self._grad_outputs = self._grad_inputs = None

    def _set_ir(self, op, graph):
        """Records the IR op and graph the context is about (backends only)."""
        self._ir_op, self._graph = op, graph

    def _set_graph(self, graph):
        """Records the IR graph a trace is building while the op runs (backends only)."""
        self._graph = graph

    def _set_recomputation(self, flag):
        """Whether this execution recomputes a checkpointed segment (backends only)."""
        self._recomputation = flag

    def _recording_for(self, tool, routine):
        """Analysis by ``routine`` of ``tool`` starts: actions may be recorded
        and errors name them (the tool session only)."""
        self._recording = True
        self._tool, self._routine = tool, routine

    def _stop_recording(self):
        """Analysis is over: a context kept and used later raises instead of
        dropping what it records."""
        self._recording = False

    def _available(self, slot, what):
        value = getattr(self, slot)
        if type(value) is Deferred:
            value = value.make()
            setattr(self, slot, value)
        if value is _NOT_AVAILABLE:
            hint = ("register the routine with require_outputs=True"
                    if what in ("outputs", "grad_inputs") else
                    "it is only available in the matching forward/backward context")
            raise self._error(f"{what} are not available at this point: {hint}")
        return value

    # -- instrumentation ---------------------------------------------------
    def insert_before_op(self, func, inputs=None, **kwargs):
        """Run ``func`` on the selected inputs before the op executes.

        Args:
            func: the instrumentation routine; receives the selected tensors
                positionally plus ``kwargs``; returns None to observe, or a
                tensor / a sequence of tensors to replace them.
            inputs: positions of the input tensors to pass (None: all).
            **kwargs: passed to ``func`` on every call.
        """
        self._record(BEFORE_OP, func, inputs, kwargs)

    def insert_after_op(self, func, outputs=None, **kwargs):
        """Run ``func`` on the selected outputs after the op executes."""
        self._record(AFTER_OP, func, outputs, kwargs)

    def replace_op(self, func, inputs=None, **kwargs):
        """Execute ``func`` on the selected inputs instead of the op; its return
        value becomes the op's outputs."""
        self._record(REPLACE_OP, func, inputs, kwargs)

    def insert_before_backward_op(self, func, grad_outputs=None, **kwargs):
        """Run ``func`` on the selected gradients before the backward op."""
        self._record(BEFORE_BACKWARD, func, grad_outputs, kwargs)

    def insert_after_backward_op(self, func, grad_inputs=None, **kwargs):
        """Run ``func`` on the selected gradients the backward op produced."""
        self._record(AFTER_BACKWARD, func, grad_inputs, kwargs)

    def replace_backward_op(self, func, grad_outputs=None, **kwargs):
        """Compute the backward op's results with ``func`` from the selected
        incoming gradients."""
        self._record(REPLACE_BACKWARD, func, grad_outputs, kwargs)

    def _record(self, kind, func, positions, kwargs):
        if not self._recording:
            raise self._error(f"{kind}: actions can only be recorded while an analysis "
                              "routine runs on this context; this context's analysis is over "
                              "(was it kept and used later?)")
        if not callable(func):
            raise self._error(f"{kind}: the instrumentation routine must be callable, got {func!r}")
        allowed = BACKWARD_KINDS if self._is_backward else FORWARD_KINDS
        if kind not in allowed:
            side = "a backward" if self._is_backward else "a forward"
            raise self._error(f"{kind} cannot be recorded from {side} context; "
                              f"allowed here: {', '.join(allowed)}")
        if positions is not None:
            positions = _normalise_positions(positions, self, kind)
        self._actions.append(Action(kind, func, positions, kwargs,
                                    controls.state.ad, self._tool, hosting()))

    def _error(self, message):
        return ToolError(message, tool=self._tool, routine=self._routine,
                         op_name=self._op_name, op_id=self._op_id,
                         namespace=self.namespace)

    def __repr__(self):
        side = "backward" if self._is_backward else "forward"
        return (f"<OpContext {side} op={self._op_name!r} id={self._op_id}"
                f" ns={self.namespace!r} keys={sorted(map(str, self))}>")


def _normalise_positions(positions, context, kind):
    if isinstance(positions, int):
        positions = [positions]
    try:
        result = tuple(positions)
    except TypeError:
        raise context._error(f"{kind}: positions must be an int or a sequence of ints, "
                             f"got {positions!r}") from None
    for p in result:
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            raise context._error(f"{kind}: positions must be non-negative ints, got {positions!r}")
    return result


_BEFORE_KINDS = (BEFORE_OP, BEFORE_BACKWARD)
_AFTER_KINDS = (AFTER_OP, AFTER_BACKWARD)


def take_actions(context, target):
    """Move the actions analysis routines recorded on ``context`` into
    ``target.before``, ``target.after`` and ``target.replace`` (the runtime's
    record of the op), in recording order.

    Raises:
        ToolError: more than one routine replaces the op.
    """
    for action in context._actions:
        if action.kind in _BEFORE_KINDS:
            target.before.append(action)
        elif action.kind in _AFTER_KINDS:
            target.after.append(action)
        else:
            target.replace.append(action)
    context._actions = []
    if len(target.replace) > 1:
        last = target.replace[-1]
        tools = ", ".join(type(a.tool).__name__ for a in target.replace)
        raise ToolError(f"more than one routine replaces this op ({tools})", tool=last.tool,
                        routine=last.func, op_name=context._op_name, op_id=context._op_id,
                        namespace=context.namespace)
