"""Differential test harness for the PyTorch eager runtime (issue 11, "trust
the eager runtime").

Hypothesis draws random PyTorch programs (``tests/eager_programs.py``): trees
of ``nn.Module`` classes (nested modules, ``nn.Sequential``/``ModuleList``/
``ModuleDict``, shared submodules called twice and aliased, modules whose
``forward`` is a generator and loops over generators of layers), functional
calls inside and outside modules (``torch.relu``, ``x + 1``, ``F.linear``,
``torch.cat``, ``x.T``, in-place ``x.add_(1)``/``x += 0.5``, ``x[0] = y``),
branches taken at some steps only (step-dependent and data-dependent ``if``),
``amanda.disabled()`` blocks (with ``amanda.enabled()`` nested inside, at top
level and around a whole model call), ``torch.no_grad()``, activation
checkpointing (``use_reentrant=True`` and ``False``), nested ``amanda.apply``
scopes adding a tool, an SGD step, and a second call site of the model (an
"eval" line, with or without ``no_grad``). Each program runs 4 steps of
forward + backward, under one ``apply`` scope or one scope per step.

The checks, one test each, against DESIGN.md's contract:

(a) ``test_cache_rule``: the executions of (op id, point) seen by the
    inserted routines of a recording tool (all four points, or some; all ops,
    or only some op names, so that steps without actions exist) are the same,
    step by step, with the cache and under ``amanda.cache_disabled()``.
(b) ``test_disabled_rule``: a program with ``disabled()`` blocks records what
    the same program without the blocks records (the variant renders the
    block's statements as ``pass`` on the same lines, keeping
    ``enabled()`` parts): nothing inside, and everything after the block as if
    it had not run. Forward executions compare as sequences, backward ones as
    multisets per step.
(c) ``test_identity_is_bit_exact``: identity routines at all four points,
    returning the very tensors or clones of them, leave outputs, parameter
    gradients and the input's gradient bit-identical (``torch.equal``) to the
    vanilla run. (Inputs of in-place ops are not replaced by clones: the op
    would then update the clone, by definition.)
(d) ``test_backend_state_is_restored``: after ``apply`` — normally and when a
    tool raises inside it, in analysis of any point, also from a nested scope
    — the torch-function mode stack, the global module hooks, every module's
    hooks, grad mode and amanda's control state are as before, and a later run
    records exactly what a run before did.
(e) ``test_op_ids_and_points``: ops inside modules get the same ids from the
    train call site and the eval call site; every forward op computes a tensor
    (``__setitem__`` aside; no ``_set_grad_enabled``,
    ``_record_function_enter_new``...); every execution with a before-routine
    also runs its after-routine (forward and backward).
(f) ``test_checkpoint_keeps_op_ids``: with checkpointing, the forward op ids
    (and backward op ids) of a step are those of the same program without
    checkpointing, and recomputed ops reuse ids of their first execution.

Budget: ``EXAMPLES`` programs per check (620 examples, each two to four runs of
4 steps; about 0.1 s an example, so about 1.5 minutes on a busy 2-core machine
when the checks pass, longer while hypothesis shrinks a failure). ``test_sweep`` (marked slow) runs every check on
5x more programs. Tensors are 4x4; ``derandomize=True`` makes runs
reproducible; a failure prints the program's source.
"""

import collections
import dataclasses
import os
import warnings

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, assume, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import amanda  # noqa: E402
from amanda import controls  # noqa: E402
from amanda.errors import AmandaError  # noqa: E402
from tests.eager_programs import MODULE_OPS, by_step, programs, run, statements  # noqa: E402

EXAMPLES = {"cache": 120, "disabled": 120, "identity": 100, "state": 80, "ids": 100,
            "checkpoint": 100}
# `make test` runs half of these (a fixed sample: the examples are
# derandomized), `make sweep` (AMANDA_TORCH_SWEEP=1) all of them, to keep
# CI within its time. AMANDA_HARNESS_SCALE=0.1 for a quick look, =10 for a
# long hunt.
_SCALE = float(os.environ.get("AMANDA_HARNESS_SCALE",
                              "1" if os.environ.get("AMANDA_TORCH_SWEEP") == "1" else "0.5"))
EXAMPLES = {k: max(1, round(v * _SCALE)) for k, v in EXAMPLES.items()}

COMMON = dict(deadline=None, derandomize=True, database=None, print_blob=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])

