"""TensorFlow graph mode: observe-only routines called after ``Session.run``.

A routine that can only return None (`returns_only_none`) at the top level
of a ``Session.run`` graph need not sit inside the graph as a
``tf.numpy_function``: the tensors it reads are fetched as extra fetches of
the shadow session's run, and the routine is called after the run, on
read-only arrays, once per run in which it would have run as a callback
(`_Observers`). No Python callback crosses into the run per op, and the
arrays are the run's own results (no copy), so the cost per point does not
grow with the tensor.

A routine that selects no tensor (a counter's ``inputs=[]``) is called
after the run too, with nothing fetched: it runs when its op does.

Routines stay hosted in the graph (``tensorflow_hosting``) where fetching is
impossible or would change what runs: in function bodies and ``tf.function``,
in graphs with v1 control flow (a tensor behind a ``Switch`` may be dead),
for tensors that cannot leave TensorFlow (resource, variant, string,
references), for routines recorded or rewritten inside
`amanda.runtime.observation.hosted_observation` (timing tools: `Action.in_run`),
and once the observed bytes of a graph exceed `observation_budget`.
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from amanda import portable
from amanda.passes.lower_actions import ROUTINE
from amanda.runtime.observation import fetch_budget
from amanda.runtime.routines import observe_after_run, returns_only_none
from amanda.runtime.tensorflow.bodies import _origin
from amanda.runtime.tensorflow.hosting import _crosses_to_python, _read_only

#: v1 control flow: a tensor behind a Switch may be dead, and fetching a dead
#: tensor fails the run
_V1_FLOW = frozenset({"Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit",
                      "RefExit", "NextIteration", "RefNextIteration", "LoopCond",
                      "ControlTrigger"})

_PLACEHOLDERS = frozenset({"Placeholder", "PlaceholderV2"})

_OBSERVING = ("before_op", "after_op", "before_backward_op", "after_backward_op")


class _Fetched:
    """One routine called after the run."""

    __slots__ = ("action", "where", "tensors", "after", "origins", "index", "readers",
                 "fetch_names", "also_run", "waits", "target")

    def __init__(self, action, where, tensors, after, origins, index, also_run, waits=None,
                 target=None):
        self.action = action
        self.target = target            # the user's op it instruments
        self.where = where
        self.tensors = tensors          # names of the copy's tensors it reads
        self.after = after              # an after point: fetching its tensor runs it
        self.origins = origins          # the user's tensors behind them
        self.index = index              # program order (realisation order: topological)
        self.readers = frozenset()      # copy ops whose execution means it runs
        self.fetch_names = frozenset()  # user tensors whose fetch means it runs
        self.also_run = also_run        # hosted bare before-routines it waits on
        # (copy ops, user tensor names) that run it whatever the lowered
        # graph says: a bare after-point's op, its readers and its tensors
        self.waits = waits or (frozenset(), frozenset())


class _Observers:
    """The observe-only routines of one ``Session.run`` graph that run after
    the run, and which of them each run calls (memoised per fetches and feeds).

    A fetched routine runs in a run exactly when its callback would have: when
    an op that would have read its results executes (found from the lowered
    graph: the op it instruments, that op's backward ops for a before point,
    the other consumers for an after point, through chains of routines), or
    when a fetched tensor would have been read through it (after points).
    """

    def __init__(self):
        self.enabled = False  # set for Session.run graphs (`_Shadow`)
        self.records = {}     # action -> _Fetched
        self.ran_by = {}      # action -> copy ops running a hosted or native routine
        self._version = None
        self.bytes = 0
        self._seen = set()    # names of observed tensors counted in `bytes`
        self._reads = {}      # observed tensor name -> name of the identity fetched for it
        self.v1_flow = False
        self._plans = {}
        # names of hosted callbacks only control edges tie to the run (bare
        # routines, and those that can only return None): `plan` names them
        # as a run's targets where the run executes them
        self.by_edges = set()
        # copy op running a hosted or native routine -> the user's op whose
        # point it is (`whole_points`)
        self.point_of = {}

    # -- while the graph is rewritten ---------------------------------------------

    def note_point(self, names, target):
        """The copy's ops ``names`` run a routine at a point of the user's op
        ``target``."""
        for name in names:
            self.point_of[name] = target

    def takes(self, op, action, inputs, portable):
        """Whether the routine of IR routine ``op`` is called after the run."""
        kind = op.attrs["kind"]
        if (portable or self.v1_flow or kind not in _OBSERVING or action.in_run
                or not returns_only_none(action.func)):
            # in_run: recorded inside hosted_observation() (a timer, ordered
            # next to its op by control edges in the run)
            return False
        inputs = [t for t in inputs if _crosses_to_python(t.dtype)]
        budget = fetch_budget()
        if budget is None:
            return False
        new = {t.name: _nbytes(t) for t in inputs if t.name not in self._seen}
        if self.bytes + sum(new.values()) > budget:
            return False
        self.bytes += sum(new.values())
        self._seen.update(new)
        return True

    def fetch(self, rewrite, op, action, where, inputs):
        """Take the routine of IR routine ``op`` (inputs: its tensors in the
        copy) to be called after the run, if it can be. Returns whether it
        was; then its results (its inputs, passed on) are recorded in
        ``rewrite`` as a hosted routine's would be."""
        if not self.enabled:
            return False
        graph = rewrite.user_graph
        if self._version != graph.version:
            self._version = graph.version
            # v1 control flow, or v1 reference variables: a tensor read from
            # one may share its buffer, which a later in-place update in the
            # same run changes before the run's end (resource variables copy
            # first while a reader holds the buffer)
            self.v1_flow = self.v1_flow or any(
                o.type in _V1_FLOW or any(t.dtype._is_ref_dtype for t in o.outputs)
                for o in graph.get_operations())
        if not self.takes(op, action, inputs, portable.is_portable(action.func)):
            return False
        if inputs:
            rewrite.hosted = True   # a fetched tensor may stop Grappler's rewrites too
        after = op.attrs["kind"].startswith("after")
        target = rewrite.user_graph.get_operation_by_name(op.attrs["target"])
        also_run = rewrite._bare_before.get(target.name, ())
        self.records[action] = _Fetched(
            action, where, [self._read(rewrite.copy, t) if _crosses_to_python(t.dtype) else None
                            for t in inputs], after,
            [_origin(t) for t in op.inputs], len(self.records), [o.name for o in also_run],
            _bare_after_waits(rewrite, target) if after else None, target.name)
        tensors = rewrite.realised[action] = list(inputs)
        rewrite._record_final(op, tensors)
        return True

    def _read(self, copy, tensor):
        """The name of an identity of ``tensor`` to fetch (made once)."""
        name = self._reads.get(tensor.name)
        if name is None:
            with copy.as_default():
                name = self._reads[tensor.name] = tf.identity(tensor, name="observed").name
        return name

    def link(self, lowered):
        """Find each fetched routine's readers in the lowered graph (done anew
        at every rewrite: new ops may read old routines' results).

        Args:
            lowered: the lowered IR graph (all routine ops of the graph).

        ``ran_by``: action -> names of the copy ops that run a hosted or
        native routine (absent or empty: the routine passes its tensors on).
        """
        self._plans.clear()
        if not self.records:
            return
        memo = {}

        def reach(ir_op):
            found = memo.get(ir_op)
            if found is not None:
                return found
            memo[ir_op] = (set(), set())   # a cycle cannot happen; guard anyway
            readers, names = set(), set()
            action = ir_op.attrs.get("action")
            record = self.records.get(action)
            if record is not None and record.after:
                names.update(record.origins)
            for tensor in ir_op.outputs:
                for user, _ in tensor.uses:
                    if user.type != ROUTINE:
                        readers.add(user.name)
                        continue
                    ops = self.ran_by.get(user.attrs.get("action"))
                    if ops:
                        readers.update(ops)
                    else:
                        more, more_names = reach(user)
                        readers |= more
                        names |= more_names
            memo[ir_op] = (readers, names)
            return readers, names

        after = {}   # target op -> (readers, fetch names) of its after-points
        for ir_op in lowered.ops:
            if ir_op.type != ROUTINE:
                continue
            action = ir_op.attrs.get("action")
            record = self.records.get(action)
            if record is not None:
                readers, names = reach(ir_op)
                record.readers = frozenset(readers) | record.waits[0]
                record.fetch_names = frozenset(names) | record.waits[1]
            if ir_op.attrs["kind"].startswith("after"):
                readers, names = after.setdefault(ir_op.attrs["target"], (set(), set()))
                if record is not None:
                    readers |= record.readers
                    names |= record.fetch_names
                else:
                    readers.update(self.ran_by.get(action, ()))
        for ir_op in lowered.ops:
            # a before-point passing no tensor (an op without inputs) runs
            # when its op does, and whenever the op's after-points run (a fed
            # placeholder): hosted, it is a control input of both
            record = self.records.get(ir_op.attrs.get("action")) if ir_op.type == ROUTINE else None
            if record is not None and not record.tensors and not record.after:
                readers, names = after.get(ir_op.attrs["target"], ((), ()))
                record.readers = frozenset(readers) | {ir_op.attrs["target"]}
                record.fetch_names = frozenset(names)

    # -- at each run ----------------------------------------------------------------

    def plan(self, copy, mapped, fetched_names, fed_names, gate, rewrite=None):
        """``(extra tensors to fetch, extra ops to run, calls)`` for a run of
        ``mapped`` (the copy's tensors and ops) fetching the user's tensors
        ``fetched_names`` with the copy's tensors ``fed_names`` fed; a call
        is ``(record, [position among the extra fetches per tensor])``.

        Rule: a hosted callback that only control edges tie to the run
        (`by_edges`) is run as a target of every run whose fetches it is an
        ancestor of (one ``NoOp`` per plan waiting on them, made by
        ``gate``). Grappler rewrites the graph before it runs: it removes
        ops (a ``Neg`` of a ``Neg``) and with them the control edges that
        made the callback an ancestor of the fetch, and TensorFlow then
        skipped it: 30 of 32 counters before a chain of negations never
        ran. A run's targets are kept."""
        key = (tuple(id(m) for m in mapped), fetched_names, fed_names)
        found = self._plans.get(key)
        if found is not None:
            return found
        if rewrite is None:
            executed, forced, whole = _executed(mapped, fed_names), [], frozenset()
        else:
            executed, forced, whole = whole_points(rewrite, mapped, fed_names)
        extra, positions, targets, calls = [], {}, list(forced), []
        waited = sorted(self.by_edges & executed)
        if waited:
            targets.extend(gate([copy.get_operation_by_name(name) for name in waited]))
        for record in sorted(self.records.values(), key=lambda r: r.index):
            if not (record.readers & executed or record.fetch_names & fetched_names
                    or record.target in whole):
                continue
            slots = []
            for name in record.tensors:
                if name is None:   # a tensor that cannot leave TensorFlow
                    slots.append(None)
                    continue
                if name not in positions:
                    positions[name] = len(extra)
                    extra.append(copy.get_tensor_by_name(name))
                slots.append(positions[name])
            targets.extend(copy.get_operation_by_name(n) for n in record.also_run)
            calls.append(_call_step(record, slots))
        found = self._plans[key] = (extra, list(dict.fromkeys(targets)), calls)
        return found

    @staticmethod
    def call(calls, values):
        """Call the routines in program order on read-only views of ``values``
        (the extra fetches' results), through the one after-run loop
        (`amanda.runtime.routines.observe_after_run`): a routine that
        receives no tensor is called with the arguments its plan step holds;
        the first routine that raises stops the loop with the ToolError
        naming tool, routine and op."""
        views = [_read_only(v) for v in values] if values else ()
        observe_after_run(calls, views, _is_array)


