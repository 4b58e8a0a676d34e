"""Whether observe-only routines run after a run on fetched tensors, or
inside it: one pair of switches for every graph backend (imports no
framework).

By default an onnxruntime session whose routines only observe, and the
routines that can only return None at the top level of a TensorFlow
``Session.run`` graph, are called after the run on the tensors they read,
fetched with the run (in program order, on read-only arrays). The scopes
below change that per thread; the choice is made when a session is created
(ONNX) or a graph's ops are rewritten (TensorFlow: a scope's first run of a
graph, or of ops new to it).
"""

from __future__ import annotations

import threading

from amanda.runtime import swapped

_observation = threading.local()   # .hosted, .budget (per thread)

#: default of `observation_budget`: bytes of observed tensors fetched per run
OBSERVATION_BUDGET = 64 << 20


def hosted_observation():
    """Run observe-only routines inside the run, next to their ops, on
    copies of their tensors: for routines whose timing matters, or ONNX
    sessions run with ``run_with_iobinding``/``run_async``."""
    return swapped(_observation, "hosted", True)


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
    if getattr(_observation, "hosted", False):
        return None
    budget = getattr(_observation, "budget", None)
    return OBSERVATION_BUDGET if budget is None else budget