FB, FA, BB, BA = "fwd_before", "fwd_after", "bwd_before", "bwd_after"
ALL_POINTS = (FB, FA, BB, BA)
POINT_SETS = [ALL_POINTS, (FB,), (FA,), (BB, BA), (FB, BA), (BA,)]
# Names a selective tool picks from (a program without any of them has
# steps with no action at all: the runtime may then go fast).
SELECTABLE = ["relu", "linear", "tanh", "layer_norm", "__add__", "__mul__", "__rmul__",
              "__getitem__", "__setitem__", "add_", "__iadd__", "cat", "clone", "sum",
              "__gt__", "sigmoid", "__matmul__", "T", "mean", "__sub__"]
# Names of calls that compute no tensor and so must never be ops.
NON_TENSOR_CALLS = {"_set_grad_enabled", "set_grad_enabled", "is_grad_enabled",
                    "_record_function_enter_new", "_record_function_exit",
                    "_record_function_enter", "__enter__", "__exit__", "is_inference_mode_enabled"}
IN_PLACE_FREE = {"__setitem__"}   # in-place ops that return None


def _in_place(name):
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__")) \
        or (name.startswith("__i") and name.endswith("__") and name not in ("__invert__",
                                                                            "__index__",
                                                                            "__int__"))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny tensors: threads only add contention
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # checkpoint's "None of the inputs require grad"
        yield


# -- tools ------------------------------------------------------------------------------


class Recorder(amanda.Tool):
    """Inserts at every selected op and point a routine that appends
    ``(tag, point, id, name, extra)`` to ``log`` each time it runs (forward:
    op id, op name, module path; backward: backward op id, node name, forward op
    id). ``outputs`` maps each forward op to its number of tensor outputs
    (from the after-analysis)."""

    def __init__(self, log, tag="outer", points=ALL_POINTS, names=None, routine=None):
        super().__init__()
        self.log, self.tag, self.names = log, tag, names
        self.outputs = {}
        self.routine = routine or self.record
        if FB in points:
            self.add_inst_for_op(self.forward_before)
        if FA in points:
            self.add_inst_for_op(self.forward_after, require_outputs=True)
        if BB in points:
            self.add_inst_for_op(self.backward_before, backward=True)
        if BA in points:
            self.add_inst_for_op(self.backward_after, backward=True, require_outputs=True)

    def wanted(self, context):
        return self.names is None or context.get_op_name() in self.names

    def forward_key(self, context, point):
        return (self.tag, point, context.get_op_id(), context.get_op_name(),
                context.get_module_path())

    def backward_key(self, context, point):
        return (self.tag, point, context.get_backward_op_id(), context.get_backward_op().__name__,
                context.get_op_id())

    def forward_before(self, context):
        if self.wanted(context):
            context.insert_before_op(self.routine, key=self.forward_key(context, FB))

    def forward_after(self, context):
        outputs = context.get_outputs()
        self.outputs[(context.get_op_id(), context.get_op_name())] = \
            sum(isinstance(t, torch.Tensor) for t in outputs)
        if self.wanted(context):
            context.insert_after_op(self.routine, key=self.forward_key(context, FA))

    def backward_before(self, context):
        if self.wanted(context):
            context.insert_before_backward_op(self.routine, key=self.backward_key(context, BB))

    def backward_after(self, context):
        if self.wanted(context):
            context.insert_after_backward_op(self.routine, key=self.backward_key(context, BA))

    def record(self, *tensors, key):
        self.log.append(key)


class Identity(Recorder):
    """Routines that return their tensors (``clone=False``) or clones of them;
    they also record, so the test knows they ran."""

    def __init__(self, log, clone, tag="outer"):
        super().__init__(log, tag, routine=self.same)
        self.clone = clone

    def same(self, *tensors, key):
        self.log.append(key)
        if not self.clone or (key[1] == FB and _in_place(key[3])) \
                or (key[1] == FA and key[3] in IN_PLACE_FREE):   # no output to replace
            return tensors
        return [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors]


class Boom(Exception):
    pass


class Raiser(Recorder):
    """Raises ``Boom`` in the ``at``-th analysis call at ``point``."""

    def __init__(self, log, point, at, tag="raiser"):
        super().__init__(log, tag)
        self.point, self.at, self.calls = point, at, 0

    def maybe_raise(self, point):
        if point == self.point:
            self.calls += 1
            if self.calls == self.at:
                raise Boom(f"boom at {point} #{self.at}")

    def forward_before(self, context):
        self.maybe_raise(FB)
        super().forward_before(context)

    def forward_after(self, context):
        self.maybe_raise(FA)
        super().forward_after(context)

    def backward_before(self, context):
        self.maybe_raise(BB)
        super().backward_before(context)

    def backward_after(self, context):
        self.maybe_raise(BA)
        super().backward_after(context)


