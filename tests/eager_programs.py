"""Random PyTorch eager programs for the differential harness
(``tests/pytorch/test_eager_harness.py``).

A hypothesis strategy (:func:`programs`) draws a *program spec*: a tree of
``nn.Module`` classes whose ``forward`` bodies are lists of statements, plus a
training-step function that calls the model. :meth:`Program.render` turns a
spec into Python source and :meth:`Program.load` compiles it into a fresh
namespace. Rendering has switches that produce the *variants* the harness
compares against, line for line (variants never move a line, so code
locations, and hence op ids, are comparable between them):

* ``disabled=False``: every ``with amanda.disabled():`` block becomes
  ``if True:`` whose disabled statements are ``pass`` lines, and
  ``with amanda.enabled():`` becomes ``if True:``. So the variant is "the
  same program without the disabled block". (The block's first line,
  ``side = OPAQUE(h)``, is the same in both; see :func:`opaque`.) ``enabled()``
  appears only in the root's forward and at top level, and the model is
  called under ``disabled()`` only when no module has ``enabled()``: ops
  re-enabled inside a module called from disabled code have no counterpart
  in the variant.
* ``checkpoint=False``: ``checkpoint(self.c, h, use_reentrant=R)`` becomes
  ``self.c(h)``.

Statements only ever map a (4, 4) float tensor to a (4, 4) tensor, so every
variant is well-typed. Statements inside a disabled block work on a ``side``
variable that flows back only through ``h = h + 0 * side`` (same value), and
they contain no data-dependent branch, so removing the disabled statements
never changes which code path the rest of the program takes.

The generated source reaches its environment through the global ``ENV``
(a dict the runner fills): ``ENV["step"]`` (the step number, for
step-dependent branches), ``ENV["nested"]()`` (the context manager of a nested
``amanda.apply`` scope, or a null context in vanilla runs), ``MARK(tag)``
(appends ``("mark", tag)`` to the log: plain Python, no torch call) and
``OPAQUE(t)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import linecache
import textwrap
from typing import Optional

import torch
from hypothesis import strategies as st

# -- statement templates --------------------------------------------------------
# Each is a list of lines over a variable {v}; "self" templates need a module.

SIMPLE_OPS = {
    "relu": ["{v} = torch.relu({v})"],
    "add_scalar": ["{v} = {v} + 1"],
    "tanh_mul": ["{v} = torch.tanh({v}) * 0.5"],
    "cat": ["{v} = torch.cat([{v}[:2], {v}[2:] * 0.5], 0)"],
    "add_": ["{v} = {v}.clone()", "{v}.add_(1)"],
    "iadd": ["{v} = {v} * 1.0", "{v} += 0.5"],
    "setitem": ["{v} = {v}.clone()", "{v}[0] = torch.tanh({v}[1])"],
    "transpose": ["{v} = ({v}.T + {v}) * 0.5"],
    "sigmoid_method": ["{v} = {v}.sigmoid() - 0.5"],
}
MODULE_OPS = {
    "flinear": ["{v} = F.linear({v}, self.w)"],
    "matmul": ["{v} = torch.tanh({v} @ self.w)"],
}
LEAVES = {
    "linear": "nn.Linear(4, 4)",
    "relu": "nn.ReLU()",
    "tanh": "nn.Tanh()",
    "layernorm": "nn.LayerNorm(4)",
}

# -- spec ------------------------------------------------------------------------


@dataclasses.dataclass
class Stmt:
    kind: str
    op: Optional[str] = None            # SIMPLE_OPS/MODULE_OPS key
    attr: Optional[str] = None          # child attribute
    key: Optional[str] = None           # ModuleDict key
    reentrant: Optional[bool] = None    # checkpoint
    mod: int = 2                        # step branch: ENV["step"] % mod == rem
    rem: int = 0
    body: list = dataclasses.field(default_factory=list)
    orelse: list = dataclasses.field(default_factory=list)
    enabled: Optional[list] = None      # disabled: statements under amanda.enabled()
    merge: bool = False                 # disabled: h = h + 0 * side afterwards
    gen: Optional[str] = None           # generator method name


@dataclasses.dataclass
class ModuleSpec:
    name: str
    children: list = dataclasses.field(default_factory=list)   # (attr, expr)
    body: list = dataclasses.field(default_factory=list)
    generators: list = dataclasses.field(default_factory=list)  # (method, mlist attr)
    generator_forward: bool = False    # forward yields after each layer of self.layers
    root: bool = False


@dataclasses.dataclass
class StepSpec:
    pre: list            # Stmt on x before the model call (top level)
    post: list           # Stmt on out after the model call
    loss: str
    loss_branch: bool    # step-dependent extra loss term
    disabled_call: bool  # with amanda.disabled(): model(x)
    top_disabled: Optional[Stmt]   # a top-level disabled block on out
    optimizer: bool
    eval_site: Optional[str]       # None, "grad" or "no_grad": a second call site
    wrap: bool = False             # the model is nn.Sequential(M0(), nn.Tanh()), a torch container


LOSSES = {
    "sum": "loss = out.sum()",
    "square": "loss = (out * out).mean()",
    "relu_sum": "loss = torch.relu(out).sum()",
}


def statements(body):
    """The statements of ``body`` and, depth first, of every block in them."""
    for s in body:
        yield s
        yield from statements(s.body)
        yield from statements(s.orelse)
        yield from statements(s.enabled or [])


@dataclasses.dataclass
class Program:
    modules: list   # ModuleSpec, root first
    step: StepSpec

    # -- rendering --------------------------------------------------------------
    def render(self, disabled=True, checkpoint=True):
        r = _Renderer(disabled, checkpoint)
        out = ["import torch", "import torch.nn as nn", "import torch.nn.functional as F",
               "import amanda", "from torch.utils.checkpoint import checkpoint", ""]
        for m in reversed(self.modules):
            out += r.module(m) + [""]
        out += r.step(self.step)
        out += ["", "def build():",
                "    return nn.Sequential(M0(), nn.Tanh())" if self.step.wrap else "    return M0()"]
        return "\n".join(out) + "\n"

    def load(self, env, disabled=True, checkpoint=True):
        """Compile a variant into a fresh namespace whose globals see ``env``."""
        source = self.render(disabled, checkpoint)
        filename = f"<amanda-program-{next(_COUNTER)}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = {"ENV": env, "MARK": env["mark"], "OPAQUE": opaque, "__name__": "program"}
        exec(compile(source, filename, "exec"), namespace)
        return namespace

    def has(self, kind):
        return any(s.kind == kind for s in self.walk())

    def walk(self):
        for m in self.modules:
            yield from statements(m.body)
        step = self.step
        yield from statements(step.pre + step.post +
                              ([step.top_disabled] if step.top_disabled else []))
        if step.disabled_call:
            yield Stmt("disabled_call")

    def __repr__(self):
        return "Program(\n" + textwrap.indent(self.render(), "    ") + ")"

    def _repr_pretty_(self, printer, cycle):   # what hypothesis prints
        printer.text(repr(self))


_COUNTER = itertools.count()


def opaque(t):
    """``t * 1.0`` computed with every torch function mode off, requiring grad
    even where ``t`` does not: the first line of every disabled block, in both
    variants. ``side`` then always has an autograd node that no amanda op owns
    (as disabled statements make) and always requires grad (as disabled
    statements touching a parameter would make it), so the variant without
    the disabled statements builds the same instrumented backward ops."""
    with torch._C.DisableTorchFunction():
        base = t if t.requires_grad else t.detach().requires_grad_()
        return base * 1.0


class _Renderer:
    def __init__(self, disabled, checkpoint):
        self.disabled = disabled
        self.checkpoint = checkpoint

    def module(self, m):
        lines = [f"class {m.name}(nn.Module):", "    def __init__(self):",
                 "        super().__init__()",
                 "        self.w = nn.Parameter(torch.randn(4, 4) * 0.5)"]
        for attr, expr in m.children:
            lines.append(f"        self.{attr} = {expr}")
        if m.root:
            lines.append("        self.head = nn.Linear(4, 4)")
        lines.append("")
        lines.append("    def forward(self, h):")
        if m.generator_forward:
            lines += ["        for m in self.layers:", "            h = m(h)",
                      "            yield h"]
        else:
            lines += self.block(m.body, "h", 2, in_module=True)
            if m.root:
                lines.append("        h = self.head(h)")
            lines.append("        return h")
        for method, mlist in m.generators:
            lines += ["", f"    def {method}(self, h):", f"        for m in self.{mlist}:",
                      "            h = m(h)", "            yield h"]
        return lines

    def block(self, stmts, v, depth, in_module, disabled=False):
        lines = []
        for s in stmts:
            lines += self.stmt(s, v, depth, in_module, disabled)
        if not lines:
            lines = ["    " * depth + "pass"]
        return lines

    def stmt(self, s, v, depth, in_module, disabled=False):
        """Lines of one statement; inside a disabled block of the no-disabled
        variant every line is ``pass`` (the statement does not run)."""
        lines = self._stmt(s, v, depth, in_module)
        if disabled and not self.disabled:
            lines = ["    " * depth + "pass" for _ in lines]
        return lines

    def _stmt(self, s, v, depth, in_module):
        ind = "    " * depth
        k = s.kind
        if k == "op":
            table = MODULE_OPS if s.op in MODULE_OPS else SIMPLE_OPS
            return [ind + line.format(v=v) for line in table[s.op]]
        if k == "call":
            return [ind + f"{v} = self.{s.attr}({v})"]
        if k == "mlist":
            return [ind + f"for m in self.{s.attr}:", ind + f"    {v} = m({v})"]
        if k == "mdict":
            return [ind + f"{v} = self.{s.attr}[{s.key!r}]({v})"]
        if k == "ckpt":
            if self.checkpoint:
                return [ind + f"{v} = checkpoint(self.{s.attr}, {v}, use_reentrant={s.reentrant})"]
            return [ind + f"{v} = self.{s.attr}({v})"]
        if k == "gen":
            return [ind + f"for y in self.{s.gen}({v}):", ind + f"    {v} = y * 0.5"]
        if k == "genfwd":
            return [ind + f"for y in self.{s.attr}({v}):", ind + f"    {v} = y"]
        if k == "branch_step":
            return ([ind + f"if ENV['step'] % {s.mod} == {s.rem}:"]
                    + self.block(s.body, v, depth + 1, in_module)
                    + [ind + "else:"] + self.block(s.orelse, v, depth + 1, in_module))
        if k == "branch_data":
            return ([ind + f"if {v}.sum() > 0:"] + self.block(s.body, v, depth + 1, in_module)
                    + [ind + "else:"] + self.block(s.orelse, v, depth + 1, in_module))
        if k == "no_grad":
            return [ind + "with torch.no_grad():"] + self.block(s.body, v, depth + 1, in_module)
        if k == "nested":
            return [ind + "with ENV['nested']():"] + self.block(s.body, v, depth + 1, in_module)
        if k == "disabled":
            head = "with amanda.disabled():" if self.disabled else "if True:"
            lines = [ind + head, ind + "    " + f"side = OPAQUE({v})"]
            for t in s.body:
                lines += self.stmt(t, "side", depth + 1, in_module, disabled=True)
            if s.enabled is not None:
                lines.append(ind + "    " + ("with amanda.enabled():" if self.disabled
                                             else "if True:"))
                lines += self.block(s.enabled, "side", depth + 2, in_module)
            if s.merge:
                lines.append(ind + f"{v} = {v} + 0 * side")
            return lines
        raise AssertionError(k)

    def step(self, s):
        lines = ["def step(model, x, opt):", "    model.zero_grad(set_to_none=True)",
                 "    MARK('pre')"]
        for t in s.pre:
            lines += self.stmt(t, "x", 1, False)
        lines += ["    MARK('train')", "    out = model(x)  # the train call site",
                  "    MARK('dcall')"]
        if s.disabled_call:
            lines += ["    with amanda.disabled():" if self.disabled else "    if True:",
                      "        model(x)" if self.disabled else "        pass"]
        lines.append("    MARK('loss')")
        for t in s.post:
            lines += self.stmt(t, "out", 1, False)
        if s.top_disabled is not None:
            lines += self.stmt(s.top_disabled, "out", 1, False)
        lines.append("    " + LOSSES[s.loss])
        if s.loss_branch:
            lines += ["    if ENV['step'] % 2 == 1:", "        loss = loss + out.mean()"]
        lines += ["    MARK('backward')", "    loss.backward()", "    MARK('eval')"]
        if s.eval_site == "grad":
            lines.append("    ev = model(x)  # the eval call site")
        elif s.eval_site == "no_grad":
            lines += ["    with torch.no_grad():", "        ev = model(x)  # the eval call site"]
        lines.append("    MARK('opt')")
        if s.optimizer:
            lines.append("    opt.step()")
        lines += ["    MARK('end')", "    return out"]
        return lines


# -- strategies --------------------------------------------------------------------------


class _Builder:
    """Draws one program; ``draw`` is hypothesis's."""

    def __init__(self, draw, max_depth):
        self.draw = draw
        self.max_depth = max_depth
        self.modules = []
        self.no_grad_ok = True
        self.module_enabled = False   # some module has an enabled() block

    def new_module(self, depth, root=False):
        m = ModuleSpec(name=f"M{len(self.modules)}", root=root)
        self.modules.append(m)
        m.depth = depth
        m.body = self.block(m, depth, side=False, size=(1, 4))
        return m

    def child(self, m, kind=None):
        """A child attribute of ``m``: new (leaf, submodule, Sequential) or an
        existing one (a shared submodule called again, or an alias)."""
        draw = self.draw
        callable_children = [a for a, e in m.children if not e.startswith(("nn.ModuleList",
                                                                          "nn.ModuleDict", "G"))]
        choice = kind or draw(st.sampled_from(
            ["leaf", "leaf", "sub", "seq", "reuse", "alias"]), label="child kind")
        if choice in ("reuse", "alias") and not callable_children:
            choice = "leaf"
        if choice == "sub" and m.depth >= self.max_depth:
            choice = "leaf"
        if choice == "reuse":
            return draw(st.sampled_from(callable_children))
        attr = f"c{len(m.children)}"
        if choice == "alias":
            m.children.append((attr, "self." + draw(st.sampled_from(callable_children))))
        elif choice == "leaf":
            m.children.append((attr, LEAVES[draw(st.sampled_from(sorted(LEAVES)))]))
        elif choice == "sub":
            m.children.append((attr, None))
            index = len(m.children) - 1
            sub = self.new_module(m.depth + 1)
            m.children[index] = (attr, f"{sub.name}()")
        elif choice == "seq":
            m.children.append((attr, self.leaf_list("nn.Sequential")))
        return attr

    def leaf_list(self, ctor):
        leaves = self.draw(st.lists(st.sampled_from(sorted(LEAVES)), min_size=1, max_size=3))
        items = ", ".join(LEAVES[x] for x in leaves)
        return f"{ctor}({items})" if ctor == "nn.Sequential" else f"{ctor}([{items}])"

    def block(self, m, depth, side, size=(0, 3)):
        """Statements; ``side``: inside a disabled block (no data branch, no
        disabled block). ``m`` is None at top level (no self)."""
        draw = self.draw
        n = draw(st.integers(*size))
        kinds = ["op"] * 4
        if m is not None:
            kinds += ["call"] * 3 + ["mlist", "mdict", "gen", "genfwd", "ckpt", "ckpt"]
        kinds += ["branch_step", "nested"] + (["no_grad"] if self.no_grad_ok else [])
        if not side:
            kinds += ["branch_data", "disabled", "disabled"]
        stmts = []
        for _ in range(n):
            stmts.append(self.stmt(m, depth, side, draw(st.sampled_from(kinds))))
        return stmts

    def stmt(self, m, depth, side, kind):
        draw = self.draw
        nest = depth < self.max_depth + 2
        if kind in ("branch_step", "branch_data", "no_grad", "nested", "disabled") and not nest:
            kind = "op"
        if kind == "op":
            names = sorted(SIMPLE_OPS) + (sorted(MODULE_OPS) if m is not None else [])
            return Stmt("op", op=draw(st.sampled_from(names)))
        if kind == "call":
            return Stmt("call", attr=self.child(m))
        if kind == "mlist":
            attr = f"c{len(m.children)}"
            m.children.append((attr, self.leaf_list("nn.ModuleList")))
            return Stmt("mlist", attr=attr)
        if kind == "mdict":
            attr = f"c{len(m.children)}"
            leaves = draw(st.lists(st.sampled_from(sorted(LEAVES)), min_size=1, max_size=2))
            items = ", ".join(f"'k{i}': {LEAVES[x]}" for i, x in enumerate(leaves))
            m.children.append((attr, f"nn.ModuleDict({{{items}}})"))
            return Stmt("mdict", attr=attr, key=f"k{draw(st.integers(0, len(leaves) - 1))}")
        if kind == "gen":
            attr = f"c{len(m.children)}"
            m.children.append((attr, self.leaf_list("nn.ModuleList")))
            method = f"_layers{len(m.generators)}"
            m.generators.append((method, attr))
            return Stmt("gen", gen=method)
        if kind == "genfwd":
            g = ModuleSpec(name=f"G{len(self.modules)}", generator_forward=True)
            g.depth = m.depth + 1
            self.modules.append(g)
            attr = f"c{len(m.children)}"
            m.children.append((attr, f"{g.name}()"))
            g.children.append(("layers", self.leaf_list("nn.ModuleList")))
            return Stmt("genfwd", attr=attr)
        if kind == "ckpt":
            return Stmt("ckpt", attr=self.child(m, draw(st.sampled_from(
                ["leaf", "sub", "seq", "reuse"]))), reentrant=draw(st.booleans()))
        if kind == "branch_step":
            return Stmt("branch_step", mod=draw(st.integers(2, 3)), rem=draw(st.integers(0, 1)),
                        body=self.block(m, depth + 1, side, (1, 2)),
                        orelse=self.block(m, depth + 1, side))
        if kind == "branch_data":
            return Stmt("branch_data", body=self.block(m, depth + 1, side, (1, 2)),
                        orelse=self.block(m, depth + 1, side))
        if kind == "no_grad":
            return Stmt("no_grad", body=self.block(m, depth + 1, side, (1, 2)))
        if kind == "nested":
            return Stmt("nested", body=self.block(m, depth + 1, side, (1, 2)))
        if kind == "disabled":
            return self.disabled(m, depth, merge=draw(st.booleans()))
        raise AssertionError(kind)

    def disabled(self, m, depth, merge):
        """A disabled block. Its own statements make no ``no_grad`` scope: the
        variant without them must leave ``side`` requiring grad as it was."""
        saved, self.no_grad_ok = self.no_grad_ok, False
        try:
            body = self.block(m, depth + 1, True, (1, 3))
        finally:
            self.no_grad_ok = saved
        # enabled() only in the root's forward and at top level: a module with
        # enabled() called inside a disabled block instruments there, which
        # the variant without the block cannot say
        enabled = None
        if m is None or m.root:
            enabled = self.draw(st.none() | st.just(True)) and \
                self.block(m, depth + 2, True, (1, 2))
        if enabled is not None and m is not None:
            self.module_enabled = True
        return Stmt("disabled", body=body, enabled=enabled, merge=merge)


