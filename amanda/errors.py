"""Exceptions raised by amanda.

Every error a user can meet derives from :class:`AmandaError`. Errors about a
tool carry the tool, the routine, the op (name and id) and the namespace, so the
message alone tells where to look.
"""

from __future__ import annotations


class AmandaError(Exception):
    """Base class of every amanda exception."""


class ToolError(AmandaError):
    """A tool's routine failed or misbehaved at an instrumentation point.

    Attributes:
        tool: the tool object whose routine failed.
        routine: the routine (analysis or instrumentation) that failed.
        op_name: the backend op's name (``conv2d``, ``Conv2D``...).
        op_id: the stable id of the op.
        namespace: the context's namespace, e.g. ``pytorch/2.13.0/eager``.
    """

    def __init__(self, message, *, tool=None, routine=None, op_name=None,
                 op_id=None, namespace=None):
        self.tool = tool
        self.routine = routine
        self.op_name = op_name
        self.op_id = op_id
        self.namespace = namespace
        where = []
        if tool is not None:
            where.append(f"tool {describe(tool)}")
        if routine is not None:
            where.append(f"routine {describe(routine)}")
        if op_name is not None:
            where.append(f"op {op_name!r}" + (f" (id {op_id})" if op_id is not None else ""))
        if namespace is not None:
            where.append(f"namespace {namespace!r}")
        super().__init__(f"{message} [{', '.join(where)}]" if where else message)


class DependencyError(AmandaError):
    """A tool's dependencies cannot be resolved (e.g. they form a cycle)."""


class BackendError(AmandaError):
    """A backend cannot host what was asked of it."""


def describe(obj) -> str:
    """A short readable name for a tool, routine or op (used in messages)."""
    if isinstance(obj, type):
        return obj.__qualname__
    func = getattr(obj, "__func__", None)  # bound method
    if func is not None:
        owner = type(getattr(obj, "__self__", None)).__name__
        return f"{owner}.{func.__name__}"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if name is not None:
        return name
    return type(obj).__name__


class NotInstrumentedWarning(UserWarning):
    """Part of the user's program runs without its own points (a limit of a
    backend, e.g. ops inside TensorFlow function bodies): amanda says so
    rather than report counts that silently leave it out."""


class EagerFallbackWarning(UserWarning):
    """A compiled program runs eagerly inside ``apply`` (PyTorch: a
    ``torch.compile``d callable whose graph breaks, or whose tools have
    backward routines): every op is still a point, with eager's ids, but
    the program does not run at compiled speed. Given once per callable and
    reason; the warning names the reason."""


class NotBitExactWarning(UserWarning):
    """The instrumented program may compute other bits than the plain one
    for a reason of the backend (e.g. TensorFlow's Grappler rewrites float
    expressions that routines between ops break up). The warning names the
    settings at which outputs are bit-identical."""


def user_stacklevel(*modules):
    """The ``warnings.warn`` stacklevel, counted from the caller of this
    function, that names the user's line: the first frame outside amanda and
    the given framework ``modules`` (their package directories)."""
    import os
    import sys
    skip = tuple(os.path.dirname(os.path.abspath(m.__file__))
                 for m in (sys.modules["amanda"], *modules))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level
