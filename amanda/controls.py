"""Per-thread switches: enable/disable instrumentation, the analysis cache and
autodiff of instrumentation routines.

All state here is thread-local, so a scope opened in one thread never changes
what another thread sees.
"""

from __future__ import annotations

import contextlib
import threading


class _State(threading.local):
    def __init__(self):
        self.disabled = False      # amanda.disabled(): ops run vanilla
        self.cache = True          # amanda.cache_disabled(): analysis every time
        self.ad = False            # amanda.ad_enabled(): routines are differentiated
        self.sessions = []         # stack of active apply() sessions
        self.drivers = {}          # backend driver -> how many of those scopes it is in


state = _State()


@contextlib.contextmanager
def _switch(name, value):
    old = getattr(state, name)
    setattr(state, name, value)
    try:
        yield
    finally:
        setattr(state, name, old)


def disabled():
    """Run the enclosed code uninstrumented, even inside ``amanda.apply``."""
    return _switch("disabled", True)


class muted:
    """amanda's own work runs uninstrumented: analysis and instrumentation
    routines, rewrite rules, ``evaluate`` probes.

    The same switch as `disabled`, for the runtimes: a small class rather
    than a generator so that it is cheap enough for a per-routine call
    (one per instrumentation point). Every runtime uses it instead of
    saving and restoring ``state.disabled`` by hand, so the rule "amanda
    never instruments itself, and leaves the switch as it found it, also
    on errors" lives here. Where the muted stretch spans two callbacks (a
    compiled call from Dynamo's callback to its end), the runtime keeps the
    object and calls ``__enter__``/``__exit__`` itself.
    """

    __slots__ = ("saved",)

    def __enter__(self):
        self.saved = state.disabled
        state.disabled = True
        return self

    def __exit__(self, *exc):
        state.disabled = self.saved
        return False


def enabled():
    """Re-enable instrumentation inside an ``amanda.disabled()`` scope."""
    return _switch("disabled", False)


def cache_disabled():
    """Run analysis routines at every execution of an op, not only the first.

    Actions recorded in one execution apply to that execution only.
    """
    return _switch("cache", False)


def cache_enabled():
    """Cache analysis (the default): an op's analysis routines run at its first
    execution and the actions they record are replayed afterwards."""
    return _switch("cache", True)


def ad_enabled():
    """Actions recorded inside this scope are differentiated like model code.

    Use it when a routine must shape gradients itself (e.g. fine-tuning after
    pruning, where the mask multiplies the weight's gradient too).
    """
    return _switch("ad", True)


def ad_disabled():
    """Actions recorded inside this scope are isolated from autodiff (the
    default): a replaced tensor passes gradients straight through to the
    original, as if the routine were the identity."""
    return _switch("ad", False)
