"""The pass contract and a small pass manager.

A *pass* is a callable taking an :class:`amanda.ir.Graph` and returning a
`PassResult`: the graph to hand on (the same object when the pass edited it in
place, a new one when it copied) and whether the pass changed anything. The
result may be a subclass carrying more (`amanda.passes.rewrite.RewriteResult`
adds the list of rewrites applied).

`PassManager` runs passes in order, threading each result's graph into the next
pass. In debug mode it runs the IR verifier on the input and after every pass,
so a pass that breaks an invariant is named at once instead of failing later in
a backend. Its errors name the pass that failed and the passes run before it::

    manager = PassManager([fold_constants, functools.partial(apply_rules, rules=rules)],
                          debug=True)
    result = manager(graph)          # PassResult(graph, modified)

Debug mode is on for every manager when the environment variable
``AMANDA_DEBUG_PASSES`` is ``1`` (read at import), or when ``debug=True``.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from amanda.errors import AmandaError
from amanda.ir import Graph, IRError, VerificationError

__all__ = ["DEBUG", "PassError", "PassManager", "PassResult", "pass_name"]

#: Default debug mode of managers created with ``debug=None``.
DEBUG = os.environ.get("AMANDA_DEBUG_PASSES") == "1"


@dataclasses.dataclass
class PassResult:
    """What a pass returns.

    Attributes:
        graph: the graph after the pass (the input itself if edited in place).
        modified: whether the pass changed anything.
    """

    graph: Graph
    modified: bool


class PassError(AmandaError):
    """A pass failed, returned something else than a `PassResult`, or (in
    debug mode) left a graph the verifier rejects.

    Attributes:
        pass_name: the failing pass, or None when the input graph was invalid.
        passes_run: names of the passes that completed before it, in order.
    """

    def __init__(self, message, *, pass_name=None, passes_run=()):
        super().__init__(message)
        self.pass_name = pass_name
        self.passes_run = list(passes_run)


def pass_name(pass_):
    """A readable name for a pass: its ``name`` attribute, its function's
    ``__name__`` (through `functools.partial`), or its class name."""
    name = getattr(pass_, "name", None)
    if isinstance(name, str) and name:
        return name
    while isinstance(pass_, functools.partial):
        pass_ = pass_.func
    return getattr(pass_, "__name__", None) or type(pass_).__name__


class PassManager:
    """Runs passes in order over a graph.

    Args:
        passes: the passes, callables ``graph -> PassResult``.
        debug: verify the input graph and the graph after every pass (None:
            the module's `DEBUG`).
        max_rounds: run the whole sequence again while a round modified the
            graph, at most this many times (1: once).
        name: the manager's name in error messages.

    Attributes:
        history: ``(round, pass name, modified)`` for each pass of the last run,
            in order (a debug trail; complete up to a failure).
    """

    def __init__(self, passes=(), *, debug=None, max_rounds=1, name="passes"):
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be at least 1, got {max_rounds}")
        self.passes = list(passes)
        self.debug = DEBUG if debug is None else debug
        self.max_rounds = max_rounds
        self.name = name
        self.history = []

    def add_pass(self, pass_):
        """Appends a pass; returns it, so it can decorate a function."""
        self.passes.append(pass_)
        return pass_

    def __call__(self, graph):
        """Runs the passes over ``graph``.

        Returns:
            A `PassResult`: the final graph, and whether any pass modified it.

        Raises:
            PassError: a pass raised an `IRError` or a non-amanda exception
                (the original is the ``__cause__``), did not return a
                `PassResult`, or, in debug mode, the input or a pass's output
                failed verification. The message names the pass and the passes
                run before it.
            AmandaError: any other amanda error (a `ToolError` from a tool's
                routine, a `BackendError`, a `RewriteError` for a bad rule) is
                the caller's to handle and is raised unchanged, with a note
                naming the pass and the passes run before it.
        """
        self.history = []
        if self.debug:
            self._verify(graph, None)
        modified = False
        for round_ in range(1, self.max_rounds + 1):
            graph, changed = self._run_round(graph, round_)
            modified = modified or changed
            if not changed:
                break
        return PassResult(graph, modified)

    run = __call__

    def _run_round(self, graph, round_):
        changed = False
        for pass_ in self.passes:
            name = pass_name(pass_)
            result = self._run_pass(pass_, name, graph)
            if self.debug:
                self._verify(result.graph, name)
            graph, changed = result.graph, changed or bool(result.modified)
            self.history.append((round_, name, bool(result.modified)))
        return graph, changed

    def _run_pass(self, pass_, name, graph):
        try:
            result = pass_(graph)
        except AmandaError as error:
            if isinstance(error, IRError):  # the pass misused the IR: blame the pass
                raise self._error(f"pass {name!r} raised {type(error).__name__}: {error}", name) from error
            _add_note(error, f"(in pass {name!r} of {self.name!r}; passes run before it: {self._trail()})")
            raise
        except Exception as error:
            raise self._error(f"pass {name!r} raised {type(error).__name__}: {error}", name) from error
        if not (isinstance(getattr(result, "graph", None), Graph) and hasattr(result, "modified")):
            raise self._error(f"pass {name!r} returned {type(result).__name__}; a pass must return "
                              "a PassResult(graph, modified)", name)
        return result

    def _verify(self, graph, name):
        try:
            graph.verify()
        except VerificationError as error:
            what = "the input graph is invalid" if name is None else f"pass {name!r} left an invalid graph"
            raise self._error(f"{what}: {error}", name) from error

    def _error(self, message, name):
        return PassError(f"{self.name}: {message} (passes run before it: {self._trail()})",
                         pass_name=name, passes_run=[entry[1] for entry in self.history])

    def _trail(self):
        run = [entry[1] for entry in self.history]
        return ", ".join(map(repr, run)) if run else "none"

    def __repr__(self):
        names = ", ".join(pass_name(p) for p in self.passes)
        return f"<PassManager {self.name!r}: [{names}]{' debug' if self.debug else ''}>"


def _add_note(error, note):
    """PEP 678 note (shown under the traceback); by hand before Python 3.11."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", ()), note]
