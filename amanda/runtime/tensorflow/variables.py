"""TensorFlow graph mode: variable values moved between a user session and
its shadow (`_VariableSync`, `_runs_alone`, `_sync_ops`, `_Writes`).

A sync moves only what changed, and moves it without copying where it
can. Fetches through a session callable alias the variables' buffers, and
TensorFlow copies a resource variable's buffer before any write while
another reference to it is alive (copy-on-write: assigns, optimizer
updates, scatters all do). So

* the arrays kept from the last sync (*snapshots*) tell, by address, which
  user variables kept their values since;
* a resource variable assigned from such an array takes its buffer: the
  user's and the shadow's variable share one buffer (no second copy of the
  model) until one of them writes it, which copies it first;
* the shadow's own writes are known from the ops its runs can execute
  (`_Writes`), so only those go back.

Reference variables (``VariableV2``) are written in place: they always move,
as copies.
"""

from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from amanda.runtime.tensorflow.probes import _original_run

_VARIABLE_OPS = ("VarHandleOp", "VariableV2", "Variable")
# consumers of a variable's handle or reference that never write it
_READ_ONLY = frozenset(("ReadVariableOp", "VarIsInitializedOp", "VariableShape", "ResourceGather",
                        "ResourceGatherNd", "IsVariableInitialized", "Identity"))
ALL = None   # "every variable may have been written"


class _Callables:
    """Session callables (``CallableOptions``: no op added to any graph),
    made once per (feeds, fetches, targets) and released with this object.
    Their fetches alias TensorFlow's buffers instead of copying them."""

    def __init__(self):
        self._made = {}

    def run(self, session, fetches=(), feeds=(), values=(), targets=()):
        key = (id(session), tuple(t.name for t in feeds), tuple(t.name for t in fetches),
               tuple(op.name for op in targets))
        made = self._made.get(key)
        if made is None:
            if len(self._made) >= 32:   # subsets moved vary; graphs grow: keep a few
                self._made.clear()
            options = config_pb2.CallableOptions()
            options.feed.extend(key[1])
            options.fetch.extend(key[2])
            options.target.extend(key[3])
            made = self._made[key] = session._make_callable_from_options(options)
        return made(*values)

    def clear(self):
        self._made.clear()


def _address(array):
    return array.__array_interface__["data"][0]


_SMALL = 1 << 16   # bytes: a value this small is kept as a copy and compared


def _snapshot(value, read):
    """What is kept of a user variable's value after a sync: the aliased
    buffer of a resource variable (written only after TensorFlow copied it
    away while this reference lives), else a copy of a small value, else
    nothing (reference variables are written in place: always moved)."""
    if _is_resource(read) and value.base is not None:
        value.flags.writeable = False
        return ("buffer", value)
    if value.nbytes <= _SMALL and value.dtype != object:
        return ("bytes", value.copy())
    return None


def _is_resource(read):
    return read.op.type == "ReadVariableOp"


def _unchanged(kept, value):
    kind, kept = kept
    if kept.shape != value.shape or kept.dtype != value.dtype:
        return False
    if kind == "buffer":
        return _address(kept) == _address(value)
    return kept.tobytes() == value.tobytes()


