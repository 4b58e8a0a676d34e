"""Python's cyclic garbage collector, paused while amanda instruments a program.

Instrumenting a model makes thousands of short-lived container objects (the
IR graph, whose ops and tensors refer to each other, the analysis contexts,
the lowering's tables), most of them garbage once the instrumented program
is made. With the collector running, its young-generation collections fire
every few hundred allocations during that work: the objects still in use
are promoted, and every few of those promotions Python counts towards a
full collection, which walks every tracked object of the process (0.2-0.3 s
with torch imported, for a session creation of some 50 ms). Measured on the
small BERT session of ``benchmarks/session_creation.py``: about eleven
young collections per creation, and a full one every ten creations.

`paused` (a context manager) disables the collector for that span and, when
the last overlapping span ends, enables it again and collects the youngest
generation once: the work's garbage dies young, in one pass over what it
allocated, and only what outlives the work (the instrumented program's
plan) is promoted. The rule: amanda pauses the collector only around its
own instrumenting work, never around a user's run; spans on several
threads nest (a count), and the collector is enabled again only if amanda
disabled it (a collector the user disabled stays off; enabling or disabling
it from another thread during the span is not told apart).

Inside a span, `collect_young` collects the youngest generation at once
(only where amanda paused the collector): an ONNX session's creation drops
the IR graph once its plan is prepared and collects it while onnxruntime
still optimises the model on another thread, so that collection is off the
creation's critical path.

Used where it was measured to matter: ONNX session creation. TensorFlow's
rewrite of a ``tf.function`` (a Keras ``SimpleRNN`` training step, 1,598
routine calls) spent 0.02 s of a 3 s first call in the collector, with
no full collection, so it is not paused there.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_depth = 0
_ours = False   # amanda disabled it (it was enabled when the first span began)


class _Paused:
    __slots__ = ()

    def __enter__(self):
        global _depth, _ours
        with _lock:
            if _depth == 0 and gc.isenabled():
                gc.disable()
                _ours = True
            _depth += 1
        return self

    def __exit__(self, *exc):
        global _depth, _ours
        with _lock:
            _depth -= 1
            resume = _depth == 0 and _ours
            if resume:
                _ours = False
                gc.enable()
        if resume:
            gc.collect(0)
        return False


_PAUSED = _Paused()


def collect_young():
    """Collect the youngest generation now, inside a span, where amanda
    paused the collector (one the user turned off stays untouched): for
    garbage made early in the span, collected while the span waits for
    work on another thread (an ONNX session's optimisation)."""
    if _ours:
        gc.collect(0)


def paused():
    """A context manager: the cyclic collector is off inside (see the module)."""
    return _PAUSED
