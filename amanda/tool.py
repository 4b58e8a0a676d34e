"""The user-level tool API: :class:`Tool`, :func:`apply` and analysis dispatch.

A tool registers *analysis routines* at instrumentation points with
:meth:`Tool.add_inst_for_op`; analysis routines inspect an
:class:`~amanda.context.OpContext` and record actions that backends replay.
"""

from __future__ import annotations

import itertools
import sys

from amanda import controls
from amanda.errors import AmandaError, DependencyError, ToolError, describe

# The four instrumentation points: (backward?, require_outputs?).
FORWARD_BEFORE = (False, False)
FORWARD_AFTER = (False, True)
BACKWARD_BEFORE = (True, False)
BACKWARD_AFTER = (True, True)
POINTS = (FORWARD_BEFORE, FORWARD_AFTER, BACKWARD_BEFORE, BACKWARD_AFTER)


class Tool:
    """Base class of instrumentation tools.

    Subclasses call ``super().__init__()`` and then register analysis routines
    with :meth:`add_inst_for_op` and dependencies with :meth:`depends_on`.
    """

    def __init__(self, namespace=None):
        self.namespace = namespace
        self._routines = {point: [] for point in POINTS}
        self._post_routines = {point: [] for point in POINTS}
        self._dependencies = []
        self._sessions = {}
        self.requires_graph = False
        # False for helper tools (e.g. mapping) whose routines only matter at
        # points where some other tool has routines too.
        self.standalone = True

    def add_inst_for_op(self, callback, backward=False, require_outputs=False):
        """Register an analysis routine.

        Args:
            callback: called with an :class:`~amanda.OpContext` for each op.
            backward: instrument backward ops instead of forward ops.
            require_outputs: run after the (backward) op executed, so outputs
                (gradient inputs) are visible; otherwise run before it.
                "Before" actions recorded after the op executed take effect
                from the op's next execution.

        Raises:
            AmandaError: ``callback`` is not callable or the tool was not
                initialised.
        """
        self._check_initialised()
        if not callable(callback):
            raise AmandaError(f"tool {describe(self)}: add_inst_for_op needs a callable, "
                              f"got {callback!r}")
        self._routines[(bool(backward), bool(require_outputs))].append(callback)

    def add_post_inst_for_op(self, callback, backward=False, require_outputs=False):
        """Register a routine that runs *after* every tool depending on this one
        has analysed the op (e.g. the second half of a mapping rule)."""
        self._check_initialised()
        self._post_routines[(bool(backward), bool(require_outputs))].append(callback)

    def depends_on(self, *tools):
        """Declare tools whose analysis routines run before this tool's.

        Dependencies are resolved once, when the tool is applied, into a
        topological order; a tool reachable twice runs once.
        """
        self._check_initialised()
        for tool in tools:
            if not isinstance(tool, Tool):
                raise AmandaError(f"tool {describe(self)}: depends_on needs amanda.Tool "
                                  f"objects, got {tool!r}")
            self._dependencies.append(tool)

    def graph_completed(self, graph):
        """Called with each finished step graph (an :class:`amanda.ir.Graph`)
        when this tool set ``self.requires_graph = True``. The default does
        nothing; graph tools override it."""

    def get_dependencies(self):
        """The tools this tool directly depends on."""
        return tuple(self._dependencies)

    def _check_initialised(self):
        if "_routines" not in self.__dict__:
            raise AmandaError(f"tool {type(self).__qualname__} was not initialised: "
                              "call super().__init__() first in its __init__")


def resolve_tools(tools):
    """Order tools and their dependencies so dependencies come first.

    Returns:
        A tuple of distinct tools in topological order.

    Raises:
        DependencyError: the dependencies form a cycle (the message names it).
    """
    order, done, stack = [], set(), []

    def visit(tool):
        if id(tool) in done:
            return
        if any(t is tool for t in stack):
            cycle = stack[next(i for i, t in enumerate(stack) if t is tool):] + [tool]
            raise DependencyError("tool dependencies form a cycle: "
                                  + " -> ".join(describe(t) for t in cycle))
        tool._check_initialised()
        stack.append(tool)
        for dep in tool._dependencies:
            visit(dep)
        stack.pop()
        done.add(id(tool))
        order.append(tool)

    for tool in tools:
        if not isinstance(tool, Tool):
            raise AmandaError(f"amanda.apply needs amanda.Tool objects, got {tool!r}")
        visit(tool)
    return tuple(order)