# -- helpers -----------------------------------------------------------------------------


def valid(program, **kw):
    """Reject programs that fail without amanda (e.g. a reentrant checkpoint
    of a module whose output needs no grad: torch raises in backward)."""
    try:
        return run(program, **kw)
    except Exception as e:  # noqa: BLE001
        note(f"vanilla run raised {e!r}")
        assume(False)


def record(program, points=ALL_POINTS, names=None, **kw):
    """Run with a fresh Recorder (and a fresh inner Recorder for nested scopes)."""
    log = []
    tool = Recorder(log, points=points, names=names)
    inner = Recorder(log, tag="inner", points=points, names=names)
    result = run(program, tool, inner, log=log, **kw)
    result.tool = tool
    result.inner = inner
    return result


def describe(entry):
    if entry[0] in ("mark", "step"):
        return f"{entry[0]} {entry[1]}"
    tag, point, op_id, name, extra = entry
    return f"{tag:5} {point:10} {name:24} id={op_id} {'' if extra is None else extra!r}"


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def assert_same_sequence(got, want, what, step):
    if got == want:
        return
    i = first_difference(got, want)
    lo = max(0, i - 3)
    lines = [f"{what}, step {step}: first difference at entry {i} "
             f"(lengths {len(got)} vs {len(want)})"]
    lines += ["   got : " + describe(e) for e in got[lo:i + 4]]
    lines += ["   want: " + describe(e) for e in want[lo:i + 4]]
    raise AssertionError("\n".join(lines))


def assert_same_multiset(got, want, what, step):
    got_c, want_c = collections.Counter(got), collections.Counter(want)
    if got_c == want_c:
        return
    extra = list((got_c - want_c).elements())
    missing = list((want_c - got_c).elements())
    lines = [f"{what}, step {step}:"]
    lines += ["   unexpected: " + describe(e) for e in extra[:6]]
    lines += ["   missing   : " + describe(e) for e in missing[:6]]
    raise AssertionError("\n".join(lines))


def forward_only(entries):
    return [e for e in entries if e[0] == "mark" or e[1] in (FB, FA)]


def backward_only(entries):
    return [e for e in entries if e[0] != "mark" and e[1] in (BB, BA)]


def between(entries, start, stop):
    """Entries after ("mark", start) up to ("mark", stop)."""
    out, on = [], False
    for e in entries:
        if e[0] == "mark":
            if e[1] == start:
                on = True
                continue
            if e[1] == stop and on:
                break
        elif on:
            out.append(e)
    return out


_MODULE = torch.nn.modules.module
_GLOBAL_HOOKS = sorted(n for n in dir(_MODULE) if n.startswith("_global_") and
                       isinstance(getattr(_MODULE, n), dict))
_MODULE_HOOKS = ["_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
                 "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
                 "_forward_hooks_always_called", "_state_dict_hooks", "_load_state_dict_pre_hooks"]


def backend_state():
    c = controls.state
    return {
        "torch function mode stack": torch._C._len_torch_function_stack(),
        "mode stack": [type(m).__name__ for m in
                       torch.overrides._get_current_function_mode_stack()],
        "grad enabled": torch.is_grad_enabled(),
        "global module hooks": {n: dict(getattr(_MODULE, n)) for n in _GLOBAL_HOOKS},
        "amanda controls": (c.disabled, c.cache, c.ad, list(c.sessions)),
    }


def module_hooks(model):
    return {(name, h): dict(getattr(m, h)) for name, m in model.named_modules(
        remove_duplicate=False) for h in _MODULE_HOOKS if getattr(m, h, None)}


def assert_state(before, after, context):
    for key in before:
        assert after[key] == before[key], f"{context}: {key} {before[key]!r} became {after[key]!r}"


