"""Observe-only routines: side branches on the graph onnxruntime optimised,
and the zero-copy fetch path.

When every routine of a session only looks, the model's own nodes stay those
onnxruntime optimised for the plain session (`_SideBranches`): outputs are
bit-identical. By default the observed tensors are then fetched as extra
outputs of ``session.run`` and the routines are called after it on
read-only views of onnxruntime's buffers (`_FetchPlan`, `_fetch_for`);
inside `hosted_observation` they run as host nodes during the run instead.
"""

from __future__ import annotations

import functools
import heapq

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

from amanda.frontends.onnx.models import default_domain_version
from amanda.passes.lower_actions import ROUTINE
from amanda.runtime.observation import fetch_budget
from amanda.runtime.routines import observe_after_run, returns_only_none
from amanda.runtime.onnx.bodies import (_bodies, _body_proto, _collect_proto_names,
                                        _holding_node, _hosts_routines, _node_needs,
                                        _sort_nodes)
from amanda.runtime.onnx.host import (_HOSTED_DTYPES, CALLBACK_DOMAIN, _Callback,
                                      _catalog, _register_callback,
                                      installed_run, refused_run, run_methods, set_run)
from amanda.runtime.onnx.lowering import _Lowering
from amanda.runtime.onnx.wire import graph_outputs, initializer_views

#: AttributeProto types of the attributes holding bodies (GRAPH, GRAPHS)
_BODY_KINDS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


class _NotSide(Exception):
    """A side branch cannot be attached to the optimised graph."""