class _VariableSync:
    """Copies variable values between a user session and its shadow.

    The user side uses only the user graph's existing read and initializer ops
    (fed), so the user's graph gets no new op. The copy side uses ops of its
    own, on their own handles to the same variables, so a sync never runs an
    instrumentation routine placed on a variable op.

    Only what changed moves: into the shadow, the user variables whose
    buffer is not the one kept at the last sync (reference variables, which
    TensorFlow updates in place, always move); out of it, the variables
    that ops run in the shadow since may have written.
    """

    def __init__(self, shadow):
        self.shadow = shadow
        self._copy_ops = {}
        self._found = (None, [])          # (user graph version, _variables())
        self._present = (None, set())     # (copy version, op names of the copy)
        self._callables = _Callables()
        self._snapshots = {}              # name -> the user's value as the shadow holds it
        self.writes = _Writes(shadow)

    def forget(self):
        """The shadow session was made anew: it holds nothing of the user's."""
        self._snapshots.clear()
        self._callables.clear()
        self.writes.dirty = set()

    def _variables(self):
        """(name, read tensor in user graph, assign op in user graph) per variable.

        Only ops that run nothing but themselves are used: a read or assign
        with a control input (``var.assign(var * mask)`` under
        ``tf.control_dependencies([train_op])``, or the read TensorFlow adds
        after a resource variable's assign) would run the user's other ops
        during a sync (a training step, a placeholder the run does not feed),
        and an assign must write the variable itself, not take a reference
        variable as its value.
        """
        graph = self.shadow.user_graph
        if self._found[0] == graph.version:
            return self._found[1]
        found = []
        for op in graph.get_operations():
            if op.type == "VarHandleOp":
                reads, assigns = ("ReadVariableOp",), ("AssignVariableOp",)
            elif op.type in ("VariableV2", "Variable"):
                reads, assigns = (), ("Assign",)
            else:
                continue
            consumers = op.outputs[0].consumers()
            read = op.outputs[0] if not reads else next(
                (c.outputs[0] for c in consumers if c.type in reads and _runs_alone(c)), None)
            assign = next((c for c in consumers
                           if c.type in assigns and _runs_alone(c)
                           and c.inputs[0].name == op.outputs[0].name
                           and graph.is_feedable(c.inputs[1])),
                          None)
            if read is not None:
                found.append((op.name, read, assign))
        self._found = (graph.version, found)
        return found

    def _read(self, session, tensors):
        """Values of the initialised variables: {index: value}, aliasing
        the session's buffers where all are initialised."""
        if not tensors:
            return {}
        try:
            return dict(enumerate(self._callables.run(session, tensors)))
        except tf.errors.FailedPreconditionError:
            values = {}
            for i, tensor in enumerate(tensors):
                try:
                    values[i] = _original_run(session, tensor)
                except tf.errors.FailedPreconditionError:
                    pass
            return values

    def _copy_side(self, variables):
        """(placeholder, assign op, read tensor) in the copy per variable that
        the copy has; built on first need (the copy is ours to extend)."""
        copy, ops = self.shadow.copy, self._copy_ops
        if self._present[0] != copy.version:
            self._present = (copy.version, {op.name for op in copy.get_operations()})
        present = self._present[1]
        missing = [(name, read) for name, read, _ in variables
                   if name not in ops and name in present]
        if missing:
            with copy.as_default(), tf.name_scope("amanda_sync"):
                for name, read in missing:
                    ops[name] = _sync_ops(copy.get_operation_by_name(name), read.dtype)
        return ops

    def into_shadow(self):
        """User session -> shadow session (initialised variables whose value
        the shadow may not hold)."""
        variables = self._variables()
        values = self._read(self.shadow.user_session, [r for _, r, _ in variables])
        side = self._copy_side(variables)
        dirty = self.writes.dirty
        moved = []   # (name, value)
        for i, value in values.items():
            name = variables[i][0]
            if name not in side:
                continue
            kept = self._snapshots.get(name)
            if (kept is not None and dirty is not ALL and name not in dirty
                    and _unchanged(kept, value)):
                continue   # the shadow holds this value already
            moved.append((name, value))
        if moved:
            reads = {n: r for n, r, _ in variables}
            shared = [_is_resource(reads[n]) for n, _ in moved]
            self._assign(self.shadow.session, [side[n][0] for n, _ in moved],
                         [side[n][1] for n, _ in moved], [side[n][2] for n, _ in moved],
                         [v for _, v in moved], shared)
            for name, value in moved:
                self._remember(name, reads[name], value)
        self.writes.dirty = set()

    def _remember(self, name, read, value):
        """Keep what tells later whether the user's value is still the one
        the shadow holds (`_snapshot`)."""
        kept = _snapshot(value, read)
        if kept is None:
            self._snapshots.pop(name, None)
        else:
            self._snapshots[name] = kept

    def _assign(self, session, feeds, assigns, reads, values, shared):
        """Run ``assigns`` fed with ``values`` and read the variables back
        (aliasing their buffers). A resource variable (``shared``) takes the
        fed buffer itself: the two sessions' variables then share one
        buffer, which TensorFlow copies before either writes it, as it does
        for any buffer with more than one reference (the module's
        docstring). Reference variables are written in place, so they get
        copies."""
        values = [v if share or v.base is None else np.array(v)
                  for v, share in zip(values, shared)]
        self._callables.run(session, feeds=feeds, values=values, targets=assigns)
        return self._callables.run(session, reads)

    def out_of_shadow(self):
        """Shadow session -> user session (variables the shadow's runs may
        have written since it got them)."""
        if getattr(self.shadow.user_session, "_closed", False) or self.shadow.session is None:
            return  # the user closed it inside the scope: its state is gone anyway
        dirty = self.writes.dirty
        if dirty is not ALL and not dirty:
            return
        variables = self._variables()
        side = self._copy_side(variables)
        variables = [v for v in variables
                     if v[0] in side and (dirty is ALL or v[0] in dirty)]
        values = self._read(self.shadow.session, [side[name][2] for name, _, _ in variables])
        written, missing = [], []
        for i, value in values.items():
            name, _, assign = variables[i]
            (missing if assign is None else written).append((variables[i], value))
        if written:
            shared = [_is_resource(v[1]) for v, _ in written]
            now = self._assign(self.shadow.user_session, [v[2].inputs[1] for v, _ in written],
                               [v[2] for v, _ in written], [v[1] for v, _ in written],
                               [value for _, value in written], shared)
            for ((name, read, _), _), back in zip(written, now):
                self._remember(name, read, back)
        self.writes.dirty = set()
        if missing:
            warnings.warn("amanda could not hand these variables back to the user session "
                          f"(no fed assign op that runs alone): "
                          f"{', '.join(v[0] for v, _ in missing)}")


