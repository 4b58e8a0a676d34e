"""Whether observe-only routines run after a run on fetched tensors, or
inside it: one pair of switches for every graph backend (imports no
framework).

By default an onnxruntime session whose routines only observe, and the
routines that can only return None at the top level of a TensorFlow
``Session.run`` graph, are called after the run on the tensors they read,
fetched with the run (in program order, on read-only arrays), routines that
select no tensor included (a counter's ``inputs=[]``). The scopes below
change that per thread; the choice is made when a session is created (ONNX)
or a graph's ops are rewritten (TensorFlow: a scope's first run of a graph,
or of ops new to it).

A routine whose timing matters (a timer, ordered next to its op inside the
run) declares it by being recorded inside `hosted_observation`: the action
keeps that choice (`Action.in_run`) on every backend, whatever scope the run
is in.
"""

from __future__ import annotations

import contextlib
import threading

from amanda.runtime import swapped

_observation = threading.local()   # .hosted, .budget (per thread)

#: default of `observation_budget`: bytes of observed tensors fetched per run
OBSERVATION_BUDGET = 64 << 20


def hosted_observation():
    """Run observe-only routines inside the run, next to their ops, on
    copies of their tensors: for routines whose timing matters, or ONNX
    sessions run with ``run_with_iobinding``/``run_async``.

    Around a run (a TensorFlow graph's rewrite, an onnxruntime session's
    creation) it hosts every routine; around ``context.insert_*`` in an
    analysis routine it hosts the actions recorded there, wherever they run
    (how a timing tool declares itself, e.g. the op profiler)."""
    return swapped(_observation, "hosted", True)


def hosting():
    """Whether `hosted_observation` is active on this thread (read when an
    action is recorded: `Action.in_run`)."""
    return getattr(_observation, "hosted", False)


def observation_budget(nbytes):
    """Fetch at most ``nbytes`` of observed tensors per run.

    Fetched tensors all stay alive until the run ends, so peak memory grows
    by their total size. Where the estimate (static shapes; a dimension left
    symbolic, e.g. a batch, counts as 1) exceeds the budget, routines are
    hosted inside the run as in `hosted_observation` (ONNX: the session's,
    each right after the node producing its tensor; TensorFlow: the routines
    past the budget). Default `OBSERVATION_BUDGET` (64 MiB); per thread.
    """
    return swapped(_observation, "budget", int(nbytes))


def fetch_budget():
    """The bytes observed routines may fetch now, or None where they must
    be hosted (`hosted_observation`)."""
    if hosting():
        return None
    budget = getattr(_observation, "budget", None)
    return OBSERVATION_BUDGET if budget is None else budget


def current_choice():
    """This thread's two switches as they are now, for `choosing` to set
    again later (an onnxruntime session made again inside
    ``cache_disabled()`` chooses as it did when the user created it)."""
    return hosting(), getattr(_observation, "budget", None)


def choosing(choice):
    """The switches of `current_choice`, for the span of a ``with``."""
    hosted, budget = choice
    stack = contextlib.ExitStack()
    stack.enter_context(swapped(_observation, "hosted", hosted))
    stack.enter_context(swapped(_observation, "budget", budget))
    return stack