def _is_array(value):
    return isinstance(value, (np.ndarray, np.generic))


def _call_step(record, slots):
    """``(func, slots, action, where)`` for `observe_after_run`, ``func``
    with the routine's keyword arguments bound. When the routine receives no
    array (no tensor selected, or only tensors that cannot leave TensorFlow,
    passed as None) its positional arguments are bound too and ``slots`` is
    None: it is called as ``func()``; otherwise ``slots`` are positions
    among the extra fetches (None for a tensor that cannot leave)."""
    action = record.action
    func, kwargs = action.func, action.kwargs
    if all(s is None for s in slots):
        args = (None,) * len(slots)
        return (functools.partial(func, *args, **kwargs) if args or kwargs else func), None, \
            action, record.where
    return (functools.partial(func, **kwargs) if kwargs else func), tuple(slots), action, \
        record.where


def _bare_after_waits(rewrite, target):
    """``(copy ops, user tensor names)`` whose execution or fetch runs an
    after-routine of ``target``. Hosted, an after-routine runs after the
    op (reading its results, or waiting on it where it passes no tensor),
    every reader of the op's outputs or of the op itself waits on it, and a
    fetch of the op or of its tensors runs it (`_GraphRewrite._order`, ``tensor``,
    ``operation``): it runs when the op runs, or when a reader reads, or the
    caller fetches, a fed output of the op."""
    readers = {target.name}
    readers.update(c.name for output in target.outputs for c in output.consumers())
    readers.update(o.name for o in rewrite._waiting_on(target))
    return frozenset(readers), frozenset(t.name for t in target.outputs)