def repair(before):
    """Put torch and amanda back as ``before`` (a leak must fail one example,
    not every later one)."""
    while torch._C._len_torch_function_stack() > before["torch function mode stack"]:
        torch._C._pop_torch_function_stack()
    for name, hooks in before["global module hooks"].items():
        live = getattr(_MODULE, name)
        live.clear()
        live.update(hooks)
    c = controls.state
    c.disabled, c.cache, c.ad, c.sessions = False, True, False, []
    torch._C._set_grad_enabled(before["grad enabled"])
    import amanda.runtime.pytorch.eager.segments as driver   # its per-thread state, if any
    if getattr(driver, "_tls", None) is not None and hasattr(driver._tls, "state"):
        del driver._tls.state


def isolated(f):
    """Every example starts from and must end in the pristine backend state."""
    def wrapper(*args, **kwargs):
        before = backend_state()
        try:
            f(*args, **kwargs)
        finally:
            after = backend_state()
            if after != before:
                repair(before)
        assert_state(before, after, "after the example (state leaked)")
    wrapper.__name__, wrapper.__qualname__ = f.__name__, f.__qualname__
    wrapper.__signature__ = __import__("inspect").signature(f)
    return wrapper


def hyp(n, *strategies):
    def wrap(f):
        return settings(max_examples=n, **COMMON)(given(*strategies)(isolated(f)))
    return wrap


points_st = st.sampled_from(POINT_SETS)
names_st = st.none() | st.frozensets(st.sampled_from(SELECTABLE), min_size=1, max_size=3)


# -- (a) the cache rule -----------------------------------------------------------------------

def check_cache_rule(program, points, names, per_step):
    valid(program)
    cached = record(program, points, names, per_step=per_step)
    uncached = record(program, points, names, per_step=per_step, cache=False)
    a, b = by_step(cached.log), by_step(uncached.log)
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_same_sequence(x, y, "cached (got) vs cache_disabled (want)", i)


@hyp(EXAMPLES["cache"], programs(), points_st, names_st, st.booleans())
def test_cache_rule(program, points, names, per_step):
    note(f"points={points} names={names and sorted(names)} per_step={per_step}")
    check_cache_rule(program, points, names, per_step)


# -- (b) disabled() ------------------------------------------------------------------------------

def has_disabled(program):
    return program.has("disabled") or program.step.disabled_call


def check_disabled_rule(program, points, names, per_step):
    # No optimizer step: parameters used only inside a disabled block get
    # gradients (through h + 0 * side) that the variant without the block
    # cannot give them, and SGD skips parameters without one.
    program = dataclasses.replace(program, step=dataclasses.replace(program.step,
                                                                    optimizer=False))
    assume(not enabled_block_branches_on_data(program))
    valid(program)
    valid(program, disabled=False)
    # Recomputations run whole: torch stops a non-reentrant one once the
    # saved tensors it needs are back, and the disabled statements' own saved
    # tensors move that point (an op's after-routines then run in one variant
    # and not in the other, as documented), which is torch's, not amanda's.
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        got = record(program, points, names, per_step=per_step)
        want = record(program, points, names, per_step=per_step, disabled=False)
    a, b = by_step(got.log), by_step(want.log)
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_same_sequence(forward_only(x), forward_only(y),
                             "forward, with disabled() blocks (got) vs without them (want)", i)
        got_b, want_b = backward_only(x), backward_only(y)
        if disabled_block_uses_a_parameter(program):
            # A parameter's gradient accumulator is one autograd node, shared
            # by every graph that uses the parameter: where an instrumented op
            # owns it, it has points whenever it runs, also for the gradient
            # of a disabled block's call of the same module (docs, known
            # limits). The variant without the block lacks those runs.
            extra = collections.Counter(got_b) - collections.Counter(want_b)
            assert all(e[3] == "AccumulateGrad" for e in extra), extra
            got_b = list((collections.Counter(got_b) - extra).elements())
        assert_same_multiset(got_b, want_b,
                             "backward, with disabled() blocks (got) vs without them (want)", i)


def disabled_block_uses_a_parameter(program):
    """Whether a disabled block uses a parameter: calls a module, or an op
    on ``self.w`` (``F.linear(side, self.w)``)."""
    def calls(body, inside):
        for s in body:
            if inside and (s.attr is not None or s.op in MODULE_OPS):
                return True
            if calls(s.body, inside or s.kind == "disabled") or calls(s.orelse, inside):
                return True
    top = program.step.pre + program.step.post + \
        ([program.step.top_disabled] if program.step.top_disabled else [])
    return any(calls(m.body, False) for m in program.modules) or bool(calls(top, False))


