"""The `Graph`: ops in program order over SSA tensors, with an insertion cursor."""

from ._core import Op, Tensor, _check_tensor_of
from ._names import NameTable
from ._order import OpOrder
from .errors import IRError


class Graph:
    """A dataflow graph of `Op` nodes connected by `Tensor` values.

    Ops are kept in an order that is expected to be topological: `verify` checks
    that each tensor is defined before it is used. The order is a linked list, so
    creating an op at the cursor and removing an op cost O(1) wherever they happen.
    Iterating over a graph walks a snapshot of the order, so ops may be inserted or
    removed while iterating: ops inserted during the walk are not visited, and ops
    removed before the walk reaches them are skipped.

    Attributes:
        name: The graph's name (not part of its structural hash).
        namespace: The default namespace of ops created without one.
        attrs: Free-form metadata dict, serialized and hashed like op attrs.
    """

    __slots__ = (
        "name",
        "namespace",
        "attrs",
        "_inputs",
        "_outputs",
        "_order",
        "_op_names",
        "_tensor_names",
        "_cursor",
        "__weakref__",
    )

    def __init__(self, name="graph", namespace="", attrs=None):
        """Creates an empty graph.

        Args:
            name: The graph's name.
            namespace: Default namespace for `create_op`.
            attrs: Initial graph attributes (the dict is used as given).
        """
        self.name = name
        self.namespace = namespace
        self.attrs = {} if attrs is None else attrs
        self._inputs = ()
        self._outputs = ()
        self._order = OpOrder()
        self._op_names = NameTable()
        self._tensor_names = NameTable()
        self._cursor = None  # None appends; else an _InsertionPoint

    # -- read access ---------------------------------------------------------

    @property
    def inputs(self):
        """The graph inputs, a tuple of tensors without producer."""
        return self._inputs

    @property
    def outputs(self):
        """The tensors the graph returns, a tuple; change with `set_outputs`."""
        return self._outputs

    @property
    def ops(self):
        """A new list of the ops in order; editing the list does not edit the graph."""
        return list(self._order.snapshot())

    @property
    def _ops(self):
        # Read-only view kept for code written against the former list field;
        # use `ops` or iterate over the graph instead.
        return self._order.snapshot()

    def prev_op(self, op):
        """Returns the op just before ``op`` in order, or None if ``op`` is first.

        Raises:
            IRError: ``op`` is not in this graph's op order.
        """
        self._check_ordered(op)
        return self._order.prev_of(op)

    def next_op(self, op):
        """Returns the op just after ``op`` in order, or None if ``op`` is last.

        Raises:
            IRError: ``op`` is not in this graph's op order.
        """
        self._check_ordered(op)
        return self._order.next_of(op)

    def __iter__(self):
        for op in self._order.snapshot():
            if op._graph is self:
                yield op

    def __len__(self):
        return len(self._order)

    def __bool__(self):
        # A graph with no ops is still a graph: keep ``graph or default`` and
        # ``if attrs.get("body"):`` from treating an empty body as missing.
        return True

    def __contains__(self, op):
        return isinstance(op, Op) and op._graph is self

    def find(self, type=None, namespace=None):
        """Iterates over the ops matching a type and/or a namespace.

        Iterates over a snapshot, like ``iter(graph)``.

        Args:
            type: Keep only ops of this type (any if None).
            namespace: Keep only ops whose namespace is this one or lies below it
                (``"pytorch"`` matches ``"pytorch/2.13.0/eager"``); any if None.

        Returns:
            An iterator of ops.
        """
        for op in self:
            if type is not None and op.type != type:
                continue
            if namespace is not None and not _namespace_matches(op.namespace, namespace):
                continue
            yield op

    # -- building ------------------------------------------------------------

    def add_input(self, name=None, **attrs):
        """Appends a graph input.

        Args:
            name: Requested name; made unique with a ``_<k>`` suffix if taken, and
                numbered automatically if None.
            **attrs: Initial tensor attrs such as ``shape`` or ``dtype``.

        Returns:
            The new input tensor.
        """
        return self._add_input(name, attrs)

    def set_outputs(self, tensors):
        """Sets the tensors the graph returns.

        Args:
            tensors: An iterable of tensors of this graph.

        Raises:
            IRError: A tensor belongs to another graph; outputs are left unchanged.
        """
        tensors = tuple(tensors)
        for position, tensor in enumerate(tensors):
            _check_tensor_of(self, tensor, f"graph output {position}")
        self._outputs = tensors

    def create_op(
        self,
        type,
        inputs=(),
        num_outputs=1,
        attrs=None,
        namespace=None,
        name=None,
        control_inputs=(),
        output_names=None,
    ):
        """Creates an op at the insertion cursor (the end unless moved).

        Args:
            type: The op type, any string.
            inputs: Tensors of this graph the op reads.
            num_outputs: How many output tensors to create.
            attrs: The op's attrs dict (used as given, not copied).
            namespace: The op's namespace; the graph's namespace if None.
            name: Requested op name; the type if None. Made unique with a
                ``_<k>`` suffix if taken.
            control_inputs: Ops of this graph that must run first.
            output_names: Requested output tensor names (numbered if None).

        Returns:
            The new `Op`.

        Raises:
            IRError: An input or control input is not of this graph, or
                ``output_names`` does not have ``num_outputs`` entries. Nothing is
                created.
        """
        inputs, control_inputs = tuple(inputs), tuple(control_inputs)
        self._check_new_op(type, inputs, num_outputs, control_inputs, name, output_names)
        self._check_cursor()  # may refuse, so before anything changes
        op = Op(self, type, self.namespace if namespace is None else namespace, {} if attrs is None else attrs, None)
        op._name = self._op_names.claim(op, type if name is None else name)
        # written out rather than through _new_tensor: lifting and lowering
        # create every op of a graph here
        claim, outputs = self._tensor_names.claim, []
        names = [None] * num_outputs if output_names is None else list(output_names)
        for i in range(num_outputs):
            tensor = Tensor(self, op, i, None, {})
            tensor._name = claim(tensor, names[i])
            outputs.append(tensor)
        op._outputs = tuple(outputs)
        op._attach_inputs(inputs)
        if control_inputs:
            op._attach_control_inputs(control_inputs)
        self._insert(op)
        return op

    def inserting_before(self, op):
        """Within the block, `create_op` inserts ops just before ``op``, in order.

        Args:
            op: An op of this graph.

        Raises:
            IRError: ``op`` is not an op of this graph.
        """
        return _MovedCursor(self, op, after=False)

    def inserting_after(self, op):
        """Within the block, `create_op` inserts ops after ``op``, in order.

        Each new op goes after the previous one, so a block creating ``a`` then
        ``b`` yields ``op, a, b``. Blocks nest: leaving an inner block restores the
        enclosing block's cursor, which resumes after the last op it inserted.

        Args:
            op: An op of this graph.

        Raises:
            IRError: ``op`` is not an op of this graph.
        """
        return _MovedCursor(self, op, after=True)

    # -- removing and replacing ----------------------------------------------

    def remove_op(self, op):
        """Removes an op whose outputs are no longer needed.

        Everything is validated before anything changes, so a refused removal
        leaves the graph as it was. The removed op is detached: its `graph` is None
        and its inputs are dropped.

        Args:
            op: An op of this graph.

        Raises:
            IRError: ``op`` is not in this graph, an output still has uses or is a
                graph output, or another op lists it as a control input.
        """
        self._check_removable(op)
        op._drop_input_uses()
        op._drop_control_inputs()
        self._order.remove(op)
        self._op_names.release(op._name, op)
        for tensor in op._outputs:
            self._tensor_names.release(tensor._name, tensor)
            tensor._graph = None
        op._graph = None

    def replace_op(self, old_op, new_outputs):
        """Rewires every use of ``old_op``'s outputs, then removes it.

        Output ``i`` of ``old_op`` is replaced by ``new_outputs[i]``, in op inputs
        and in graph outputs. The new tensors must be defined before the first user
        of the old ones (create them inside ``inserting_before(old_op)``); `verify`
        reports it otherwise.

        Args:
            old_op: An op of this graph.
            new_outputs: A sequence of tensors of this graph, one per output.

        Raises:
            IRError: The counts differ, a tensor is foreign or an output of
                ``old_op``, a new tensor is produced by a user of ``old_op``, or
                ``old_op`` has control users. The graph is left unchanged.
        """
        new_outputs = tuple(new_outputs)
        self._check_replacement(old_op, new_outputs)
        for old, new in zip(old_op._outputs, new_outputs):
            old.replace_all_uses_with(new)
        self.remove_op(old_op)

    # -- whole-graph services ------------------------------------------------

    def verify(self):
        """Checks the IR invariants, including those of nested graphs in attrs.

        Raises:
            VerificationError: An invariant is broken. The message names the
                graph and op and shows a window of ops around the fault.
        """
        from .verifier import verify_graph  # imported late: it imports this module

        verify_graph(self)

    def copy(self):
        """Returns a deep copy of the structure.

        Ops and tensors are new objects with the same names; attrs dicts are
        shallow copies, except that `Graph` values inside them are copied too,
        since they are structure rather than data.
        """
        from .serialization import copy_graph

        return copy_graph(self)

    def structural_hash(self):
        """Returns the graph's name-independent structural hash (a hex str)."""
        from .hashing import structural_hash

        return structural_hash(self)

    def to_json(self):
        """Returns the graph as a JSON-able dict; see `graph_to_json`."""
        from .serialization import graph_to_json

        return graph_to_json(self)

    @classmethod
    def from_json(cls, data):
        """Builds a graph from `to_json` output; see `graph_from_json`."""
        from .serialization import graph_from_json

        return graph_from_json(data)

    def __str__(self):
        from .printer import format_graph

        return format_graph(self)

    def __repr__(self):
        return f"<Graph {self.name!r}: {len(self._inputs)} inputs, {len(self._order)} ops, {len(self._outputs)} outputs>"

    # -- internals -------------------------------------------------------------

    def _add_input(self, name, attrs):
        tensor = self._new_tensor(None, len(self._inputs), name, attrs)
        self._inputs = self._inputs + (tensor,)
        return tensor

    def _new_tensor(self, producer, index, name, attrs):
        tensor = Tensor(self, producer, index, None, attrs)
        tensor._name = self._tensor_names.claim(tensor, name)
        return tensor

    def _check_new_op(self, op_type, inputs, num_outputs, control_inputs, name, output_names):
        if not isinstance(op_type, str):
            raise IRError(f"op type must be a str, got {op_type!r}")
        if name is not None and not isinstance(name, str):
            raise IRError(f"names must be str, got {name!r}")
        for requested in output_names or ():
            if requested is not None and not isinstance(requested, str):
                raise IRError(f"names must be str, got {requested!r}")
        if not isinstance(num_outputs, int) or num_outputs < 0:
            raise IRError(f"num_outputs must be a non-negative int, got {num_outputs!r}")
        if output_names is not None and len(output_names) != num_outputs:
            raise IRError(f"{len(output_names)} output names given for {num_outputs} outputs")
        for position, tensor in enumerate(inputs):
            # (the role is formatted only for a tensor that fails the check)
            if type(tensor) is not Tensor or tensor._graph is not self:
                _check_tensor_of(self, tensor, f"input {position} of new {op_type!r} op")
        for op in control_inputs:
            if not isinstance(op, Op) or op._graph is not self:
                raise IRError(f"control input {op!r} of new {op_type!r} op is not an op of this graph")

    def _check_cursor(self):
        cursor = self._cursor
        if cursor is not None and cursor.anchor._graph is not self:
            raise IRError(f"insertion point op {cursor.anchor.name!r} is no longer in graph {self.name!r}")

    def _insert(self, op):
        cursor = self._cursor
        if cursor is None:
            self._order.append(op)
        elif cursor.after:
            self._order.insert_after(cursor.anchor, op)
            cursor.anchor = op  # the next op goes after this one, keeping order
        else:
            self._order.insert_before(cursor.anchor, op)

    def _check_ordered(self, op):
        if not isinstance(op, Op) or op not in self._order:
            raise IRError(f"{op!r} is not an op of graph {self.name!r}")


    def _check_removable(self, op):
        if not isinstance(op, Op) or op._graph is not self:
            raise IRError(f"cannot remove {op!r}: not an op of graph {self.name!r}")
        for tensor in op._outputs:
            if tensor._uses:
                user, position = next(iter(tensor._uses))
                raise IRError(
                    f"cannot remove op {op.name!r}: output %{tensor.name} is still used by "
                    f"op {user.name!r} (input {position})"
                )
            if tensor.is_graph_output:
                raise IRError(f"cannot remove op {op.name!r}: output %{tensor.name} is a graph output")
        if op._control_users:
            user = next(iter(op._control_users))
            raise IRError(f"cannot remove op {op.name!r}: op {user.name!r} lists it as a control input")

    def _check_replacement(self, old_op, new_outputs):
        if not isinstance(old_op, Op) or old_op._graph is not self:
            raise IRError(f"cannot replace {old_op!r}: not an op of graph {self.name!r}")
        if len(new_outputs) != len(old_op._outputs):
            raise IRError(
                f"op {old_op.name!r} has {len(old_op._outputs)} outputs but "
                f"{len(new_outputs)} replacements were given"
            )
        users = set(old_op.users)
        for i, tensor in enumerate(new_outputs):
            _check_tensor_of(self, tensor, f"replacement {i} for op {old_op.name!r}")
            if tensor._producer is old_op:
                raise IRError(f"replacement {i} for op {old_op.name!r} is one of its own outputs")
            if tensor._producer in users:
                raise IRError(
                    f"replacement {i} for op {old_op.name!r} is produced by its user "
                    f"{tensor._producer.name!r}, which would create a cycle"
                )
        if old_op._control_users:
            user = next(iter(old_op._control_users))
            raise IRError(f"cannot replace op {old_op.name!r}: op {user.name!r} lists it as a control input")