class _Writes:
    """Which variables the shadow's runs may have written since the last
    sync (``dirty``: names, or `ALL`), from the ops each run can execute:
    the ancestors of its fetches and targets in the copy. An op reading a
    variable's handle or reference that is not a known read writes it; an op
    whose variable is not known (a handle passed on), and a function call
    while a function of the copy makes variables of its own, write all."""

    def __init__(self, shadow):
        self.shadow = shadow
        self.dirty = set()
        self._memo = (None, {})   # (copy version, {run key: names or ALL})

    def ran(self, elements):
        if self.dirty is ALL:
            return
        copy = self.shadow.copy
        if self._memo[0] != copy.version:
            self._memo = (copy.version, {})
        key = tuple(e.name for e in elements)
        found = self._memo[1].get(key, False)
        if found is False:
            found = self._memo[1][key] = self._written([e if isinstance(e, tf.Operation) else e.op
                                                        for e in elements])
        self.dirty = ALL if found is ALL else self.dirty | found

    def _written(self, ops):
        functions = getattr(self.shadow.copy, "_functions", None)
        own_variables = functions is None or any(
            node.op in _VARIABLE_OPS for f in functions.values()
            for node in f.definition.node_def)
        seen, stack, written = set(), list(ops), set()
        while stack:
            op = stack.pop()
            if op.name in seen:
                continue
            seen.add(op.name)
            if own_variables and _calls_function(op):
                return ALL
            for tensor in op.inputs:
                stack.append(tensor.op)
                if op.type in _READ_ONLY or not _is_state(tensor.dtype):
                    continue
                if tensor.op.type not in _VARIABLE_OPS:
                    return ALL
                written.add(tensor.op.name)
            stack.extend(op.control_inputs)
        return frozenset(written)


def _is_state(dtype):
    return dtype == tf.resource or dtype._is_ref_dtype


def _calls_function(op):
    for value in op.node_def.attr.values():
        if value.HasField("func") or (value.HasField("list") and len(value.list.func)):
            return True
    return op.type in getattr(op.graph, "_functions", {})


def _runs_alone(op):
    """Whether running ``op`` (its value input fed, if any) runs no other op
    of the user's graph than the variable it reads or writes: no control
    inputs. Consumers are in no fixed order (TensorFlow keeps them in a hash
    set), so this is checked, never assumed from the order."""
    return not op.control_inputs


def _sync_ops(var, dtype):
    """Placeholder, assign op and read tensor for the variable op ``var`` of
    the copy, on a handle of their own (same container and shared name: the
    same variable) so that routines on ``var`` do not run during a sync."""
    value = tf.compat.v1.placeholder(dtype)
    shared_name = var.get_attr("shared_name")
    container = var.get_attr("container")
    with tf.device(var.device):
        if var.type == "VarHandleOp":
            handle = var.outputs[0]
            if shared_name:   # an empty one would mean a different variable
                handle = tf.raw_ops.VarHandleOp(dtype=dtype, shape=var.get_attr("shape"),
                                                container=container, shared_name=shared_name)
            assign = tf.raw_ops.AssignVariableOp(resource=handle, value=value)
            reader = tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)
        else:
            ref = tf.raw_ops.VariableV2(shape=var.get_attr("shape"), dtype=dtype,
                                        container=container,
                                        shared_name=shared_name or var.name)
            assign = tf.compat.v1.assign(ref, value, validate_shape=False).op
            reader = tf.identity(ref)
    return value, assign, reader