class Session:
    """Tools applied together, their routines per point and their caches.

    Sessions are cached on the first applied tool, so applying the same tools
    again (e.g. one ``apply`` per training step) reuses cached analysis.
    """

    _tokens = itertools.count(1)

    def __init__(self, tools):
        self.tools = tools
        self.token = next(Session._tokens)
        self.routines = {}
        for point in POINTS:
            main = [(t, r) for t in tools for r in t._routines[point]]
            post = [(t, r) for t in reversed(tools) for r in t._post_routines[point]]
            live = any(t.standalone for t, _ in main + post)
            self.routines[point] = tuple(main + post) if live else ()
        self.has_backward = bool(self.routines[BACKWARD_BEFORE] or self.routines[BACKWARD_AFTER])
        self.requires_graph = any(t.requires_graph for t in tools)
        self.caches = {}   # backend name -> backend-owned cache object
        self.active = 0    # number of threads inside apply() with this session

    def graph_completed(self, graph):
        """Hand a finished step graph to the tools that asked for graphs."""
        for tool in self.tools:
            if tool.requires_graph:
                try:
                    tool.graph_completed(graph)
                except AmandaError:
                    raise
                except Exception as exc:
                    raise ToolError(f"graph_completed raised {type(exc).__name__}: {exc}",
                                    tool=tool, routine=tool.graph_completed,
                                    namespace=graph.namespace) from exc

    def analyse(self, point, context):
        """Run every routine registered at ``point`` on ``context``.

        Tool exceptions become :class:`ToolError` naming tool, routine, op and
        namespace, with the original exception chained.
        """
        try:
            for tool, routine in self.routines[point]:
                context._recording_for(tool, routine)
                try:
                    routine(context)
                except AmandaError:
                    raise
                except Exception as exc:
                    raise ToolError(f"analysis routine raised {type(exc).__name__}: {exc}",
                                    tool=tool, routine=routine, op_name=context._op_name,
                                    op_id=context._op_id, namespace=context.namespace) from exc
        finally:
            context._stop_recording()


def session_for(tools):
    tools = resolve_tools(tools)
    if not tools:
        return Session(())
    key = tuple(id(t) for t in tools)
    cache = tools[0]._sessions
    entry = cache.get(key)
    if entry is None or entry[0] != tools:
        entry = cache[key] = (tools, Session(tools))
    return entry[1]


class apply:
    """Apply tools to everything executed in the ``with`` block.

    ``apply`` scopes nest (inner scopes add their tools to the outer ones') and
    are per thread. Leaving the outermost scope, normally or by an exception,
    restores every backend exactly.

    Example::

        with amanda.apply(CountOPTool("conv2d")):
            model(x)
    """

    def __init__(self, *tools):
        resolve_tools(tools)  # report bad tools and cycles where apply is called
        self.tools = tools
        self.session = None
        self._drivers = []

    def __enter__(self):
        from amanda import runtime
        state = controls.state
        outer = state.sessions[-1].tools if state.sessions else ()
        self.session = session_for(tuple(outer) + self.tools)
        state.sessions.append(self.session)
        self.session.active += 1
        try:
            for driver in runtime.eager_drivers():
                driver.enter(self.session)
                self._drivers.append(driver)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self.session

    def __exit__(self, exc_type, exc, tb):
        state = controls.state
        errors = []
        if state.sessions and state.sessions[-1] is self.session:
            state.sessions.pop()
        restored = state.sessions[-1] if state.sessions else None
        while self._drivers:
            driver = self._drivers.pop()
            try:
                driver.exit(self.session, restored)
            except Exception as e:  # keep restoring the other backends
                errors.append(e)
        self.session.active -= 1
        if errors and exc_type is None:
            raise errors[0]
        return False


def current_session():
    sessions = controls.state.sessions
    return sessions[-1] if sessions else None