class _MovedCursor:
    """What `Graph.inserting_before` and `Graph.inserting_after` return: a
    context manager that moves the graph's cursor on entry and restores the
    enclosing one on exit. A small class rather than a generator-based
    context manager: lowering enters one for every routine op it creates."""

    __slots__ = ("_graph", "_anchor", "_after", "_saved")

    def __init__(self, graph, anchor, after):
        self._graph = graph
        self._anchor = anchor
        self._after = after
        self._saved = None

    def __enter__(self):
        graph, op = self._graph, self._anchor
        if not isinstance(op, Op) or op._graph is not graph:
            raise IRError(f"insertion point {op!r} is not an op of graph {graph.name!r}")
        self._saved = graph._cursor
        graph._cursor = _InsertionPoint(op, self._after)

    def __exit__(self, *exc_info):
        self._graph._cursor = self._saved
        return False


class _InsertionPoint:
    """Where `Graph.create_op` puts the next op: before or after ``anchor``."""

    __slots__ = ("anchor", "after")

    def __init__(self, anchor, after):
        self.anchor = anchor
        self.after = after


def _namespace_matches(namespace, prefix):
    """Whether ``namespace`` equals ``prefix`` or lies below it, by path segment."""
    return namespace == prefix or namespace.startswith(prefix.rstrip("/") + "/")