@hyp(EXAMPLES["disabled"], programs(force={"disabled"}), points_st, names_st, st.booleans())
def test_disabled_rule(program, points, names, per_step):
    note(f"points={points} names={names and sorted(names)} per_step={per_step}")
    check_disabled_rule(program, points, names, per_step)


# -- (c) identity routines -----------------------------------------------------------------------

def check_identity(program, clone, per_step):
    vanilla = valid(program)
    log = []
    tool, inner = Identity(log, clone), Identity(log, clone, tag="inner")
    got = run(program, tool, inner, log=log, per_step=per_step)
    assert any(e[0] not in ("mark", "step") for e in log), "no routine ran"
    for i, (x, y) in enumerate(zip(got.outputs, vanilla.outputs)):
        assert torch.equal(x, y), f"step {i}: output differs\n{x}\nvs vanilla\n{y}"
    names = [n for n, _ in got.model.named_parameters()] + ["<input>"]
    for i, (gs, vs) in enumerate(zip(got.grads, vanilla.grads)):
        for name, g, v in zip(names, gs, vs):
            assert (g is None) == (v is None), f"step {i}: gradient of {name}: {g} vs vanilla {v}"
            assert g is None or torch.equal(g, v), \
                f"step {i}: gradient of {name} differs\n{g}\nvs vanilla\n{v}"


@hyp(EXAMPLES["identity"], programs(), st.booleans(), st.booleans())
def test_identity_is_bit_exact(program, clone, per_step):
    note(f"clone={clone} per_step={per_step}")
    check_identity(program, clone, per_step)


# -- (d) backend state -----------------------------------------------------------------------------

def check_state(program, point, at, nested, per_step):
    valid(program)
    before = backend_state()
    first = record(program, per_step=per_step)
    assert_state(before, backend_state(), "after a normal run")
    assert module_hooks(first.model) == {}, "modules kept hooks after apply"

    log = []
    if nested:
        tool, inner = Recorder(log), Raiser(log, point, at)
    else:
        tool, inner = Raiser(log, point, at), Recorder(log, tag="inner")
    result = run(program, tool, inner, log=log, per_step=per_step, catch=True)
    if result.error is not None:
        chain, e = [], result.error
        while e is not None:
            chain.append(e)
            e = e.__cause__ or e.__context__
        assert any(isinstance(e, Boom) for e in chain), f"unexpected error {result.error!r}"
        assert any(isinstance(e, AmandaError) for e in chain), \
            f"the tool's exception reached the user as {result.error!r}, not an amanda error"
    assert_state(before, backend_state(), f"after a tool raised ({result.error!r})")
    assert module_hooks(result.model) == {}, "modules kept hooks after a tool raised"

    again = record(program, per_step=per_step)
    assert_state(before, backend_state(), "after a run following the error")
    for i, (x, y) in enumerate(zip(by_step(again.log), by_step(first.log))):
        assert_same_sequence(x, y, "run after a tool raised (got) vs run before (want)", i)


@hyp(EXAMPLES["state"], programs(), st.sampled_from(ALL_POINTS), st.integers(1, 40),
     st.booleans(), st.booleans())
def test_backend_state_is_restored(program, point, at, nested, per_step):
    note(f"raise at {point} #{at} nested={nested} per_step={per_step}")
    check_state(program, point, at, nested, per_step)


# -- (e) op ids, non-tensor calls, paired points ----------------------------------------------------