def _nbytes(tensor):
    count = 1
    for dim in (tensor.shape.as_list() if tensor.shape.rank is not None else ()):
        count *= dim if dim else 1
    try:
        size = np.dtype(tensor.dtype.as_numpy_dtype).itemsize
    except TypeError:
        size = 0
    return count * size


def whole_points(rewrite, elements, fed_names):
    """``(executed, forced, whole)`` for a run of ``elements`` (the copy's
    tensors and ops) with the copy's tensors ``fed_names`` fed: the names
    of the copy's ops it executes, the copy's ops to run as extra targets,
    and the user's ops those make run (all their points run).

    Rule: an op one of whose points runs in a run runs in it, with every
    point it has. A before-routine's results are read by more than its op:
    a backward op reads a forward input through the forward op's
    before-routines (the IR's rule), and an observing routine is waited on
    by its readers. When the forward op itself is not needed (the loss's
    ``y * y`` when only gradients are returned, a ``Conv2DBackpropInput``
    of the model's input), TensorFlow prunes it, and its before-routines
    ran without its after-routines: a counting tool saw one more before
    than after per step on every Keras model. Such an op (stateless, not
    fed, outside v1 control flow, whose frames a target may not cross) is
    run as a target of the run, and so are its after-routines.
    """
    executed = _executed(elements, fed_names)
    observers = rewrite.observers
    if rewrite._has_v1_flow() or not (observers.point_of or observers.records):
        return executed, [], frozenset()
    graph = rewrite.user_graph
    fed_ops = {name.split(":")[0] for name in fed_names}
    forced, whole, refused = [], set(), set()
    while True:
        targets = {observers.point_of[n] for n in executed if n in observers.point_of}
        targets.update(r.target for r in observers.records.values()
                       if r.target is not None and not r.after and r.readers & executed)
        missing = sorted(t for t in targets
                         if t not in executed and t not in whole and t not in refused)
        added = False
        for name in missing:
            try:
                user_op = graph.get_operation_by_name(name)
            except KeyError:
                refused.add(name)
                continue
            if user_op._is_stateful or user_op.type == "Placeholder" or name in fed_ops:
                refused.add(name)   # running it would change state, or it never runs
                continue
            more = [rewrite.operation(name), *rewrite._after_ops.get(name, ())]
            trial = _executed([*elements, *forced, *more], fed_names)
            copy = rewrite.copy
            if any(copy.get_operation_by_name(n).type in _PLACEHOLDERS
                   for n in trial - executed):
                refused.add(name)   # it reads a placeholder this run does not feed
                continue
            whole.add(name)
            forced.extend(more)
            executed = trial
            added = True
        if not added:
            return executed, list(dict.fromkeys(forced)), frozenset(whole)


def _executed(mapped, fed_names):
    """Names of the copy's ops a run of ``mapped`` executes: their ancestors,
    through data and control edges, a fed tensor's producer not reached
    through that tensor."""
    seen = set()
    stack = []
    for element in mapped:
        if hasattr(element, "op") and not hasattr(element, "node_def"):   # a tensor
            if element.name not in fed_names:
                stack.append(element.op)
        else:
            stack.append(element)
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        for tensor in op.inputs:
            if tensor.name not in fed_names and tensor.op.name not in seen:
                stack.append(tensor.op)
        for control in op.control_inputs:
            if control.name not in seen:
                stack.append(control)
    return frozenset(seen)
