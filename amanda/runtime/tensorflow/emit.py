"""TensorFlow graph mode: the lowering of an instrumented IR graph into the
copy, op by op, each op created with its final inputs and control edges.

The copy of a user's graph is not imported whole and then rewired: the
user's new ops wait here as ``NodeDef``s (`Emitter.add`) while
`_GraphRewrite._realise` walks the lowered IR in program order. A routine
is built with TensorFlow's public constructors on the copy's tensors (each
op it reads is created first, on demand); a user op is created (with
``tf.Operation.from_node_def`` from its ``NodeDef``, so name, attributes,
device and colocation are the user's) when the IR reaches it or when
something reads it, reading what the IR says: a routine's result where a
routine stands in between, its own inputs elsewhere.

Rule: an op's control edges are all known when it is created, because
whatever must run before an op is built before it (`Emitter.create` asks
the rewrite for them, `_GraphRewrite._waits`):

* the op's before-routines that pass no tensor (not for a fed
  ``Placeholder``, which never runs);
* the last after-routine passing no tensor of every op whose outputs it
  reads (directly or through routines) or that it waits on;
* for a stateful op ordered after a variable read: the hosted routines that
  read that read's value (a ``tf.function`` orders a read before a later
  update; the routine, like the op it instruments, must be done first).

The one edge set after creation is a v1 loop's back edge: a ``Merge`` reads
its ``NextIteration``, which is built after it, from a placeholder standing
in until the ``NextIteration`` exists (`Emitter.stand_in`); TensorFlow's own
``while_loop`` builds its loops the same way, and there is no public way to
close a cycle op by op.
"""

from __future__ import annotations

import tensorflow as tf

from amanda.runtime.tensorflow.bodies import _origin
from amanda.runtime.tensorflow.hosting import _kept_constant
from amanda.runtime.tensorflow.probes import NAMESPACE

_LOOP_BACK = frozenset({"NextIteration", "RefNextIteration"})


def _op_name(text):
    return text.lstrip("^").split(":")[0]


class Emitter:
    """The user's ops not yet in the copy, created on demand.

    Args:
        rewrite: the `_GraphRewrite` building the copy (asked for each op's
            final inputs and control edges).
    """

    def __init__(self, rewrite):
        self.rewrite = rewrite
        self.copy = rewrite.copy
        self.pending = {}     # name -> NodeDef, as in the user's graph (calls redirected)
        self._creating = set()
        self._stand_ins = {}  # user tensor name -> placeholder standing in for it
        # routine callbacks made since the copy last grew: no session has run them
        self.fresh = set()

    def add(self, nodes, versions, library):
        """Queue ``nodes`` (new ops of the user's graph) and bring the
        functions they call into the copy."""
        if library.function or library.gradient:
            part = tf.compat.v1.GraphDef()
            part.versions.CopyFrom(versions)
            part.library.CopyFrom(library)
            with self.copy.as_default():
                tf.import_graph_def(part, name="")
        for node in nodes:
            self.pending[node.name] = node

    def element(self, text):
        """The copy's tensor or op (``"^op"``) for the user's ``text``,
        created first if it is still pending."""
        name = _op_name(text)
        if name in self.pending:
            self.create(name)
        return self.rewrite._copy_element(text)

    def forward(self, text):
        """Like `element`, but a loop's back edge not built yet is read from
        a stand-in (see `stand_in`)."""
        name = _op_name(text)
        if name in self.pending and self._loop_back(name):
            return self.stand_in(text)
        return self.element(text)

    def _loop_back(self, name):
        return self.rewrite.user_graph.get_operation_by_name(name).type in _LOOP_BACK

    def stand_in(self, text):
        """A placeholder for the output ``text`` of a ``NextIteration`` not
        created yet; every op reading it is moved to the real tensor when
        it is (`_close_loops`)."""
        tensor_name = text if ":" in text else f"{text}:0"
        found = self._stand_ins.get(tensor_name)
        if found is None:
            user = self.rewrite.user_graph.get_tensor_by_name(tensor_name)
            with self.copy.as_default():
                found = tf.compat.v1.placeholder(user.dtype.base_dtype, user.shape,
                                                 name="amanda/back_edge")
            self._stand_ins[tensor_name] = found
        return found

    def gate(self, ops):
        """``ops`` as control inputs for ``tf.control_dependencies``: a new
        ``NoOp`` waiting on them (``[]`` for none; ``ops`` themselves if
        they are all in `fresh`). TensorFlow marks every op handed to
        ``tf.control_dependencies`` with an attribute; the user's ops in the
        copy, and ops a session has run, must not change."""
        ops = list(dict.fromkeys(ops))
        if all(op in self.fresh for op in ops):
            # amanda's own callbacks, made in this rewrite: marking them
            # changes nothing anyone ran or reads (a NoOp per routine saved)
            return ops
        with self.copy.name_scope(None):   # (the root scope: called inside "amanda/" too)
            name = self.copy.unique_name("amanda/gate")
        node = tf.compat.v1.NodeDef(name=name, op="NoOp")
        with self.copy._mutation_lock():
            return [tf.Operation.from_node_def(node, self.copy, control_inputs=ops)]

    def is_back_edge(self, tensor):
        """Whether ``tensor`` is a loop's back edge or stands in for one."""
        return tensor.op.type in _LOOP_BACK or any(
            tensor is stand_in for stand_in in self._stand_ins.values())

    def create(self, name):
        """Create the pending op ``name`` in the copy (and, first, what it reads)."""
        node = self.pending.get(name)
        if node is None or name in self._creating:
            return
        self._creating.add(name)
        try:
            self._create(name, node)
        finally:
            self._creating.discard(name)

    def _create(self, name, node):
        data = [text for text in node.input if not text.startswith("^")]
        controls = [text[1:] for text in node.input if text.startswith("^")]
        merge = node.op in ("Merge", "RefMerge")
        inputs = self.rewrite._inputs_of(name, data, self.forward if merge else self.element)
        waits = self.rewrite._waits(name, node, data, controls)
        if name not in self.pending:   # created meanwhile, by a routine it reads
            return
        controls = list(dict.fromkeys([self.element("^" + c) for c in controls] + waits))
        # the user's NodeDef as it is (name, attributes, device); its inputs
        # are the ones given here
        with self.copy._mutation_lock():   # as Graph.create_op: no session runs meanwhile
            tf.Operation.from_node_def(node, self.copy, inputs=inputs, control_inputs=controls,
                                       input_types=[t.dtype for t in inputs])
        del self.pending[name]
        self._close_loops(name)

    def _close_loops(self, name):
        for tensor_name in [t for t in self._stand_ins if _op_name(t) == name]:
            stand_in = self._stand_ins.pop(tensor_name)
            real = self.copy.get_tensor_by_name(tensor_name)
            for consumer in stand_in.consumers():
                for position, tensor in enumerate(consumer.inputs):
                    if tensor is stand_in:
                        consumer._update_input(position, real)   # the loop's back edge

    def finish(self):
        """Create every op still pending (in the user's order)."""
        for name in list(self.pending):
            self.create(name)


