"""How an ``amanda.routine`` op is written into the ONNX graph.

`RoutineNodes` is the part of :class:`amanda.runtime.onnx.lowering._Lowering`
that writes routines (it uses the lowering's names, types and node
helpers):

* a portable routine (``amanda.portable``) is traced and emitted as ONNX
  nodes (:mod:`amanda.runtime.onnx.portable`);
* any other routine becomes host nodes (:mod:`amanda.runtime.onnx.host`):
  ``AmandaPut`` per tensor, ``AmandaCall``, ``AmandaGet`` per result, on a
  token chain that keeps hosted routines in program order, also across the
  bodies of If/Loop/Scan. A routine that can only observe is a side branch:
  nothing reads its results back.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import numpy_helper

from amanda.errors import AmandaError, BackendError, describe
from amanda.passes.lower_actions import ROUTINE
from amanda.runtime.onnx.bodies import _bodies
from amanda.runtime.onnx.host import (_HOSTED_DTYPES, CALLBACK_DOMAIN, ORDER_SLOT, _Callback,
                                      _catalog, _register_callback)
from amanda.runtime.onnx.portable import NotNative, PortableEmitter
from amanda.runtime.routines import returns_only_none, routine_error


#: element types onnxruntime's CPU ``Size`` has no kernel for
_SIZELESS = frozenset({"bfloat16", "float8e4m3fn", "float8e4m3fnuz", "float8e5m2",
                       "float8e5m2fnuz", "float8e8m0", "uint4", "int4", "float4e2m1",
                       "uint2", "int2", "float6e2m3", "float6e3m2"})


class RoutineNodes:
    """Writing ``amanda.routine`` ops: mixed into `_Lowering`."""

    def _passes_through(self, routine, index):
        """Whether `_routine` will make output ``index`` of ``routine`` an alias
        of its input (the same decision, made before the routine is written)."""
        if routine.attrs["kind"].startswith("replace"):
            return False
        types = [None if t.attrs.get("absent") else self.tensor_type(t)[0]
                 for t in routine.inputs]
        func = routine.attrs["action"].func
        if self._portable_here(func) and None not in types:
            return False   # traced into nodes (an observer's outputs get copies)
        hosted = [t in _HOSTED_DTYPES for t in types]
        return not hosted[index] or not any(hosted) or returns_only_none(func)

    def _portable_here(self, func):
        """`_is_portable`, asked once per function per model written: a model
        holds one action per node and point, mostly of one routine (a new
        bound method object each time a tool names ``self.look``), and
        inference's verdict, which depends on the function and whether it is
        bound, is dearer than a look-up."""
        plain = getattr(func, "__func__", func)
        key = (id(plain), plain is not func)
        known = self.portability.get(key)
        if known is None or known[0] is not plain:
            known = self.portability[key] = (plain, _is_portable(func))
        return known[1]

    def _where(self, op, action):
        """(op type, op name, namespace) of the op a routine op instruments."""
        target = self.ops_by_name.get(op.attrs["target"])
        return (target.type if target is not None else None, op.attrs["target"],
                self.top.namespace)

    def _routine(self, op):
        action = op.attrs["action"]
        where = self._where(op, action)
        if self._portable_here(action.func):
            self.side_only = False
            try:
                return self._portable(op, action, where)
            except NotNative as why:
                if not self.callbacks:
                    raise _error(action, where, f"cannot be lowered to ONNX natively: {why}; "
                                 "an exported model cannot call back into Python") from None
                if _is_marked(action.func):   # an inferred one just stays hosted
                    warnings.warn(str(_error(action, where,
                                             f"runs as a Python callback: {why}")), stacklevel=2)
        elif not self.callbacks:
            raise _error(action, where, "is a Python routine and an exported ONNX model cannot "
                         "call back into Python; mark it @amanda.portable.routine and write it "
                         "with the portable vocabulary (docs/onnx.md)")
        return self._callback(op, action, where)

    def _portable(self, op, action, where):
        from amanda import portable
        specs = []
        for tensor in op.inputs:
            if tensor.attrs.get("absent"):
                raise NotNative("it selects an absent optional value")
            dtype, shape = self.tensor_type(tensor)
            if dtype is None:
                raise NotNative(f"the type of {self.name(tensor)!r} is unknown")
            specs.append((dtype, shape))
        try:
            traced = portable.trace(action.func, specs, kwargs=action.kwargs,
                                    name=describe(action.func))
        except AmandaError as exc:
            if not _is_marked(action.func):
                # an inferred verdict is amanda's guess, not the user's word:
                # a routine it cannot trace on this model's types is hosted
                raise NotNative(f"it cannot be traced here ({exc})") from exc
            raise _error(action, where, str(exc)) from exc
        outputs = list(traced.outputs)
        expected = len(op.outputs)
        if not outputs:   # observes only: nothing to compute in a graph
            for tensor, source in zip(op.outputs, op.inputs):
                self._alias(tensor, self.name(source))
            return
        if len(outputs) != expected:
            if not _is_marked(action.func):
                raise NotNative(f"its trace returned {len(outputs)} values for {expected} "
                                "tensors")
            raise _error(action, where, f"returned {len(outputs)} values for {expected} "
                         "tensors")
        PortableEmitter(self, op, where).emit(traced)

    def _alias(self, tensor, source_name):
        """Make ``tensor`` stand for the value named ``source_name``."""
        if tensor in self.names:   # named already (a graph output): copy the value
            self.add_node("Identity", [source_name], [self.names[tensor]], "amanda.identity")
        else:
            self.names[tensor] = source_name

    def _callback(self, op, action, where):
        """Host a Python routine: ``AmandaPut`` nodes hand each tensor to
        Python, ``AmandaCall`` runs the routine, ``AmandaGet`` nodes produce
        its results. A token threads through them so they run in that order,
        every run (custom Python ops are never constant-folded).

        A routine that cannot replace anything (it only ever returns None, or
        no tensor it selects reaches Python) is a *side branch*: its Put and
        Call nodes read the tensors, nothing reads them back, and the
        model's own dataflow is left as it was."""
        replacing = op.attrs["kind"].startswith("replace")
        inputs = list(op.inputs)
        in_types = [None if t.attrs.get("absent") else self.tensor_type(t)[0] for t in inputs]
        hosted = [i for i, t in enumerate(in_types) if t in _HOSTED_DTYPES]
        observe = not replacing and (not hosted or returns_only_none(action.func))
        if not observe:
            self.side_only = False
            self.inline = True
            holder = self.body_of
            if holder is not None and holder.type in ("Scan", "Loop") and not self.ranks_known:
                # found by trial: onnxruntime runs these bodies only if it
                # knows the rank of every body output when the session is
                # created, and a Python op's results (and what is computed
                # from them) have none; a Reshape to the original's shape
                # does not bring it back inside the body
                raise _error(action, where, f"may replace tensors inside the body of "
                             f"{holder.type} {holder.name!r}, whose outputs' shapes the model "
                             "does not declare (nor can onnx infer them): onnxruntime runs "
                             "such a body only when it knows them, and a Python routine's "
                             "results have none. Let the routine return only None (observing "
                             "routines run there), or declare the shapes of the body's "
                             "outputs in the model")
        if replacing:
            target = self.ops_by_name[op.attrs["target"]]
            out_types = [self.tensor_type(t)[0] for t in target.outputs]
            if len(hosted) != len(inputs) or any(t not in _HOSTED_DTYPES for t in out_types):
                raise _error(action, where, "replaces the op, but a Python routine can only be "
                             f"hosted for tensors of {', '.join(sorted(_HOSTED_DTYPES))} "
                             f"(inputs {in_types}, outputs {out_types})")
            results = list(enumerate(out_types))
        elif observe:
            results = []
            for tensor, source in zip(op.outputs, inputs):
                self._alias(tensor, self.name(source))
        else:
            results = [(i, in_types[i]) for i in hosted]
            for i, tensor in enumerate(op.outputs):
                if i not in hosted:
                    self._alias(tensor, self.name(inputs[i]))
        out_dtypes = [d for _, d in results]
        key = _register_callback(_Callback(action, where, len(inputs), hosted, out_dtypes,
                                           replacing, observe))
        _catalog()
        base = f"amanda.routine/{where[1]}"
        # Hosted routines run in program order (the IR's order: an op's
        # before-routines, then its after-routines, then the next op's), as
        # in eager execution: each chain starts where the previous routine's
        # call ended. Side branches are otherwise unordered and onnxruntime
        # schedules them as it likes (often last op first), which breaks
        # tools that pair routines across ops (e.g. an after-routine of the
        # last op that closes a step of values kept by earlier ones).
        token = self.last_token or self._chain_start(key)
        for slot, i in enumerate(hosted):
            token = self._host_node(f"AmandaPut_{in_types[i]}", [self.name(inputs[i]), token],
                                    f"{base}/put", f"{key}:{slot}")
        if not hosted:
            token = self._order(op, token, base, key)
        token = self.last_token = self._host_node("AmandaCall", [token], f"{base}/call", key)
        self.hosted += 1
        for slot, (i, dtype) in enumerate(results):
            name = self.name(op.outputs[i])
            self.add_node(f"AmandaGet_{dtype}", [token], [name],
                          f"{base}/get", domain=CALLBACK_DOMAIN, key=f"{key}:{slot}")
            self._declare_result(op.outputs[i], name)
        self.uses_callbacks = True

    def _declare_result(self, tensor, name):
        """Declare the type and shape of a hosted routine's result (those of
        the tensor it replaces: a replacement must keep them). A custom op's
        outputs have none otherwise, and onnxruntime needs them where a node
        reading them runs as its function's expansion (``CausalConvWithState``
        has no kernel of its own, ``LinearAttention``'s body is a ``Scan``
        whose outputs need shapes)."""
        if any(o.name == name for o in self.graph_proto.output):
            return
        info = self.value_info(tensor, name)
        if info.type.WhichOneof("value") is not None:
            self.graph_proto.value_info.append(info)

    def _order(self, op, token, base, key):
        """Make a routine that receives no tensor wait for its op.

        A before-routine waits for the op's computed inputs, an after-routine
        for its outputs, so that (e.g.) a timer runs next to the op rather
        than whenever the run starts. The chain reads only each tensor's
        ``Size`` (an int64 scalar that onnxruntime does not fold for
        computed tensors), never its data."""
        target = self.ops_by_name.get(op.attrs["target"])
        if target is None:
            return token
        kind = op.attrs["kind"]
        tensors = target.outputs[:1] if kind.startswith("after") else target.inputs
        for tensor in tensors:
            attrs = tensor.attrs
            if attrs.get("absent") or attrs.get("initializer") is not None \
                    or self.tensor_type(tensor)[0] is None:
                continue
            name = self.order_name(tensor)
            if name is None:
                continue
            size = self._size(tensor, name, f"{base}/order")
            token = self._host_node("AmandaPut_int64", [size, token], f"{base}/order",
                                    f"{key}:{ORDER_SLOT}")
        return token

    def _size(self, tensor, name, base):
        """An int64 scalar computed from the tensor named ``name`` (its
        ``Size``) for a token chain to wait on. onnxruntime's CPU ``Size``
        has no kernel for bfloat16, float8, 4-bit and smaller types: such a
        tensor is cast to float32 first (its values are never read)."""
        if self.tensor_type(tensor)[0] in _SIZELESS:
            cast = self.fresh(f"{base}.float")
            self.add_node("Cast", [name], [cast], f"{base}.cast", to=onnx.TensorProto.FLOAT)
            name = cast
        size = self.fresh(f"{base}.size")
        self.add_node("Size", [name], [size], base)
        return size

    def order_name(self, tensor):
        """The name a routine that waits for ``tensor`` reads (None: do not wait)."""
        return self.name(tensor)

    def _host_node(self, op_type, inputs, name, key):
        self.host_nodes += 1
        token = self.fresh(f"{name}.token")
        self.add_node(op_type, inputs, [token], name, domain=CALLBACK_DOMAIN, key=key)
        return token

    def _chain_start(self, key):
        """The token the first hosted routine of the graph being written starts from.

        At top level the constant 0 (the chain draws its id). In a body, a
        constant 0 too (a Constant node: a body's inputs are positional and
        IR < 4 would list initializers there), forked from the enclosing
        chain at the holding node: the first Put reads the outer token, so
        the body's routines run after the holding node's before-routines
        (the node itself then waits for them), but draws a chain id of its
        own, so each execution of the body (each Loop iteration) hands its
        tensors over on a chain no other routine uses.
        """
        if not self.nested:
            return self._trigger()
        zero = self.fresh("amanda.zero")
        self.add_node("Constant", [], [zero], "amanda.zero",
                      value=numpy_helper.from_array(np.array(0, np.int64)))
        if self.outer_token is None:
            return zero
        return self._host_node("AmandaPut_int64", [self.outer_token, zero], "amanda.fork",
                               f"{key}:{ORDER_SLOT}")

    def _join(self, op):
        """After a node whose bodies host routines, the graph's next routine
        waits for the node's first output (so for every execution of its
        bodies): routines stay in program order across bodies."""
        for tensor in op.outputs:
            if tensor.attrs.get("absent") or self.tensor_type(tensor)[0] is None:
                continue
            name = self.order_name(tensor)
            if name is None:
                return
            size = self._size(tensor, name, f"{op.name}/amanda.join")
            token = self.last_token or self._chain_start("amanda.join")
            self.last_token = self._host_node("AmandaPut_int64", [size, token],
                                              f"{op.name}/amanda.join",
                                              f"amanda.join:{ORDER_SLOT}")
            return

    def _trigger(self):
        """An int64 scalar initializer that starts every token chain."""
        names = {t.name for t in self.graph_proto.initializer}
        name = next((n for n in names if n.startswith("amanda.trigger")), None)
        return name or self.add_initializer(np.array(0, np.int64), "amanda.trigger")


