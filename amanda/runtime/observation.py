"""Whether observe-only routines run after a run on fetched tensors, or
inside it (TensorFlow ``Session.run`` graphs; imports no framework).

ONNX has the same two scopes (`amanda.runtime.onnx.hosted_observation`,
`observation_budget`); TensorFlow honours those too (ONNX does not read
these: its own live in ``onnx_observe``).
"""

from __future__ import annotations

import sys
import threading

from amanda.runtime import swapped

_observation = threading.local()   # .hosted, .budget (per thread)

#: default of `observation_budget`: bytes of observed tensors fetched per run
OBSERVATION_BUDGET = 64 << 20


def hosted_observation():
    """Graphs rewritten inside run observe-only routines inside the run.

    By default, routines that can only return None at the top level of a
    ``Session.run`` graph are called after the run on the tensors they read,
    fetched with the run. Inside this scope (per thread) graphs rewritten
    then host them as callbacks during the run, next to their ops: for
    routines whose timing matters. The choice is made when a graph's ops are
    rewritten (a scope's first run of a graph, or of ops new to it).
    """
    return swapped(_observation, "hosted", True)


def observation_budget(nbytes):
    """Fetch at most ``nbytes`` of observed tensors per run (static shapes,
    an unknown dimension counted as 1); routines past it are hosted, as in
    `hosted_observation`. Default `OBSERVATION_BUDGET` (64 MiB); per thread."""
    return swapped(_observation, "budget", int(nbytes))


def fetch_budget():
    """The bytes observed routines may fetch now, or None where they must
    be hosted (`hosted_observation`, this module's or ONNX's)."""
    onnx = getattr(sys.modules.get("amanda.runtime.onnx_observe"), "_observation", None)
    if getattr(_observation, "hosted", False) or getattr(onnx, "hosted", False):
        return None
    budget = getattr(_observation, "budget", None)
    if budget is None:
        budget = getattr(onnx, "budget", None)
    return OBSERVATION_BUDGET if budget is None else budget
