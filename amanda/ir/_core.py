"""Values and operations of the amanda IR: `Tensor` and `Op`.

The IR owns use-def. An op's inputs are an immutable tuple that changes only through
`Op.replace_input_with`, `Op.set_inputs` and `Tensor.replace_all_uses_with`, and each
of these keeps every tensor's `uses` in step, so callers never patch `uses` by hand.
Ops and tensors are created by a `Graph` (`Graph.create_op`, `Graph.add_input`),
never directly.
"""

from .errors import IRError


class Tensor:
    """An SSA value: produced once (by an op, or as a graph input), used many times.

    Attributes:
        attrs: Free-form metadata such as ``shape`` or ``dtype``. Keep values
            JSON-able (see `Op` for what happens to other values).
    """

    __slots__ = ("_graph", "_producer", "_index", "_name", "_uses", "attrs", "__weakref__")

    def __init__(self, graph, producer, index, name, attrs):
        self._graph = graph
        self._producer = producer
        self._index = index
        self._name = name
        # A dict used as an ordered set of (op, input_position) pairs: removal is
        # O(1) and iteration order follows the order uses were added.
        self._uses = {}
        self.attrs = attrs

    @property
    def producer(self):
        """The `Op` producing this tensor, or None for a graph input."""
        return self._producer

    @property
    def index(self):
        """Position among the producer's outputs, or in `Graph.inputs`."""
        return self._index

    @property
    def graph(self):
        """The owning `Graph`, or None once the producer was removed."""
        return self._graph

    @property
    def uses(self):
        """A tuple of ``(op, input_position)`` pairs reading this tensor.

        Graph outputs are not uses; see `is_graph_output`.
        """
        return tuple(self._uses)

    @property
    def is_graph_output(self):
        """Whether the owning graph returns this tensor."""
        return self._graph is not None and any(t is self for t in self._graph.outputs)

    @property
    def name(self):
        """The tensor's name, unique within its graph; printed as ``%name``."""
        return self._name

    @name.setter
    def name(self, value):
        if self._graph is not None:
            self._graph._tensor_names.rename(self, self._name, value)
        self._name = value

    def replace_all_uses_with(self, other, replace_graph_outputs=True):
        """Makes every op that reads this tensor read ``other`` instead.

        Uses by the op producing ``other`` are left alone, since rewiring them would
        make that op consume its own output; this is what lets a pass insert
        ``y = observe(x)`` and then call ``x.replace_all_uses_with(y)``.

        Args:
            other: A tensor of the same graph.
            replace_graph_outputs: Also replace this tensor in `Graph.outputs`.

        Raises:
            IRError: ``other`` is not a tensor of this tensor's graph.
        """
        _check_tensor_of(self._graph, other, "replacement")
        if other is self:
            return
        for op, position in list(self._uses):
            if op is not other._producer:
                op._rewire(position, other)
        if replace_graph_outputs and self.is_graph_output:
            outputs = [other if t is self else t for t in self._graph.outputs]
            self._graph._outputs = tuple(outputs)

    def __repr__(self):
        from .printer import format_tensor_ref

        where = "input" if self._producer is None else f"output of {self._producer.name!r}"
        return f"<Tensor {format_tensor_ref(self)}: {where} #{self._index}>"