class _SideBranches(_Lowering):
    """Observe-only routines attached to the graph onnxruntime optimised.

    When every routine only looks, the model onnxruntime runs is the one it
    optimised itself at the user's level (``optimized``), plus side
    branches: the routines' Put/Call nodes read the optimised graph's
    tensors by name, and nothing reads their results. Run with optimisations
    off, the model's own nodes are exactly those the plain session runs, so
    outputs are bit-identical. A tensor the optimiser fused away is
    recomputed for the routine by a copy of the user's nodes that produce
    it, off the main dataflow.

    Routines of If/Loop/Scan bodies go into the optimised copy of their body,
    found through the holding node (same op type and outputs: onnxruntime
    keeps the outputs of nodes it does not fuse away); a fused-away body
    tensor is recomputed inside that body, an enclosing graph's one in the
    enclosing graph (bodies read enclosing values by name).

    Args:
        graph: the lowered IR graph (``amanda.routine`` ops in it).
        model: the user's ``ModelProto``.
        optimized: the ``ModelProto`` onnxruntime wrote after optimising it;
            it becomes the result (changed in place, not copied).
        fetch: top-level routines are fetched and called after the run
            (`_FetchPlan`) instead of hosted.
        eager: hosted routines are listed right after their tensors'
            producers (`_sort_nodes_eagerly`; the session then runs with
            ``ExecutionOrder.PRIORITY_BASED``); not with routines in bodies.

    Raises:
        _NotSide: (from `model`) a routine reads a tensor that cannot be
            recomputed, or a body's holding node is gone from the optimised
            graph; the routines then run in the user's graph.
    """

    #: the result holds the optimised model's names (collected below) and
    #: fresh ones: the user's names are written only where the optimised
    #: model still has them
    NAMES_FROM_IR = False

    def __init__(self, graph, model, optimized=None, fetch=False, eager=False):
        super().__init__(graph, callbacks=True)
        self.fetch = fetch
        self.eager = eager and not fetch
        # (action, where, tensor count, hosted positions, names of those
        # tensors) per fetched routine, in program order
        self.fetched = []
        self._declared = set()
        self.copied = set()   # initializers copied back in for routines (see resolve)
        self.plan = None
        # hosted routines' weights, read without an AmandaPut: [(callback,
        # {position: initializer name})], bound to views by `bind_weights`
        self.weights = []
        self._dropped = {}
        self.into_bodies = False   # routines were attached inside bodies
        self._fetched_names = {}   # tensor -> the name it is fetched by
        self.original = model
        self.scope = None
        # what `prepare` found: the user's top graph's producers and weights,
        # and per fetched top-level routine (action, where, hosted positions,
        # their tensors)
        self._users = None
        self._prepared = {}
        # every top-level routine prepared and none with outputs (`Site`s):
        # `model` reads them from `_prepared` alone (`_fetch_prepared`)
        self._sites_prepared = False
        # per prepared tensor, its type as `graph_outputs` takes it
        self._output_types = {}
        self._type_bytes = {}   # id(TypeProto) -> (it, its bytes)
        self._sites = None   # the prepared sites' steps (`_PreparedSites`)
        self._steps = self._names = None   # their steps and names (`_fetch_prepared`)
        self.result = None
        if optimized is not None:
            self.take(optimized)

    def prepare(self):
        """The part of the work that needs only the user's model and the
        plan, done while onnxruntime optimises the model (`_Ahead`): the
        user's graph's producers and weights, and for each top-level routine
        fetched after the run its site and which of its tensors reach
        Python. Optional: `model` does what was not prepared."""
        self._users = _producers_and_weights(self.original.graph)
        if not self.fetch:
            return
        saved = self._enter_graph(self.top)
        try:
            prepared = {}
            target = where = None
            for op in self.top:
                if op.type != ROUTINE:
                    continue
                attrs = op.attrs
                action = attrs["action"]
                if self._portable_here(action.func):
                    return   # (traced into nodes of the result: `model` writes it)
                if attrs["target"] != target:   # (an op's routines come together)
                    target, where = attrs["target"], self._where(op, action)
                hosted, tensors = [], []
                for i, tensor in enumerate(op.inputs):
                    if not tensor.attrs.get("absent") and \
                            self.tensor_type(tensor)[0] in _HOSTED_DTYPES:
                        hosted.append(i)
                        tensors.append(tensor)
                prepared[op] = (action, where, hosted, tensors)
            self._prepared = prepared
            self._sites_prepared = not any(op.outputs for op in prepared)
            types = self._output_types
            for _, _, _, tensors in prepared.values():
                for tensor in tensors:
                    if tensor not in types:
                        types[tensor] = self._type_of_output(tensor)
            if self._sites_prepared:
                self._sites = _PreparedSites(prepared, types)
        finally:
            self._leave_graph(saved)

    def take(self, optimized):
        """Take onnxruntime's optimised model (owned from here on: the caller
        does not keep it), which `model` attaches the routines to."""
        self.result = optimized
        model = self.original
        proto = self.result.graph
        self._inputs = {i.name for i in proto.input}
        self._outputs = {o.name for o in proto.output}
        # the top graph's initializers (with the copies `resolve` adds)
        self._weights_here = {i.name for i in proto.initializer}
        # onnxruntime drops initializers it folded but keeps their graph
        # inputs (IR < 4 lists every initializer as an input): give them
        # their values back, or the model would require them as feeds
        weights = {i.name: i for i in model.graph.initializer}
        present = {i.name for i in proto.initializer}
        for declared in proto.input:
            if declared.name not in present and declared.name in weights:
                proto.initializer.add().CopyFrom(weights[declared.name])
                self._weights_here.add(declared.name)
        self._available = set()   # the top graph's values (for its `_Available`)
        _collect_proto_names(proto, self.used, self._available)
        self._pending_outputs = []   # (name, serialized type) declared, not yet appended

    def model(self):
        outputs = [o.name for o in self.result.graph.output]
        own = len(self.result.graph.node)
        if self._sites_prepared:
            self._fetch_prepared()
        else:
            self._attach(self.top, self.result.graph, self.original.graph)
        self._flush_outputs()
        if self.fetch:
            # (`_steps` and `_names` are None where the sites were not prepared)
            self.plan = _FetchPlan(self.fetched, self.result.graph, outputs, self._steps,
                                   self._names)
        # weights copied in for routines that no node reads are not in the
        # model the session runs: the plan or the callbacks keep their values
        # the copies have fresh names: only what amanda appended may read
        # them (at top level, unless routines went into bodies)
        self._dropped = _drop_unread_initializers(
            self.result.graph, self.copied, 0 if self.into_bodies else own)
        if self.plan is not None:
            self.plan.constants.update({n: _read_only(a) for n, a in self._dropped.items()
                                        if n in self.plan.constants})
        # side-branch nodes were appended; onnxruntime wants nodes that
        # produce a value a body reads (a token) listed before the body's node
        if self.eager:
            _sort_nodes_eagerly(self.result.graph, own)
        elif self.host_nodes:
            _sort_nodes(self.result.graph)
        # else only recomputations were appended, each after the nodes it
        # reads (`resolve` appends a node's inputs first) and read by no
        # node of the model: the order is still topological
        if self.host_nodes and all(o.domain != CALLBACK_DOMAIN
                                   for o in self.result.opset_import):
            self.result.opset_import.add(domain=CALLBACK_DOMAIN, version=1)
        if all(o.domain not in ("", "ai.onnx") for o in self.result.opset_import):
            # a model of other domains only: the ordering nodes (Size) need it
            self.result.opset_import.add(
                domain="", version=default_domain_version(self.result.ir_version))
        return self.result

    def _hosted_callback(self, op, action, where):
        """A top-level observe-only routine inside the run: as a side branch
        (`RoutineNodes._callback`), except that the weights it reads reach
        it as views (`bind_weights`) rather than through AmandaPut nodes. So the
        session holds each weight once (a node reading it beside a kernel
        that prepacks it would make onnxruntime keep both) and no run copies
        weights."""
        inputs = list(op.inputs)
        in_types = [None if t.attrs.get("absent") else self.tensor_type(t)[0] for t in inputs]
        hosted = [i for i, t in enumerate(in_types) if t in _HOSTED_DTYPES]
        callback = _Callback(action, where, len(inputs), hosted, [], False, observe=True)
        key = _register_callback(callback)
        _catalog()
        base = f"amanda.routine/{where[1]}"
        token = self.last_token or self._chain_start(key)
        weights = {}
        for slot, i in enumerate(hosted):
            name = self.name(inputs[i])
            if name in self._weights_here and name not in self._inputs:
                weights[slot] = name
                continue
            token = self._host_node(f"AmandaPut_{in_types[i]}", [name, token],
                                    f"{base}/put", f"{key}:{slot}")
        if not hosted:
            token = self._order(op, token, base, key)
        self.last_token = self._host_node("AmandaCall", [token], f"{base}/call", key)
        self.hosted += 1
        for tensor, source in zip(op.outputs, inputs):
            self._alias(tensor, self.name(source))
        self.uses_callbacks = True
        if weights:
            self.weights.append((callback, weights))

    def _attach(self, ir_graph, proto, original):
        """Attach the routines of ``ir_graph`` to ``proto`` (its optimised
        version; ``original`` is the user's)."""
        saved = self._enter_graph(ir_graph), self.scope
        self.graph_proto = proto
        top = ir_graph is self.top
        self.scope = _Available(proto, original, self.scope, self._users if top else None,
                                self._available if top else None)
        try:
            for op in ir_graph:
                if op.type == ROUTINE:
                    self._routine(op)
                    continue
                hosted = self.hosted
                for (_, attr, index), body in _bodies(op):
                    if _hosts_routines(body):
                        self._attach_body(op, attr, index, body, proto, original)
                if self.hosted != hosted:
                    self._join(op)
        finally:
            self._leave_graph(saved[0])
            self.scope = saved[1]

    def _fetch_prepared(self):
        """What `_attach` does for a top graph whose routines all observe
        at sites and were prepared (fetch mode: none in a body, so its
        other ops need nothing): an entry per routine, each tensor named and
        declared once, from what `prepare` kept (the IR graph is not read:
        `drop_graph`)."""
        saved = self.graph_proto, self.scope
        self.graph_proto = self.result.graph
        self.scope = _Available(self.result.graph, self.original.graph, None, self._users,
                                self._available)
        try:
            names = []
            for name, onnx_type in self._sites.tensors:
                if name is not None:
                    name = self.resolve(name)
                    self._declare_typed(name, onnx_type)
                names.append(name or "")
            self.fetched, self._steps = self._sites.fill(names)
            self._names = list(dict.fromkeys(n for n in names if n))
        finally:
            self.graph_proto, self.scope = saved

    def drop_graph(self):
        """Let go of the IR graph once `prepare` found every top-level
        routine at a site (`_sites_prepared`): `model` reads only what it
        kept. The graph is then garbage while onnxruntime still optimises
        the model, and collected there (`_side_branch_model`)."""
        self.top = None
        self._prepared = None
        self.names, self.types, self._output_types = {}, {}, {}
        self._fetched_names, self.ops_by_name = {}, {}

    def _attach_body(self, op, attr, index, body, proto, original):
        self.into_bodies = True
        outputs = [self.names.get(t, t.name) if not t.attrs.get("absent") else ""
                   for t in op.outputs]
        mine = _holding_node(original, op.type, outputs)
        theirs = _holding_node(proto, op.type, outputs)
        if mine is None or theirs is None:
            raise _NotSide(op.name)
        mine, theirs = _body_proto(mine, attr, index), _body_proto(theirs, attr, index)
        if mine is None or theirs is None:
            raise _NotSide(op.name)
        self._attach(body, theirs, mine)

    def _routine(self, op):
        prepared = self._prepared.get(op) if not self.nested else None
        if prepared is None:
            return super()._routine(op)
        self._fetch(op, *prepared)

    def _callback(self, op, action, where):
        """In fetch mode a top-level routine becomes an entry of the plan:
        its tensors are fetched as extra outputs of the run and the routine
        is called after it (see `_FetchPlan`); no node is added."""
        if self.nested:
            return super()._callback(op, action, where)
        if not self.fetch:
            return self._hosted_callback(op, action, where)
        hosted, tensors = [], []
        for i, tensor in enumerate(op.inputs):
            if not tensor.attrs.get("absent") and self.tensor_type(tensor)[0] in _HOSTED_DTYPES:
                hosted.append(i)
                tensors.append(tensor)
        self._fetch(op, action, where, hosted, tensors)

    def _fetch(self, op, action, where, hosted, tensors):
        """The plan's entry for a fetched routine; ``tensors`` (at positions
        ``hosted`` of its inputs) reach Python."""
        names = self._fetched_as(tensors)
        # (no `_Callback`: no node calls it; the plan calls the routine)
        inputs = op.inputs
        for tensor, source in zip(op.outputs, inputs):
            self._alias(tensor, self.name(source))
        self.fetched.append((action, where, len(inputs), hosted, names))

    def _fetched_as(self, tensors):
        """The names ``tensors`` are fetched by. A tensor is mostly observed
        twice (after its producer, before its reader): named and declared an
        output once."""
        names = []
        fetched = self._fetched_names
        for tensor in tensors:
            name = fetched.get(tensor)
            if name is None:
                name = fetched[tensor] = self.name(tensor)
                self._declare_output(tensor, name)
            names.append(name)
        return names

    def _declare_output(self, tensor, name):
        """Make ``name`` an output of the top graph (once; not for graph
        inputs and initializers, which `_FetchPlan` takes from the feed and
        the model)."""
        if self._undeclared(name):
            found = self._output_types.get(tensor, _UNTYPED)
            if found is _UNTYPED:
                found = self._type_of_output(tensor)
            # appended with the others in one merge (`_flush_outputs`)
            self._pending_outputs.append((name, found))

    def _declare_typed(self, name, onnx_type):
        """`_declare_output` of a name whose serialized type is known."""
        if self._undeclared(name):
            self._pending_outputs.append((name, onnx_type))

    def _undeclared(self, name):
        """Whether ``name`` is to be declared an output now (it then counts
        as one): not seen before, not an input, initializer or output."""
        if name in self._declared:
            return False
        self._declared.add(name)
        if name in self._inputs or name in self._weights_here or name in self._outputs:
            return False
        self._outputs.add(name)
        return True

    def _type_of_output(self, tensor):
        """The tensor's ``TypeProto`` serialized (the same bytes for the
        same message), or None."""
        onnx_type = self.onnx_type(tensor)
        if onnx_type is None:
            return None
        known = self._type_bytes.get(id(onnx_type))
        if known is None or known[0] is not onnx_type:
            known = self._type_bytes[id(onnx_type)] = (onnx_type, onnx_type.SerializeToString())
        return known[1]

    def _flush_outputs(self):
        """Append the outputs `_declare_output` declared to the top graph."""
        if self._pending_outputs:
            self.result.graph.MergeFromString(graph_outputs(self._pending_outputs))
            self._pending_outputs = []

    def name(self, tensor):
        name = self.names.get(tensor)
        if name is None:
            name = "" if tensor.attrs.get("absent") else self.resolve(tensor.name)
            self.names[tensor] = name
        return name

    def order_name(self, tensor):
        # waiting for a fused-away tensor would mean recomputing it: skip it
        return tensor.name if self.scope.visible(tensor.name) else None

    def resolve(self, name, scope=None):
        """The name of the user's tensor ``name`` in the result, recomputing
        it off the main dataflow when the optimiser removed it."""
        scope = scope or self.scope
        if name in scope.available:
            return name
        found = scope.recomputed.get(name)
        if found is not None:
            return found
        weight = scope.weights.get(name)
        if weight is not None:
            return self._copy_in(scope, name, weight)
        node = scope.producers.get(name)
        if node is None:
            if scope.outer is not None:   # a value of an enclosing graph
                return self.resolve(name, scope.outer)
            raise _NotSide(name)
        if node.domain in _DEFAULT_DOMAINS:
            # no node for a value known without running one: an Identity's
            # output is its input's value, a Constant's is its attribute
            # (an initializer then, which a fetched routine reads from the
            # plan and a hosted one as a view, `bind_weights`)
            if node.op_type == "Identity" and len(node.input) == 1 and node.input[0]:
                found = scope.recomputed[name] = self.resolve(node.input[0], scope)
                return found
            if node.op_type == "Constant":
                value = _constant_value(node)
                if value is not None:
                    return self._copy_in(scope, name, value)
        for attribute in node.attribute:
            if attribute.type in _BODY_KINDS:
                raise _NotSide(name)
        inputs = [self.resolve(i, scope) if i else "" for i in node.input]
        # made in place (appending a copy would copy it once more), after
        # the nodes it reads
        copy = scope.proto.node.add()
        copy.CopyFrom(node)
        copy.name = self.fresh(f"{node.name or node.op_type}/amanda.recomputed")
        del copy.input[:]
        copy.input.extend(inputs)
        outputs = []
        for output in node.output:
            if output:
                scope.recomputed[output] = self.fresh(f"{output}/amanda.recomputed")
            outputs.append(scope.recomputed.get(output, ""))
        del copy.output[:]
        copy.output.extend(outputs)
        return scope.recomputed[name]

    def _copy_in(self, scope, name, tensor):
        """Add a copy of ``tensor`` (a TensorProto) to the scope's graph as
        an initializer standing for the user's value ``name``; its fresh
        name."""
        copy = scope.proto.initializer.add()
        copy.CopyFrom(tensor)
        copy.name = scope.recomputed[name] = self.fresh(name)
        self.copied.add(copy.name)
        if scope.proto is self.result.graph:
            self._weights_here.add(copy.name)
        return copy.name


