"""Lowering: an IR graph (lifted from ONNX, possibly instrumented) -> ``ModelProto``.

`_Lowering` writes the graph and its If/Loop/Scan bodies back as ONNX: the
original nodes with their attributes, names, types and the model's metadata,
graph outputs under the model's names. The routines in it are written by its
`RoutineNodes` part (:mod:`amanda.runtime.onnx.routine_nodes`).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from amanda.errors import BackendError
from amanda.frontends.onnx import ProtoAttr
from amanda.frontends.onnx.models import default_domain_version
from amanda.passes.lower_actions import ROUTINE
from amanda.runtime.onnx.host import CALLBACK_DOMAIN
from amanda.runtime.onnx.portable import elem_type
from amanda.runtime.onnx.routine_nodes import RoutineNodes

#: Highest IR version onnxruntime 1.31 reads (onnx writes 14 by default).
MAX_IR_VERSION = 13


def lower(ir_graph, callbacks=True):
    """Write an IR graph (lifted from ONNX, possibly instrumented) as a ModelProto.

    Args:
        ir_graph: an :class:`amanda.ir.Graph` from :func:`amanda.frontends.onnx.lift`,
            possibly with ``amanda.routine`` ops.
        callbacks: host routines that do not lower natively as Python custom
            ops (else they raise).

    Returns:
        An ``onnx.ModelProto`` with the original opsets, and IR version capped
        at `MAX_IR_VERSION`.

    Raises:
        BackendError: an op cannot be written as ONNX, or a routine cannot be
            lowered natively while ``callbacks`` is False.
    """
    return _Lowering(ir_graph, callbacks).model()


class _Lowering(RoutineNodes):
    """One IR graph (and its nested graphs) -> one ModelProto."""

    #: fresh names avoid every name of the IR graph (the model written is
    #: made of them); a subclass writing into another model collects that
    #: model's names itself
    NAMES_FROM_IR = True

    def __init__(self, graph, callbacks):
        self.top = graph
        self.callbacks = callbacks
        meta = graph.attrs.get("_onnx") or {}
        self.meta = meta
        self.opsets = [list(pair) for pair in meta.get("opset_import",
                                                       [["", onnx.defs.onnx_opset_version()]])]
        self.ir_version = min(meta.get("ir_version", onnx.IR_VERSION), MAX_IR_VERSION)
        if not any(d in ("", "ai.onnx") for d, _ in self.opsets):
            # a model of other domains only (ai.onnx.ml): amanda's own nodes
            # (Identity, Size, Cast, ...) need the default domain
            self.opsets.append(["", default_domain_version(self.ir_version)])
        self.opset = next((v for d, v in self.opsets if d in ("", "ai.onnx")), 0)
        self.uses_callbacks = False
        # every routine is an observe-only Python callback at top level: the
        # model's dataflow is untouched (see _SideBranches)
        self.side_only = True
        # some Python routine's results flow back into the model
        self.inline = False
        # token of the last hosted routine written in the graph being
        # written: the next routine's chain starts there (see _callback)
        self.last_token = None
        self.outer_token = None   # the enclosing graph's token at a body's holding node
        self.nested = False       # writing a body of If/Loop/Scan
        self.hosted = 0           # hosted routines written so far
        self.host_nodes = 0       # nodes of the extensions' domain written so far
        self.ranks_known = True   # the graph being written declares its outputs' ranks
        self.holder = None        # the op whose attributes are being written
        self.body_of = None       # the op holding the body being written
        self._new_initializers_as_inputs = False
        self.names = {}
        self.used = set()
        if self.NAMES_FROM_IR:
            _collect_names(graph, self.used)
        self.types = {}
        self.graph_proto = None   # the GraphProto being written
        self.ops_by_name = {}
        self.portability = {}     # (id(function), bound) -> (function, portable?): _portable_here

    # -- names
    def fresh(self, base):
        base = base or "amanda"
        name, k = base, 1
        while name in self.used:
            name, k = f"{base}_{k}", k + 1
        self.used.add(name)
        return name

    def name(self, tensor):
        name = self.names.get(tensor)
        if name is None:
            if tensor.attrs.get("absent"):
                name = ""
            elif tensor.producer is not None and tensor.producer.type == ROUTINE:
                routine = tensor.producer
                name = self.fresh(f"{routine.attrs['target']}/amanda.{routine.attrs['kind']}"
                                  f".{tensor.index}")
            else:
                name = tensor.name
            self.names[tensor] = name
        return name

    # -- types
    def tensor_type(self, tensor):
        """(dtype, shape) of a tensor, following routines back to what they replace."""
        found = self.types.get(tensor)
        if found is not None:
            return found
        attrs = tensor.attrs
        producer = tensor.producer
        if attrs.get("dtype") is None and producer is not None and producer.type == ROUTINE:
            if producer.attrs["kind"].startswith("replace"):
                target = self.ops_by_name[producer.attrs["target"]]
                found = self.tensor_type(target.outputs[tensor.index])
            else:
                found = self.tensor_type(producer.inputs[tensor.index])
        else:
            found = (attrs.get("dtype"), attrs.get("shape"))
        self.types[tensor] = found
        return found

    def onnx_type(self, tensor):
        """The tensor's ``TypeProto`` or None."""
        while True:
            onnx_type = tensor.attrs.get("onnx_type")
            if onnx_type is not None:
                return onnx_type.message
            producer = tensor.producer
            if producer is None or producer.type != ROUTINE:
                break
            if producer.attrs["kind"].startswith("replace"):
                tensor = self.ops_by_name[producer.attrs["target"]].outputs[tensor.index]
            else:
                tensor = producer.inputs[tensor.index]
        dtype, shape = self.tensor_type(tensor)
        if dtype is None:
            return None
        return helper.make_tensor_type_proto(elem_type(dtype), shape)

    # -- model and graphs
    def model(self):
        # the graph is written in place (``helper.make_model`` would copy it,
        # weights included, beside the one written)
        model = onnx.ModelProto()
        self.graph(self.top, into=model.graph)
        meta = self.meta
        if self.uses_callbacks and all(d != CALLBACK_DOMAIN for d, _ in self.opsets):
            self.opsets.append([CALLBACK_DOMAIN, 1])
        model.opset_import.extend(helper.make_opsetid(d, v) for d, v in self.opsets)
        model.functions.extend(f.message for f in meta.get("functions", ()))
        model.producer_name = meta.get("producer_name", "amanda")
        model.producer_version = meta.get("producer_version", "")
        model.domain = meta.get("domain", "")
        model.model_version = meta.get("model_version", 0)
        model.doc_string = meta.get("doc_string", "")
        model.ir_version = self.ir_version
        for key, value in meta.get("metadata_props", ()):
            model.metadata_props.add(key=key, value=value)
        for info in meta.get("training_info", ()):
            model.training_info.add().CopyFrom(info.message)
        return model

    def graph(self, ir_graph, into=None):
        meta = ir_graph.attrs.get("_onnx") or {}
        saved = self._enter_graph(ir_graph)
        proto = self.graph_proto = onnx.GraphProto() if into is None else into
        proto.name = meta.get("name", ir_graph.name)
        proto.doc_string = meta.get("doc_string", "")
        try:
            self._name_outputs(ir_graph, meta)
            self.ranks_known = all(self.tensor_type(t)[1] is not None for t in ir_graph.outputs
                                   if self.tensor_type(t)[0] is not None)
            self._inputs(ir_graph, meta, proto)
            for op in ir_graph:
                if op.type == ROUTINE:
                    self._routine(op)
                else:
                    hosted = self.hosted
                    self._node(op)
                    if self.hosted != hosted:
                        self._join(op)
            self._outputs(ir_graph, meta, proto)
        finally:
            self._leave_graph(saved)
        return proto

    def _enter_graph(self, ir_graph):
        """Start writing ``ir_graph`` (a body: from inside its holding node)."""
        saved = (self.graph_proto, self.ops_by_name, self.last_token, self.outer_token,
                 self.nested, self._new_initializers_as_inputs, self.ranks_known, self.body_of)
        # a body's routines start where the enclosing graph's chain is at the
        # holding node (after the node's before-routines): see _chain_start
        self.outer_token, self.nested = self.last_token, ir_graph is not self.top
        self.body_of = self.holder if self.nested else None
        self.ranks_known = True
        self.last_token = None
        self.ops_by_name = {op.name: op for op in ir_graph.ops}
        return saved

    def _leave_graph(self, saved):
        (self.graph_proto, self.ops_by_name, self.last_token, self.outer_token,
         self.nested, self._new_initializers_as_inputs, self.ranks_known, self.body_of) = saved

    def _name_outputs(self, ir_graph, meta):
        """Graph outputs keep the model's names, also where a routine now
        produces them (the original tensor is renamed instead)."""
        declared = meta.get("outputs") or []
        by_name = {}
        for tensor in ir_graph.inputs:
            by_name[tensor.name] = tensor
        for op in ir_graph:
            for tensor in op.outputs:
                by_name[tensor.name] = tensor
        for position, tensor in enumerate(ir_graph.outputs):
            if position >= len(declared) or tensor in self.names:
                continue
            wanted = declared[position][0]
            if tensor.name == wanted:
                continue
            source = tensor
            while source.producer is not None and source.producer.type == ROUTINE \
                    and self._passes_through(source.producer, source.index):
                source = source.producer.inputs[source.index]
            if source.name == wanted:
                # only routines that hand the value on unchanged stand between:
                # the original keeps its name and they alias it (copying it
                # with an Identity would fail for sequences before opset 14)
                continue
            holder = by_name.get(wanted)
            if holder is not None and holder not in self.names:
                self.names[holder] = self.fresh(f"{wanted}/amanda.original")
            self.names[tensor] = wanted

    def _inputs(self, ir_graph, meta, proto):
        # a body's inputs are positional (Loop, Scan): never add any
        new_as_inputs = self.ir_version < 4 and ir_graph is self.top
        for tensor in ir_graph.inputs:
            attrs = tensor.attrs
            if attrs.get("absent") or attrs.get("captured") is not None \
                    or attrs.get("sparse_initializer"):
                continue
            name = self.name(tensor)
            initializer = attrs.get("initializer")
            if initializer is not None:
                copy = proto.initializer.add()
                copy.CopyFrom(initializer.message)
                copy.name = name
            if attrs.get("graph_input") or initializer is None:
                proto.input.append(self.value_info(tensor, name))
        for sparse in meta.get("sparse_initializers", ()):
            proto.sparse_initializer.add().CopyFrom(sparse.message)
        self._new_initializers_as_inputs = new_as_inputs

    def _outputs(self, ir_graph, meta, proto):
        declared = meta.get("outputs") or []
        for position, tensor in enumerate(ir_graph.outputs):
            name = self.name(tensor)
            info = onnx.ValueInfoProto(name=name)
            type_attr = declared[position][1] if position < len(declared) else None
            onnx_type = type_attr.message if type_attr is not None else self.onnx_type(tensor)
            if onnx_type is not None:
                info.type.CopyFrom(onnx_type)
            proto.output.append(info)
        for op in ir_graph:
            for tensor in op.outputs:
                if tensor.attrs.get("value_info") and tensor.attrs.get("onnx_type") is not None:
                    proto.value_info.append(self.value_info(tensor, self.name(tensor)))

    def value_info(self, tensor, name):
        info = onnx.ValueInfoProto(name=name)
        onnx_type = self.onnx_type(tensor)
        if onnx_type is not None:
            info.type.CopyFrom(onnx_type)
        return info

    def add_initializer(self, array, base):
        name = self.fresh(base)
        self.graph_proto.initializer.append(numpy_helper.from_array(np.asarray(array), name))
        if self._new_initializers_as_inputs:
            self.graph_proto.input.append(helper.make_tensor_value_info(
                name, elem_type(np.asarray(array).dtype.name), list(np.shape(array))))
        return name

    def add_node(self, op_type, inputs, outputs, name, domain="", **attrs):
        node = helper.make_node(op_type, inputs, outputs, name=self.fresh(name), domain=domain,
                                **attrs)
        self.graph_proto.node.append(node)
        return node

    # -- ordinary ops
    def _node(self, op):
        if not op.namespace.startswith("onnx/"):
            raise BackendError(f"op {op.name!r} ({op.type}) of namespace {op.namespace!r} cannot "
                               "be written as ONNX")
        meta = op.attrs.get("_onnx") or {}
        count = meta.get("num_inputs", len(op.inputs))
        node = self.graph_proto.node.add()
        node.op_type = op.type
        node.domain = meta.get("domain", "")
        node.name = meta.get("name", op.name)
        if meta.get("doc_string"):
            node.doc_string = meta["doc_string"]
        if meta.get("overload"):
            node.overload = meta["overload"]
        node.input.extend(self.name(t) for t in op.inputs[:count])
        node.output.extend(self.name(t) for t in op.outputs)
        captures = {c: self.name(t) for c, t in zip(meta.get("captures", ()), op.inputs[count:])}
        types = meta.get("attribute_types", {})
        saved, self.holder = self.holder, op
        try:
            for key, value in op.attrs.items():
                if key != "_onnx":
                    node.attribute.append(self._attribute(op, key, value, types.get(key),
                                                          captures))
        finally:
            self.holder = saved

    def _attribute(self, op, key, value, type_name, captures):
        kinds = onnx.AttributeProto
        if type_name is None:
            type_name = _infer_attribute_type(value)
        if type_name is None:
            return helper.make_attribute(key, value)
        attr = onnx.AttributeProto(name=key, type=kinds.AttributeType.Value(type_name))
        if type_name == "FLOAT":
            attr.f = value
        elif type_name == "INT":
            attr.i = value
        elif type_name == "STRING":
            attr.s = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        elif type_name in ("TENSOR", "SPARSE_TENSOR", "TYPE_PROTO"):
            field = {"TENSOR": "t", "SPARSE_TENSOR": "sparse_tensor", "TYPE_PROTO": "tp"}
            getattr(attr, field[type_name]).CopyFrom(value.message)
        elif type_name == "GRAPH":
            attr.g.CopyFrom(self._subgraph(value, captures))
        elif type_name == "FLOATS":
            attr.floats.extend(value)
        elif type_name == "INTS":
            attr.ints.extend(value)
        elif type_name == "STRINGS":
            attr.strings.extend(v.encode("utf-8") if isinstance(v, str) else bytes(v)
                                for v in value)
        elif type_name in ("TENSORS", "SPARSE_TENSORS", "TYPE_PROTOS"):
            field = {"TENSORS": "tensors", "SPARSE_TENSORS": "sparse_tensors",
                     "TYPE_PROTOS": "type_protos"}
            getattr(attr, field[type_name]).extend(v.message for v in value)
        elif type_name == "GRAPHS":
            attr.graphs.extend(self._subgraph(g, captures) for g in value)
        else:
            raise BackendError(f"op {op.name!r} ({op.type}): attribute {key!r} has type "
                               f"{type_name}, which cannot be written")
        return attr

    def _subgraph(self, graph, captures):
        for tensor in graph.inputs:
            captured = tensor.attrs.get("captured")
            if captured is not None:
                self.names[tensor] = captures.get(captured, captured)
        return self.graph(graph)


def _collect_names(graph, names):
    from amanda.ir.attrs import iter_graphs
    names.update(t.name for t in graph.inputs)
    for op in graph.ops:
        names.update(t.name for t in op.outputs)
        attrs = op.attrs
        meta = attrs.get("_onnx") or {}
        if meta.get("name"):
            names.add(meta["name"])
        if op.type == ROUTINE:
            continue
        for key, value in attrs.items():
            # (bodies are graphs among the node's attributes, never in its
            # metadata, whose nested dicts are the larger part of a walk)
            if key != "_onnx" and not isinstance(value, (int, float, str)):
                for _, sub in iter_graphs(value):
                    _collect_names(sub, names)


def _infer_attribute_type(value):
    from amanda.ir import Graph
    if isinstance(value, Graph):
        return "GRAPH"
    if isinstance(value, ProtoAttr):
        return {"TensorProto": "TENSOR", "SparseTensorProto": "SPARSE_TENSOR",
                "TypeProto": "TYPE_PROTO"}.get(type(value.message).__name__)
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], Graph):
        return "GRAPHS"
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], ProtoAttr):
        return "TENSORS"
    return None