def check_ids_and_points(program, per_step):
    valid(program)
    result = record(program, per_step=per_step)
    outputs = {**result.tool.outputs, **result.inner.outputs}
    bad = sorted({name for (_, name), n in outputs.items() if n == 0 and name not in IN_PLACE_FREE}
                 | {e[3] for e in result.log if e[0] != "mark" and e[0] != "step"
                    and e[1] in (FB, FA) and e[3] in NON_TENSOR_CALLS})
    assert not bad, f"calls that compute no tensor were taken for ops: {bad}"
    no_tensor = {key for key, n in outputs.items() if n == 0 and key[1] not in IN_PLACE_FREE}

    def module_ops(entries):
        return [e[2:] for e in entries if e[0] == "outer" and e[1] == FB
                and e[4] is not None and e[2:4] not in no_tensor]

    for i, entries in enumerate(by_step(result.log)):
        # every execution with a before-routine runs its after-routine; in
        # the backward pass, torch's non-reentrant checkpoint stops a
        # recomputation by raising inside the last op it needs (vanilla
        # behaviour): that op may run "before" once more than "after"
        backward_pass = between(entries, "backward", "eval")
        for part, slack in ((between(entries, "pre", "backward") + between(entries, "eval", "end"),
                             0), (backward_pass, 1)):
            for before, after in ((FB, FA), (BB, BA)):
                counts = collections.Counter()
                for e in part:
                    if e[1] in (before, after):
                        counts[(e[0], e[2], e[3], e[1])] += 1
                for (tag, op_id, name, point), n in counts.items():
                    if point != before:
                        continue
                    m = counts.get((tag, op_id, name, after), 0)
                    ok = m == n or (before == FB and 0 < n - m <= slack)
                    assert ok, (f"step {i}: {name} (id {op_id}) ran its {before} routine {n} "
                                f"times and its {after} routine {m} times")
        if program.step.eval_site is not None:
            train = module_ops(between(entries, "train", "dcall"))
            ev = module_ops(between(entries, "eval", "opt"))
            assert_same_sequence(
                [("outer", FB) + e for e in ev], [("outer", FB) + e for e in train],
                "ops inside modules: the eval call site (got) vs the train call site (want)", i)


@hyp(EXAMPLES["ids"], programs(), st.booleans())
def test_op_ids_and_points(program, per_step):
    note(f"per_step={per_step}")
    check_ids_and_points(program, per_step)


# -- (f) checkpointing ---------------------------------------------------------------------------

def _child_module(program, module, attr):
    """The ModuleSpec a child attribute of ``module`` holds (aliases
    ``self.cX = self.cY`` followed), or None (a leaf, a list)."""
    children = dict(module.children)
    expr = children.get(attr)
    for _ in range(len(children)):
        if expr is None or not expr.startswith("self."):
            break
        expr = children.get(expr[len("self."):])
    if expr is None or not expr.endswith("()"):
        return None
    return {m.name: m for m in program.modules}.get(expr[:-2])


def _reaches(program, module, kinds, seen=()):
    """Whether ``module``'s forward, or a module it calls, has a statement of
    one of ``kinds``."""
    if module is None or module.name in seen:
        return False
    for s in statements(module.body):
        if s.kind in kinds:
            return True
        if s.attr is not None and _reaches(program, _child_module(program, module, s.attr),
                                           kinds, seen + (module.name,)):
            return True
    return False


def enabled_block_branches_on_data(program):
    """Whether an ``enabled()`` block inside a disabled block calls a module
    that branches on its input's values: the variant without the disabled
    statements feeds it other values, so it may take the other branch."""
    for m in program.modules:
        for s in statements(m.body):
            for e in statements(s.enabled or []):
                if e.kind == "branch_data" or (e.attr is not None and _reaches(
                        program, _child_module(program, m, e.attr), {"branch_data"})):
                    return True
    return False


def inside_reentrant_segment(program, kinds):
    """Whether a statement of one of ``kinds`` runs inside a segment of a
    reentrant checkpoint. Two shapes are left out of the comparison with a
    run without checkpointing, as torch itself runs other backward nodes
    there (docs/pytorch-eager.md, known limits): a checkpoint nested in a
    reentrant segment, and a ``torch.no_grad()`` block inside one (the
    segment's graph is cut, yet its autograd node still connects its output
    to its input, so torch runs the nodes before the segment, with no
    gradient)."""
    for module in program.modules:
        for s in statements(module.body):
            if s.kind == "ckpt" and s.reentrant and s.attr is not None \
                    and _reaches(program, _child_module(program, module, s.attr), kinds):
                return True
    return False


