"""Lift PyTorch eager execution into the amanda IR.

:class:`EagerTrace` is fed by the eager driver (``amanda.runtime.pytorch``) as
ops execute. One step's trace is an :class:`amanda.ir.Graph` holding the
forward ops in execution order, then the backward ops (autograd nodes) joined
by gradient tensors; each backward op has its forward op as control input.

A step ends when an op id repeats (the next step started) or when the
outermost ``apply`` scope exits; the finished graph is handed to every tool's
``graph_completed``.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from amanda.ir import Graph

_JSON_SCALARS = (bool, int, float, str, type(None))
_tokens = itertools.count(1)


def _attr_value(value):
    """Non-tensor arguments kept as op attributes (JSON-able ones only)."""
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, (list, tuple, torch.Size)) and all(
            isinstance(v, _JSON_SCALARS) for v in value):
        return list(value)
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(value)
    return None


def _tensor_attrs(tensor):
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", "")}


class _PendingBackward:
    __slots__ = ("name", "op_id", "forward", "children", "index")

    def __init__(self, name, op_id, forward, index):
        self.name, self.op_id, self.forward, self.index = name, op_id, forward, index
        self.children = []


class EagerTrace:
    """Builds one IR graph per step from the driver's callbacks."""

    def __init__(self, namespace, on_complete=None, resolve_node=None):
        """Args:
            namespace: the namespace of the lifted ops.
            on_complete: called with each finished graph.
            resolve_node: maps an autograd node to the node that stands for it
                in the trace (the driver's own pass-through nodes are skipped).
        """
        self.namespace = namespace
        self.on_complete = on_complete
        self.resolve_node = resolve_node or (lambda node: node)
        self.completed = None
        self._start()

    def _start(self):
        self.graph = Graph("pytorch_step", namespace=self.namespace)
        self.token = next(_tokens)
        self._op_ids = set()
        self._values = {}       # id(tensor) -> (weakref, IR tensor)
        self._backward = []     # _PendingBackward, in discovery order

    # -- forward ------------------------------------------------------------
    def forward(self, record, func, args, kwargs, tensors, outputs, nodes):
        """Record one executed forward op and the autograd nodes it created.

        Returns:
            The IR op.
        """
        if record.op_id in self._op_ids:
            self.finish()
        self._op_ids.add(record.op_id)
        inputs = [self._value_of(t, record) for t in tensors]
        attrs = {"op_id": record.op_id, "module": record.module_path}
        scalars = [_attr_value(a) for a in args if not isinstance(a, torch.Tensor)]
        if any(s is not None for s in scalars):
            attrs["args"] = scalars
        for k, v in kwargs.items():
            if not isinstance(v, torch.Tensor) and _attr_value(v) is not None:
                attrs.setdefault("kwargs", {})[k] = _attr_value(v)
        op = self.graph.create_op(record.name, inputs, num_outputs=len(outputs), attrs=attrs)
        for tensor, value in zip(outputs, op.outputs):
            value.attrs.update(_tensor_attrs(tensor))
            self._values[id(tensor)] = (weakref.ref(tensor), value)
        if nodes:
            self._add_backward(record, op, nodes, tensors)
        return op

    def _value_of(self, tensor, record):
        entry = self._values.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        kind = "parameter" if isinstance(tensor, torch.nn.Parameter) else "input"
        value = self.graph.add_input(kind, kind=kind, **_tensor_attrs(tensor))
        self._values[id(tensor)] = (weakref.ref(tensor), value)
        return value

    def splice(self, graph, op_ids, modules, inputs, outputs):
        """Record the ops of a compiled graph that just ran, as if they had
        run eagerly: ``graph`` is its lifted IR graph, ``op_ids`` and
        ``modules`` eager's id and module path of each of its ops (by name),
        ``inputs`` the real tensors of its inputs (by IR name; a missing one
        is a new graph input) and ``outputs`` ``(IR tensor, real tensor)``
        pairs of what it returned, which later ops then read. A graph whose
        op ids the step has seen starts the next step, as an eager op would.
        The spliced ops have no backward ops: a compiled graph's autograd
        nodes are AOTAutograd's, not eager's."""
        ids = [op_ids[op.name] for op in graph.ops]
        if any(op_id in self._op_ids for op_id in ids):
            self.finish()
        values = {}
        for tensor in graph.inputs:
            real = inputs.get(tensor.name)
            if isinstance(real, torch.Tensor):
                values[tensor] = self._value_of(real, None)
        for op, op_id in zip(graph.ops, ids):
            self._op_ids.add(op_id)
            reads = [values[t] if t in values else self._new_input(t) for t in op.inputs]
            spliced = self.graph.create_op(op.type, reads, num_outputs=len(op.outputs),
                                           attrs={"op_id": op_id, "module": modules.get(op.name)})
            for old, new in zip(op.outputs, spliced.outputs):
                new.attrs.update({k: old.attrs[k] for k in ("shape", "dtype") if k in old.attrs})
                values[old] = new
        for tensor, real in outputs:
            if tensor in values and isinstance(real, torch.Tensor):
                self._values[id(real)] = (weakref.ref(real), values[tensor])

    def _new_input(self, tensor):
        attrs = {k: tensor.attrs[k] for k in ("shape", "dtype") if k in tensor.attrs}
        return self.graph.add_input("input", kind="input", **attrs)

    def alias(self, tensors, values):
        """Make replaced tensors (after-op routines) stand for the same IR values."""
        for tensor, value in zip(tensors, values):
            self._values[id(tensor)] = (weakref.ref(tensor), value)

    # -- backward -----------------------------------------------------------
    def _add_backward(self, record, forward_op, nodes, inputs):
        start = len(self._backward)
        for i, (node, brec) in enumerate(zip(nodes, record.backward_records(nodes, inputs))):
            self._backward.append(_PendingBackward(brec.name, brec.op_id, forward_op, start + i))
            node.metadata["amanda_trace"] = (self.token, start + i)
        for i, node in enumerate(nodes):
            pending = self._backward[start + i]
            for slot, (child, _) in enumerate(node.next_functions):
                child = self.resolve_node(child) if child is not None else None
                mark = child.metadata.get("amanda_trace") if child is not None else None
                if mark is not None and mark[0] == self.token:
                    pending.children.append((slot, mark[1]))

    def _backward_order(self, incoming):
        """Backward ops in a topological order of gradient flow; ties go to
        the most recently created node (the order autograd runs them)."""
        waiting = {p.index: len(incoming.get(p.index, ())) for p in self._backward}
        ready = [i for i, n in waiting.items() if n == 0]
        order = []
        while ready:
            ready.sort()
            index = ready.pop()
            order.append(self._backward[index])
            for _, child in self._backward[index].children:
                waiting[child] -= 1
                if waiting[child] == 0:
                    ready.append(child)
        return order

    def _lower_backward(self):
        incoming = {}
        for pending in self._backward:
            for slot, child in pending.children:
                incoming.setdefault(child, []).append((pending.index, slot))
        ops = {}
        for pending in self._backward_order(incoming):
            sources = incoming.get(pending.index, [])
            inputs = [ops[p].outputs[slot] for p, slot in sources if p in ops]
            if not inputs:
                inputs = [self.graph.add_input(f"grad_{pending.name}", kind="gradient")]
            num_outputs = 1 + max((slot for slot, _ in pending.children), default=-1)
            ops[pending.index] = self.graph.create_op(
                pending.name, inputs, num_outputs=num_outputs,
                attrs={"op_id": pending.op_id, "backward": True,
                       "forward_op_id": pending.forward.attrs["op_id"]},
                control_inputs=(pending.forward,))

    # -- ending a step --------------------------------------------------------
    def finish(self):
        """Close the current step's graph and start a new one.

        Returns:
            The finished graph, or None when the step recorded nothing.
        """
        graph = self.graph
        if len(graph) == 0:
            self._start()
            return None
        self._lower_backward()
        graph.set_outputs([t for op in graph.ops if not op.attrs.get("backward")
                           for t in op.outputs if not t.uses])
        self.completed = graph
        self._start()
        if self.on_complete is not None:
            self.on_complete(graph)
        return graph
