"""TensorFlow graph mode: variable values moved between a user session and
its shadow (`_VariableSync`, `_runs_alone`, `_sync_ops`).
"""

from __future__ import annotations

import warnings

import tensorflow as tf
from amanda.runtime.tensorflow_probes import _original_run


class _VariableSync:
    """Copies variable values between a user session and its shadow.

    The user side uses only the user graph's existing read and initializer ops
    (fed), so the user's graph gets no new op. The copy side uses ops of its
    own, on their own handles to the same variables, so a sync never runs an
    instrumentation routine placed on a variable op.
    """

    def __init__(self, shadow):
        self.shadow = shadow
        self._copy_ops = {}

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
        return found

    def _read(self, run, session, tensors):
        """Values of the initialised variables: {index: value}."""
        try:
            return dict(enumerate(run(session, list(tensors))))
        except tf.errors.FailedPreconditionError:
            values = {}
            for i, tensor in enumerate(tensors):
                try:
                    values[i] = run(session, tensor)
                except tf.errors.FailedPreconditionError:
                    pass
            return values

    def _copy_side(self, variables):
        """(placeholder, assign op, read tensor) in the copy per variable that
        the copy has; built on first need (the copy is ours to extend)."""
        copy, ops = self.shadow.copy, self._copy_ops
        present = {op.name for op in copy.get_operations()}
        missing = [(name, read) for name, read, _ in variables
                   if name not in ops and name in present]
        if missing:
            with copy.as_default(), tf.name_scope("amanda_sync"):
                for name, read in missing:
                    ops[name] = _sync_ops(copy.get_operation_by_name(name), read.dtype)
        return ops

    def into_shadow(self):
        """User session -> shadow session (initialised variables only)."""
        variables = self._variables()
        values = self._read(_original_run, self.shadow.user_session, [r for _, r, _ in variables])
        side = self._copy_side(variables)
        assigns, feeds = [], {}
        for i, value in values.items():
            entry = side.get(variables[i][0])
            if entry is None:
                continue
            placeholder, assign, _ = entry
            assigns.append(assign)
            feeds[placeholder] = value
        if assigns:
            _original_run(self.shadow.session, assigns, feeds)

    def out_of_shadow(self):
        """Shadow session -> user session (variables initialised in the shadow)."""
        if getattr(self.shadow.user_session, "_closed", False) or self.shadow.session is None:
            return  # the user closed it inside the scope: its state is gone anyway
        variables = self._variables()
        side = self._copy_side(variables)
        variables = [v for v in variables if v[0] in side]
        values = self._read(_original_run, self.shadow.session,
                            [side[name][2] for name, _, _ in variables])
        assigns, feeds, missing = [], {}, []
        for i, value in values.items():
            name, _, assign = variables[i]
            if assign is None:
                missing.append(name)
                continue
            assigns.append(assign)
            feeds[assign.inputs[1]] = value
        if assigns:
            _original_run(self.shadow.user_session, assigns, feeds)
        if missing:
            warnings.warn("amanda could not hand these variables back to the user session "
                          f"(no fed assign op that runs alone): {', '.join(missing)}")


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