def check_checkpoint(program):
    assume(not inside_reentrant_segment(program, {"ckpt", "no_grad"}))
    with_ckpt = valid(program)
    without = valid(program, checkpoint=False)
    # A reentrant checkpoint whose inputs need no grad makes its output need
    # none either (torch's documented pitfall): the program then has other
    # gradients, hence other backward ops, with checkpointing than without.
    assume(all((g is None and h is None) or (g is not None and h is not None
                                              and torch.equal(g, h))
               for a, b in zip(with_ckpt.grads, without.grads) for g, h in zip(a, b)))
    got = record(program)
    want = record(program, checkpoint=False)
    no_tensor = {key for r in (got, want) for t in (r.tool, r.inner)
                 for key, n in t.outputs.items() if n == 0 and key[1] not in IN_PLACE_FREE}

    def forward_ids(entries):
        return {(e[0], e[2], e[3]) for e in entries if e[0] not in ("mark", "step")
                and e[1] == FB and e[2:4] not in no_tensor}

    def backward_ids(entries):
        # AccumulateGrad aside: a reentrant checkpoint feeds its input's
        # gradient to the input's accumulator through its own node, which no
        # op creates, so that accumulator has no owner there.
        return {(e[0], e[2], e[3]) for e in entries if e[0] not in ("mark", "step")
                and e[1] == BB and e[3] != "AccumulateGrad"}

    for i, (x, y) in enumerate(zip(by_step(got.log), by_step(want.log))):
        g, w = forward_ids(x), forward_ids(y)
        first = forward_ids(between(x, "pre", "backward"))
        recomputed = forward_ids(between(x, "backward", "eval"))
        assert recomputed <= first, (f"step {i}: ops recomputed in backward got new ids: "
                                     + "; ".join(describe(e[:1] + (FB,) + e[1:] + (None,))
                                                 for e in sorted(recomputed - first)))
        assert_same_multiset(sorted(t[:1] + (FB,) + t[1:] + (None,) for t in g),
                             sorted(t[:1] + (FB,) + t[1:] + (None,) for t in w),
                             "forward op ids with checkpointing (got) vs without (want)", i)
        assert_same_multiset(sorted(t[:1] + (BB,) + t[1:] + (None,) for t in backward_ids(x)),
                             sorted(t[:1] + (BB,) + t[1:] + (None,) for t in backward_ids(y)),
                             "backward op ids with checkpointing (got) vs without (want)", i)


@hyp(EXAMPLES["checkpoint"], programs(force={"ckpt"}))
def test_checkpoint_keeps_op_ids(program):
    check_checkpoint(program)


def test_cache_rule_when_an_input_starts_requiring_grad():
    """Regression found by the harness: an op whose first execution made no
    autograd node (its input needed no grad) gets backward routines later,
    with the cache as without it."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    logs = {}
    for cache in (True, False):
        log = []
        tool = Recorder(log)   # forward points too: with only backward ones it passes
        with amanda.apply(tool), (amanda.cache_enabled() if cache else amanda.cache_disabled()):
            for i in range(2):
                log.append(("step", i))
                x = torch.randn(4, 4, requires_grad=True)
                if i == 0:
                    with torch.no_grad():
                        x = x + 1
                h = torch.relu(x)
                lin(h).sum().backward()
        logs[cache] = log
    for i, (x, y) in enumerate(zip(by_step(logs[True]), by_step(logs[False]))):
        assert_same_sequence(x, y, "cached (got) vs cache_disabled (want)", i)


# -- the long sweep ---------------------------------------------------------------------------------

CHECKS = ["cache", "disabled", "identity", "state", "ids", "checkpoint"]


@pytest.mark.slow
@hyp(5 * sum(EXAMPLES.values()), st.sampled_from(CHECKS), st.data())
def test_sweep(check, data):
    if check == "checkpoint":
        program = data.draw(programs(max_depth=3, force={"ckpt"}))
        check_checkpoint(program)
        return
    program = data.draw(programs(max_depth=3, force={"disabled"} if check == "disabled" else ()))
    if check == "cache":
        check_cache_rule(program, data.draw(points_st), data.draw(names_st),
                         data.draw(st.booleans()))
    elif check == "disabled":
        check_disabled_rule(program, data.draw(points_st), data.draw(names_st),
                            data.draw(st.booleans()))
    elif check == "identity":
        check_identity(program, data.draw(st.booleans()), data.draw(st.booleans()))
    elif check == "state":
        check_state(program, data.draw(st.sampled_from(ALL_POINTS)),
                    data.draw(st.integers(1, 60)), data.draw(st.booleans()),
                    data.draw(st.booleans()))
    else:
        check_ids_and_points(program, data.draw(st.booleans()))


def test_harness_variants_are_line_aligned():
    """The variants the harness compares keep every line where it was."""
    @settings(max_examples=30, **COMMON)
    @given(programs(force={"disabled", "ckpt"}))
    def check(program):
        base = program.render().splitlines()
        for variant in (program.render(disabled=False), program.render(checkpoint=False)):
            lines = variant.splitlines()
            assert len(lines) == len(base)
            for a, b in zip(base, lines):
                if a != b:
                    assert ("disabled" in a or "enabled" in a or "checkpoint(" in a
                            or b.strip() in ("pass", "if True:")), (a, b)
    check()