def _depends_on(routine, user_op, pending, limit=10000):
    """Whether the IR ``routine`` reads a tensor computed after ``user_op``
    (then ``user_op`` cannot wait on it); also True past ``limit`` ops. Ops
    no longer ``pending`` (created in the copy) are not searched: they
    cannot depend on ``user_op``, which is being created."""
    graph = user_op.graph
    stack = [graph.get_operation_by_name(_origin(t).split(":")[0]) for t in routine.inputs]
    stack = [op for op in stack if op.name in pending]
    seen = set()
    while stack:
        op = stack.pop()
        if op is user_op or len(seen) > limit:
            return True
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(t.op for t in op.inputs if t.op.name in pending)
        stack.extend(c for c in op.control_inputs if c.name in pending)
    return False


def _reads_variable(op):
    return any(t.dtype == tf.resource or t.dtype._is_ref_dtype for t in op.inputs)


class _Standing:
    """What `bare_trigger` reads of an op not created yet: its type, and its
    inputs and control inputs in the copy (created first)."""

    def __init__(self, rewrite, user_op):
        resolve = (rewrite.emitter.forward if user_op.type in ("Merge", "RefMerge")
                   else rewrite.emitter.element)
        self.type = user_op.type
        self.name = user_op.name
        self.inputs = [resolve(t.name) for t in user_op.inputs]
        self.control_inputs = [rewrite.emitter.element("^" + c.name)
                               for c in user_op.control_inputs]


def keep_constant(rewrite, name, position, old, new, routine):
    """An integer constant input (a shape, an axis, a TensorList's
    element shape) that a Python routine sees stays the op's input: TensorFlow reads its value when
    it builds and shape-checks the graph (a `TensorListReserve` fails on
    an element shape it cannot see), which a routine's result would hide.
    The routine still runs before the op (a control input, returned
    here) and sees the value; returning another value is refused when
    the op runs."""
    action = routine.attrs["action"]
    target = rewrite.user_graph.get_operation_by_name(routine.attrs["target"])
    user_op = rewrite.user_graph.get_operation_by_name(name)
    text = _kept_constant(action, (target.type, target.name, NAMESPACE),
                          f"replaced input {position} of {user_op.type} {name!r}, an "
                          "integer constant TensorFlow needs when it builds the graph; "
                          "routines may read such constants but not replace them "
                          "(docs/tensorflow.md)")
    with tf.control_dependencies(rewrite.emitter.gate([old.op])):   # in the op's loop frame
        check = tf.debugging.assert_equal(new, old, message=text, name="amanda/kept_constant")
    # used as a control input: without this TensorFlow logs "Object was
    # never used" into the user's stderr when the copy is collected
    getattr(check, "mark_used", lambda: None)()
    return check