@st.composite
def programs(draw, max_depth=2, force=()):
    """A random program. ``force``: statement kinds the root's forward must
    contain (e.g. ``{"ckpt"}``)."""
    b = _Builder(draw, max_depth)
    root = ModuleSpec(name="M0", root=True)
    root.depth = 0
    b.modules.append(root)
    forced = [b.stmt(root, 0, False, k) for k in sorted(force)]
    root.body = forced + b.block(root, 0, side=False, size=(1, 4))
    root.body = draw(st.permutations(root.body)) if len(root.body) > 1 else root.body
    top_disabled = b.disabled(None, 0, merge=True) if draw(st.booleans()) else None
    pre = b.block(None, 1, side=True, size=(0, 2))
    b.no_grad_ok = False   # the loss needs grad
    post = b.block(None, 1, side=True, size=(0, 2))
    step = StepSpec(
        pre=pre,
        post=post,
        loss=draw(st.sampled_from(sorted(LOSSES))),
        loss_branch=draw(st.booleans()),
        # enabled() inside a model called under disabled() instruments: the
        # variant without the disabled call could not say which ops
        disabled_call=not b.module_enabled and draw(st.booleans()),
        top_disabled=top_disabled,
        optimizer=draw(st.booleans()),
        eval_site=draw(st.sampled_from([None, "grad", "no_grad"])),
        wrap=draw(st.booleans()),
    )
    return Program(b.modules, step)