_DEFAULT_DOMAINS = ("", "ai.onnx")
_UNTYPED = object()

#: a Constant node's attributes other than ``value``: (element type, scalar)
_CONSTANT_LISTS = {"value_float": (onnx.TensorProto.FLOAT, True),
                   "value_floats": (onnx.TensorProto.FLOAT, False),
                   "value_int": (onnx.TensorProto.INT64, True),
                   "value_ints": (onnx.TensorProto.INT64, False),
                   "value_string": (onnx.TensorProto.STRING, True),
                   "value_strings": (onnx.TensorProto.STRING, False)}


def _constant_value(node):
    """The TensorProto a Constant node outputs, or None where it is not
    held in the node itself (a sparse value, external data)."""
    if len(node.attribute) != 1:
        return None
    attribute = node.attribute[0]
    if attribute.name == "value":
        tensor = attribute.t
        return None if tensor.data_location == onnx.TensorProto.EXTERNAL else tensor
    kind = _CONSTANT_LISTS.get(attribute.name)
    if kind is None:
        return None
    value = onnx.helper.get_attribute_value(attribute)
    values = [value] if kind[1] else list(value)
    return onnx.helper.make_tensor("", kind[0], [] if kind[1] else [len(values)], values)


def _sort_nodes_eagerly(proto, own):
    """Order the top graph so that every node after the first ``own`` (the
    side branches: host nodes, recomputations) comes as soon as its inputs
    exist, the model's nodes keeping their order otherwise; bodies are
    sorted as by `_sort_nodes`.

    Sessions that host observers run with ``ExecutionOrder.PRIORITY_BASED``
    (earliest listed ready node first), so each routine then runs right
    after the node producing its tensor: the tensor is released as early as
    in the plain run and each copy handed to Python lives for one call,
    instead of every observed tensor waiting for side branches that the
    default order runs last."""
    nodes, needs = _node_needs(proto)
    users = [[] for _ in nodes]
    pending = []
    for k, reads in enumerate(needs):
        for j in reads:
            users[j].append(k)
        pending.append(len(reads))
    ready = [(k < own, k) for k, count in enumerate(pending) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(k)
        for user in users[k]:
            pending[user] -= 1
            if pending[user] == 0:
                heapq.heappush(ready, (user < own, user))
    if len(order) == len(nodes) and order != list(range(len(nodes))):
        del proto.node[:]
        proto.node.extend(nodes[k] for k in order)


def bind_weights(data, graph, plan, weights, dropped, views=None):
    """Give `_SideBranches`' routines their weights: views over ``data`` (the
    serialized result, kept by the cache) where possible, else copies. Needs
    only the result's ``graph`` and the branches' ``plan``, ``weights`` and
    ``_dropped``: the branches (and the user's model) are freed before.
    ``views``: `initializer_views` of ``data`` the caller made already (for
    every initializer it holds), so ``data`` is not walked again."""
    if plan is not None:
        plan.bind(data, graph, views)
    names = {n for _, slots in weights for n in slots.values()}
    if not names:
        return
    values = _views_of(data, names, views)
    for initializer in graph.initializer:
        if initializer.name in names and initializer.name not in values:
            values[initializer.name] = numpy_helper.to_array(initializer)
    values.update((n, a) for n, a in dropped.items() if n in names)
    for callback, slots in weights:
        callback.constants = {i: _read_only(values[n]) for i, n in slots.items()}


def _views_of(data, names, views):
    """`initializer_views` of ``data`` for ``names``, taken from ``views``
    (made for all of its initializers) when given."""
    if views is None:
        return initializer_views(data, names)
    return {n: views[n] for n in names if n in views}


def _producers_and_weights(original):
    """(name -> producing NodeProto, name -> initializer) of a user's graph."""
    return ({o: n for n in original.node for o in n.output if o},
            {i.name: i for i in original.initializer})


class _Available:
    """Names of one graph of the optimised model (and the user's version of
    it; ``users``: its `_producers_and_weights` if made already)."""

    def __init__(self, proto, original, outer, users=None, available=None):
        self.proto = proto
        self.outer = outer
        if available is None:
            available = {i.name for i in proto.input} | {i.name for i in proto.initializer}
            for node in proto.node:
                available.update(o for o in node.output if o)
        self.available = available
        self.producers, self.weights = users or _producers_and_weights(original)
        self.recomputed = {}

    def visible(self, name):
        return name in self.available or (self.outer is not None and self.outer.visible(name))


class _PreparedSites:
    """The fetched routines of a top graph whose routines all observe at
    sites, prepared while onnxruntime optimises the model
    (`_SideBranches.prepare`): each distinct tensor once, as (its name in
    the user's model, None if absent; its serialized type), and per routine
    what its step (`_step`) needs but the tensors' names in the optimised
    model, which `fill` puts in. Holds nothing of the IR graph."""

    __slots__ = ("tensors", "_routines")

    def __init__(self, prepared, types):
        keys = {}
        self.tensors = tensors = []
        routines = []
        for op, (action, where, hosted, observed) in prepared.items():
            indices = []
            for tensor in observed:
                index = keys.get(tensor)
                if index is None:
                    index = keys[tensor] = len(tensors)
                    tensors.append((None if tensor.attrs.get("absent") else tensor.name,
                                    types.get(tensor)))
                indices.append(index)
            count = len(op.inputs)
            call, places = _calling(action, count, hosted, len(indices))
            routines.append((action, where, count, hosted, indices, call, places))
        self._routines = routines

    def fill(self, names):
        """``(entries, steps)`` for ``names``, those of `tensors` in the
        optimised model: per routine its ``(action, where, count, hosted,
        names)`` (as `_SideBranches.fetched`) and its `_step`."""
        entries, steps = [], []
        for action, where, count, hosted, indices, call, places in self._routines:
            observed = [names[i] for i in indices]
            entries.append((action, where, count, hosted, observed))
            steps.append((call, _placed(places, count, observed), action, where))
        return entries, steps


class _FetchPlan:
    """Observe-only routines called after the run, on the run's own buffers.

    The tensors the routines read are fetched as extra outputs of
    ``session.run``; onnxruntime hands its outputs to Python as NumPy arrays
    over its own buffers (no copy), and a graph output is never overwritten
    by a later node, so each tensor is the value its node produced. The
    routines are then called in program order on read-only views of them.
    Graph inputs are taken from the feed and initializers from the model
    (read once), so neither is copied per run.

    Each run has its own outputs and calls its own routines on the calling
    thread: concurrent runs never share anything but the (immutable) plan.

    Args:
        fetched: ``(action, where, tensor count, hosted positions, [tensor
            name per hosted position])`` per routine, in program order.
        proto: the top graph of the model the session runs (outputs added).
        outputs: the names of the model's own outputs.
        steps, names: the routines' `_step`s and the names they read (each
            once, in order), if known already (`_PreparedSites`).
    """

    __slots__ = ("extra", "outputs", "constants", "inputs", "_steps", "_fed", "_own",
                 "_fed_types", "read")

    def __init__(self, fetched, proto, outputs, steps=None, names=None):
        self.outputs = list(outputs)
        self._own = frozenset(self.outputs)
        self.inputs = {i.name for i in proto.input}
        if names is None:
            names = dict.fromkeys(n for *_, observed in fetched for n in observed)
        wanted = set(names)
        # filled by `bind` once the model is serialized
        self.constants = dict.fromkeys(i.name for i in proto.initializer if i.name in wanted)
        self.extra = [n for n in names if n not in self.inputs and n not in self.constants]
        # graph inputs the routines read (taken from the feed at each run)
        self._fed = [n for n in dict.fromkeys(wanted) if n in self.inputs]
        self._fed_types = {i.name: _element_type(i) for i in proto.input if i.name in wanted}
        #: the fetched names whose values the routines read
        self.read = frozenset(self.extra) | frozenset(self._fed)
        self._steps = steps if steps is not None else [_step(*routine) for routine in fetched]

    def bind(self, data, proto, views=None):
        """Read the observed initializers: views over ``data`` (the serialized
        model the session is created from, which the session cache keeps)
        where the wire format allows, copies from ``proto`` otherwise.
        ``views``: see `bind_weights`."""
        views = _views_of(data, self.constants, views)
        for initializer in proto.initializer:   # (``proto`` may hold only those)
            if initializer.name in self.constants and initializer.name not in views:
                views[initializer.name] = numpy_helper.to_array(initializer)
        for name, value in views.items():
            if self.constants[name] is None:
                self.constants[name] = _read_only(value)

    def fetches(self, output_names):
        """(names to fetch, how many of them the caller asked for)."""
        if not output_names:
            output_names = self.outputs
        names = list(output_names)
        for name in names:
            if name not in self._own:
                # one of amanda's extra outputs was answered: refuse it as plain does
                raise InvalidArgument(
                    f"[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Invalid output name:{name}")
        asked = set(names)
        names.extend(n for n in self.extra if n not in asked)
        return names, len(output_names)

    def call(self, values, feed):
        """Call every routine, in program order, on read-only views of ``values``
        (fetched name -> array), the feed and the model's initializers,
        through the one after-run loop
        (`amanda.runtime.routines.observe_after_run`).

        One read-only view per tensor and run is made up front; each routine
        gets a view of it of its own. A routine that receives no tensor is
        called directly (`_step`): no list, no view. The first routine that
        raises stops the loop: the routines before it have run, the ones
        after it do not, and its error is raised as the ToolError naming
        it."""
        views = self._views(values, feed) if self.constants or self.extra or self._fed else None
        observe_after_run(self._steps, views, _is_array)

    def _views(self, values, feed):
        """Read-only views of every tensor a routine reads in this run, by name."""
        views = dict(self.constants)
        for name in self.extra:
            views[name] = _read_only(values[name])
        for name in self._fed:
            value = values.get(name)
            if value is None:
                value = feed.get(name)
                if isinstance(value, ort.OrtValue):
                    value = value.numpy()
                elif value is not None and not isinstance(value, np.ndarray):
                    # as onnxruntime does (a list of floats was seen as float64)
                    value = np.asarray(value, self._fed_types.get(name))
            if value is not None:
                views[name] = _read_only(value)
        return views


def _element_type(value_info):
    """The NumPy dtype of a tensor input; None where it has none."""
    try:   # elem_type is 0 (undefined) for a non-tensor input
        return onnx.helper.tensor_dtype_to_np_dtype(value_info.type.tensor_type.elem_type)
    except (KeyError, ValueError):
        return None


def _drop_unread_initializers(proto, names, start=0):
    """Remove the initializers among ``names`` that no node reads (from
    the ``start``-th node of the top graph on; bodies always): a routine
    that observes a weight gets it from `_FetchPlan`, and onnxruntime
    refuses an unread initializer that is not a graph input (IR < 4).
    Returns their values (copies), by name."""
    if not names:
        return {}
    read = set()

    def collect(graph, start=0):
        nodes = graph.node
        for index in range(start, len(nodes)):
            node = nodes[index]
            read.update(node.input)
            for attribute in node.attribute:
                kind = attribute.type
                if kind == onnx.AttributeProto.GRAPH:
                    collect(attribute.g)
                elif kind == onnx.AttributeProto.GRAPHS:
                    for sub in attribute.graphs:
                        collect(sub)
    collect(proto, start)
    unread = set(names) - read
    if not unread:
        return {}
    dropped = {}
    initializers = proto.initializer
    # removed one by one from the end: rebuilding the list would copy
    # every kept weight
    for index in range(len(initializers) - 1, -1, -1):
        name = initializers[index].name
        if name in unread:
            dropped[name] = numpy_helper.to_array(initializers[index])
            del initializers[index]
    return dropped


def _step(action, where, count, hosted, names):
    """``(func, slots, action, where)``: how `observe_after_run` calls one
    routine of ``count`` tensors. A routine that receives no tensor and can
    only return None (`returns_only_none`; a counter's ``inputs=[]``) is
    called as ``func()``, its arguments bound here once (``None`` for each
    selected tensor Python cannot take, and its keyword arguments), ``slots``
    None; any other gets the views of ``names`` at its ``hosted`` positions
    (None elsewhere)."""
    call, places = _calling(action, count, hosted, len(names))
    return call, _placed(places, count, names), action, where


def _calling(action, count, hosted, observed):
    """What `_step` knows before the tensors' names: ``(func, places)`` for
    a routine whose ``observed`` tensors (at positions ``hosted``) reach
    Python; ``places`` False: it is called as ``func()``; None: the names
    are its slots; else the positions they go to (`_placed`)."""
    if observed or not returns_only_none(action.func):
        return _bound(action.func, (), action.kwargs), None if observed == count else hosted
    return _bound(action.func, (None,) * count, action.kwargs), False


def _placed(places, count, names):
    """The slots of a step (`_calling`'s ``places``) for ``names``."""
    if places is None:      # every tensor reaches Python
        return names
    if places is False:     # called as ``func()``
        return None
    slots = [None] * count
    for position, name in zip(places, names):
        slots[position] = name
    return slots


def _bound(func, args, kwargs):
    """``func`` with ``args`` and ``kwargs`` bound (``func`` itself when both
    are empty: a plain call is the cheapest)."""
    return functools.partial(func, *args, **kwargs) if args or kwargs else func


def _is_array(value):
    return isinstance(value, np.ndarray)


def _read_only(value):
    """A read-only view of ``value`` (the caller's array stays writable)."""
    view = np.asarray(value).view()
    view.flags.writeable = False
    return view


def _fetching_run(run, plan):
    """``session.run`` that fetches the plan's tensors and calls its routines
    (both take the session first, see `set_run`)."""
    def fetching(session, output_names, input_feed, run_options=None):
        names, asked = plan.fetches(output_names)
        results = run(session, names, input_feed, run_options)
        plan.call(dict(zip(names, results)), input_feed)
        return results[:asked]
    fetching.__wrapped__ = run
    return fetching


def _fetching_run_with_ort_values(run, plan):
    def fetching(session, output_names, input_dict_ort_values, run_options=None):
        names, asked = plan.fetches(output_names)
        results = run(session, names, input_dict_ort_values, run_options)
        # only the tensors the routines read become arrays: the user's own
        # outputs may have types numpy cannot hold (bfloat16, float8)
        plan.call({n: results[i].numpy() for i, n in enumerate(names) if n in plan.read},
                  input_dict_ort_values)
        return results[:asked]
    fetching.__wrapped__ = run
    return fetching


def _fetch_for(session, plan):
    """Make ``session`` call the plan's routines after each run, its extra
    outputs hidden from the user (``get_outputs``, ``run(None, ...)``)."""
    mine = set(plan.outputs)
    session._outputs_meta = [o for o in session._outputs_meta if o.name in mine]
    set_run(session, "run", _fetching_run(installed_run(session, "run"), plan))
    set_run(session, "run_with_ort_values", _fetching_run_with_ort_values(
        installed_run(session, "run_with_ort_values"), plan))
    for method in run_methods():
        if method not in ("run", "run_with_ort_values"):
            set_run(session, method, refused_run(
                method, "they are called after session.run (or run_with_ort_values) on the "
                "tensors it fetches. Use those, or create the session inside "
                "amanda.runtime.onnx.hosted_observation() to run the routines inside "
                "onnxruntime"))


def _fetches(graph):
    """Whether a session fetches the observed tensors of the lowered IR
    ``graph`` (see `observation_budget`) rather than hosting its routines."""
    budget = fetch_budget()
    return budget is not None and _observed_bytes(graph) <= budget


def _observed_bytes(graph):
    """Bytes of the computed tensors the top-level routines of ``graph`` read,
    each counted once; unknown dimensions count as 1, tensors of unknown type
    (not handed to routines) as 0."""
    return _observed(graph)[1]


def _observed(graph):
    """(a top-level routine of ``graph`` was recorded inside
    `hosted_observation`, `_observed_bytes`), in one walk: see
    `amanda.runtime.onnx.session._Instrumented`."""
    seen = set()
    total = 0
    timed = False
    for op in graph:
        if op.type != ROUTINE:
            continue
        # a timer (`Action.in_run`): the session then hosts its routines
        timed = timed or bool(getattr(op.attrs.get("action"), "in_run", False))
        for tensor in op.inputs:
            while tensor.producer is not None and tensor.producer.type == ROUTINE:
                tensor = tensor.producer.inputs[tensor.index]   # observers pass tensors on
            attrs = tensor.attrs
            if tensor in seen or attrs.get("absent") or attrs.get("initializer") is not None \
                    or tensor.producer is None:
                continue
            seen.add(tensor)
            dtype = attrs.get("dtype")
            if dtype is None or dtype not in _HOSTED_DTYPES:
                continue
            count = 1
            for dim in attrs.get("shape") or ():
                count *= dim if isinstance(dim, int) and dim > 0 else 1
            total += count * np.dtype(dtype).itemsize
    return timed, total