class Op:
    """One operation: ``(namespace, type, attrs)`` applied to input tensors.

    The op set is open: ``type`` is any string and its meaning lives in tables
    keyed by type elsewhere, never in subclasses.

    Attributes:
        type: The op's kind, e.g. ``"conv2d"``.
        namespace: Where the op comes from, ``"<framework>/<version>/<mode>"``,
            e.g. ``"pytorch/2.13.0/eager"``; ``""`` if unknown.
        attrs: Free-form dict. Values that are JSON scalars, str, lists and
            str-keyed dicts (and nested `Graph` objects) serialize and hash
            exactly. Any other value is allowed in memory but is serialized and
            hashed through its ``repr`` under a ``{"$repr": ...}`` marker, so it
            comes back from JSON as an `amanda.ir.attrs.OpaqueAttr`.
    """

    __slots__ = (
        "_graph",
        "type",
        "namespace",
        "attrs",
        "_name",
        "_inputs",
        "_outputs",
        "_control_inputs",
        "_control_users",
        "__weakref__",
    )

    def __init__(self, graph, op_type, namespace, attrs, name):
        self._graph = graph
        self.type = op_type
        self.namespace = namespace
        self.attrs = attrs
        self._name = name
        self._inputs = ()
        self._outputs = ()
        self._control_inputs = ()
        self._control_users = {}  # ordered set of ops listing self as control input

    @property
    def graph(self):
        """The owning `Graph`, or None once removed."""
        return self._graph

    @property
    def name(self):
        """The op's name, unique among the ops of its graph."""
        return self._name

    @name.setter
    def name(self, value):
        if self._graph is not None:
            self._graph._op_names.rename(self, self._name, value)
        self._name = value

    @property
    def inputs(self):
        """The input tensors, an immutable tuple."""
        return self._inputs

    @property
    def outputs(self):
        """The tensors this op produces, a tuple."""
        return self._outputs

    @property
    def control_inputs(self):
        """Ops that must run before this one without passing it a tensor."""
        return self._control_inputs

    @property
    def users(self):
        """The distinct ops reading any output, in order of first use."""
        seen = {}
        for tensor in self._outputs:
            for op, _ in tensor._uses:
                seen[op] = None
        return tuple(seen)

    @property
    def control_users(self):
        """The ops that list this op among their control inputs."""
        return tuple(self._control_users)

    def replace_input_with(self, position, tensor):
        """Makes input ``position`` read ``tensor``.

        Args:
            position: Index into `inputs`; negative indices count from the end.
            tensor: A tensor of this op's graph.

        Raises:
            IRError: The position is out of range, the op was removed, or the
                tensor belongs to another graph.
        """
        self._check_attached()
        if not -len(self._inputs) <= position < len(self._inputs):
            raise IRError(f"op {self._name!r} has no input {position} (it has {len(self._inputs)})")
        _check_tensor_of(self._graph, tensor, f"input {position} of op {self._name!r}")
        self._rewire(position % len(self._inputs), tensor)

    def set_inputs(self, tensors):
        """Replaces all inputs at once; the number of inputs may change.

        Args:
            tensors: An iterable of tensors of this op's graph.

        Raises:
            IRError: The op was removed or a tensor belongs to another graph; the
                op is left unchanged.
        """
        self._check_attached()
        tensors = tuple(tensors)
        for position, tensor in enumerate(tensors):
            _check_tensor_of(self._graph, tensor, f"input {position} of op {self._name!r}")
        self._drop_input_uses()
        self._attach_inputs(tensors)

    def set_control_inputs(self, ops):
        """Replaces the control inputs.

        Args:
            ops: An iterable of ops of this op's graph, other than this op.

        Raises:
            IRError: The op was removed or an entry is not another op of its graph.
        """
        self._check_attached()
        ops = tuple(ops)
        for op in ops:
            if not isinstance(op, Op) or op._graph is not self._graph or op is self:
                raise IRError(f"control input {op!r} of op {self._name!r} is not another op of its graph")
        self._drop_control_inputs()
        self._attach_control_inputs(ops)

    def __repr__(self):
        from .printer import format_op

        return format_op(self)

    # Internal verbs: callers have validated their arguments.

    def _check_attached(self):
        if self._graph is None:
            raise IRError(f"op {self._name!r} was removed from its graph")

    def _rewire(self, position, tensor):
        old = self._inputs[position]
        del old._uses[(self, position)]
        self._inputs = self._inputs[:position] + (tensor,) + self._inputs[position + 1 :]
        tensor._uses[(self, position)] = None

    def _attach_inputs(self, tensors):
        self._inputs = tensors
        for position, tensor in enumerate(tensors):
            tensor._uses[(self, position)] = None

    def _drop_input_uses(self):
        for position, tensor in enumerate(self._inputs):
            tensor._uses.pop((self, position), None)
        self._inputs = ()

    def _attach_control_inputs(self, ops):
        self._control_inputs = ops
        for op in ops:
            op._control_users[self] = None

    def _drop_control_inputs(self):
        for op in self._control_inputs:
            op._control_users.pop(self, None)
        self._control_inputs = ()


def _check_tensor_of(graph, tensor, role):
    """Raises IRError unless ``tensor`` is a live tensor of ``graph``."""
    if not isinstance(tensor, Tensor):
        raise IRError(f"{role} must be a Tensor, got {type(tensor).__name__}")
    if graph is None or tensor._graph is not graph:
        raise IRError(f"{role}: tensor {tensor._name!r} does not belong to this graph")