# -- running ----------------------------------------------------------------------------------


def inputs(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 4, generator=g).requires_grad_()


@dataclasses.dataclass
class Run:
    log: list          # ("step", i), ("mark", tag) and the tools' records, in order
    outputs: list      # per step
    grads: list        # per step: parameter gradients, then the input's
    error: Optional[BaseException] = None


def run(program, tool=None, inner=None, *, steps=4, cache=True, per_step=False, log=None,
        disabled=True, checkpoint=True, catch=False):
    """Run ``steps`` steps of ``program``, inside ``amanda.apply(tool)`` (one
    scope around all steps, or one per step) unless ``tool`` is None (vanilla).
    ``inner`` is the tool of the program's nested ``apply`` scopes. ``cache``
    False runs everything under ``amanda.cache_disabled()``."""
    import amanda
    log = [] if log is None else log
    env = {"step": 0, "mark": lambda tag: log.append(("mark", tag))}
    if tool is None:
        env["nested"] = contextlib.nullcontext
    else:
        env["nested"] = (lambda: amanda.apply(inner)) if inner is not None \
            else contextlib.nullcontext
    ns = program.load(env, disabled=disabled, checkpoint=checkpoint)
    torch.manual_seed(0)
    model = ns["build"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.01) if program.step.optimizer else None
    result = Run(log, [], [])
    scope = (lambda: amanda.apply(tool)) if tool is not None else contextlib.nullcontext
    try:
        with contextlib.ExitStack() as outer:
            if not cache:
                outer.enter_context(amanda.cache_disabled())
            if not per_step:
                outer.enter_context(scope())
            for i in range(steps):
                env["step"] = i
                log.append(("step", i))
                x = inputs(i)
                with scope() if per_step else contextlib.nullcontext():
                    out = ns["step"](model, x, opt)
                result.outputs.append(out)
                result.grads.append([p.grad for p in model.parameters()] + [x.grad])
    except Exception as e:  # noqa: BLE001
        if not catch:
            raise
        result.error = e
    result.model = model
    return result


def by_step(log):
    """The log split at ("step", i) entries: a list of per-step lists."""
    steps = []
    for entry in log:
        if entry[0] == "step":
            steps.append([])
        elif steps:
            steps[-1].append(entry)
    return steps