def observes_only(graph, bodies=True):
    """Whether writing ``graph`` would make every routine in it (bodies
    included) an observe-only hosted side branch: what `_Lowering` says with
    ``side_only`` and ``uses_callbacks`` after `_Lowering.model`, decided
    before any node is written (the same tests as `RoutineNodes._routine`
    and `RoutineNodes._callback`). False when there is no routine, or one is
    portable (traced into nodes), replaces its op, or may return a hosted
    tensor. A session whose routines all observe runs its side branches on
    onnxruntime's optimised model (`_SideBranches`), so it writes nothing
    else. ``bodies``: whether ops of ``graph`` may hold If/Loop/Scan bodies
    (False skips looking for them)."""
    found = False
    portable = {}
    stack = [graph]
    while stack:
        for op in stack.pop().ops:
            if op.type != ROUTINE:
                if bodies:
                    stack.extend(body for _, body in _bodies(op))
                continue
            found = True
            action = op.attrs["action"]
            func = action.func
            plain = getattr(func, "__func__", func)
            key = (id(plain), plain is not func)
            known = portable.get(key)
            if known is None:   # (plain is kept alive by the action: no id is reused)
                known = portable[key] = (_is_portable(func), returns_only_none(func))
            if op.attrs["kind"].startswith("replace") or known[0]:
                return False
            if not known[1] and any(_dtype(t) in _HOSTED_DTYPES for t in op.inputs):
                return False
    return found


def _dtype(tensor):
    """A routine input's element type as `_Lowering.tensor_type` finds it
    (through observing routines to what they pass on; None: unknown)."""
    while not tensor.attrs.get("absent"):
        dtype = tensor.attrs.get("dtype")
        producer = tensor.producer
        if dtype is not None or producer is None or producer.type != ROUTINE \
                or producer.attrs["kind"].startswith("replace"):
            return dtype
        tensor = producer.inputs[tensor.index]
    return None


def _is_portable(func):
    try:
        from amanda import portable
    except ImportError:
        return False
    return portable.is_portable(func)


def _is_marked(func):
    from amanda import portable
    return portable.explain(func).how == "marked"


def _error(action, where, message):
    return BackendError(str(routine_error(action, where, message,
                                          what=f"routine {describe(action.func)} ({action.kind})")))
