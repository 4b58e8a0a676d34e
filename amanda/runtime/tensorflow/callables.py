"""TensorFlow graph mode: running the shadow's instrumented step through a
session callable (``CallableOptions``) instead of ``Session.run``.

``Session.run`` spends about 9.5 µs of Python per fetched tensor; a callable
made once per (fetches, feeds, targets) spends about 0.5 µs. The callable
answers differently in two ways, both handled here so that a run answers
exactly as ``Session.run`` would:

* **Results may alias TensorFlow's buffers.** ``Session.run`` hands over a
  result's buffer only when nothing else holds it and copies it otherwise
  (a constant's, a variable's, a fed array's, a buffer shared by two
  fetches); a callable always hands it over, so a later in-place update of
  a v1 variable, or the caller writing into the array, would show on the
  other side. Which buffers are shared cannot be read from Python, and a
  graph rewrite (Grappler) can make any tensor a constant's or a
  variable's, so every array result is copied (NumPy scalars and bytes are
  immutable and kept). The copy is cheap for small tensors; a step whose
  results average more than `COPY_LIMIT` bytes, or total more than
  `COPY_TOTAL_LIMIT`, runs through ``Session.run`` (which moves unshared
  buffers for free): from the start where their static shapes say so,
  else from its next run on.
* **Feeds are not checked or converted.** A feed value is converted as
  ``Session.run`` converts it (``np_asarray`` to the tensor's dtype) and its
  shape checked against the tensor's static shape; anything else unusual
  (a Python ``int``, a ``tf.Tensor`` or ``TensorHandle`` value, a failing
  conversion, an incompatible shape, an unfeedable tensor, a string or
  ref/resource/variant tensor) is left to ``Session.run``, which raises its
  own error or does its own thing.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.util import numpy_compat

#: Mean bytes per array result above which a step goes back to ``Session.run``.
COPY_LIMIT = 64 * 1024
#: Total bytes of array results above which a step goes back to ``Session.run``:
#: copies are held beside the results, so this bounds what they add to a run's
#: peak memory (a few small observed tensors fetched with a model's gradients
#: kept the mean low while the copies added 240 MiB)
COPY_TOTAL_LIMIT = 16 * 1024 * 1024

_UNUSUAL = frozenset({tf.string, tf.resource, tf.variant})


def _plain(tensor):
    dtype = tensor.dtype
    return not dtype._is_ref_dtype and dtype.base_dtype not in _UNUSUAL


class _Step:
    """One callable and what is needed to feed it like ``Session.run``."""

    __slots__ = ("call", "feeds", "n_fetches", "ops", "slow")

    def __init__(self, session, fetches, feeds, targets):
        options = config_pb2.CallableOptions()
        options.fetch.extend(t.name for t in fetches)
        options.feed.extend(t.name for t in feeds)
        options.target.extend(op.name for op in targets)
        self.call = session._make_callable_from_options(options)
        graph = session.graph
        # per feed: (numpy dtype, static shape, feedable)
        self.feeds = [(t.dtype.as_numpy_dtype, t.get_shape(), graph.is_feedable(t))
                      for t in feeds]
        self.n_fetches = len(fetches)
        self.slow = False


class _Callables:
    """The callables of one shadow session, per (fetches, feeds, targets),
    dropped when the copy's graph or its session changes."""

    def __init__(self):
        self._steps = {}
        self._valid_for = None   # (session, graph version)

    def run(self, session, fetches, feeds, targets):
        """The values ``Session.run(session, [*fetches, *targets], feeds)``
        returns for ``fetches`` (tensors), or None where ``Session.run``
        must answer (then nothing ran)."""
        valid_for = (session, session.graph.version)
        if self._valid_for != valid_for:
            self._steps = {}
            self._valid_for = valid_for
        tensors, ops = fetches, targets
        fed = list(feeds)
        key = (tuple(t.name for t in tensors), tuple(t.name for t in fed),
               tuple(op.name for op in ops))
        step = self._steps.get(key)
        if step is None:
            step = self._make(session, key, tensors, fed, ops)
            self._steps[key] = step
        if step is False or step.slow:
            return None
        args = []
        for (dtype, shape, feedable), value in zip(step.feeds, feeds.values()):
            array = _convert(value, dtype, shape, feedable)
            if array is None:
                return None
            args.append(array)
        results = session._do_call(step.call, *args)   # TF's error wording and types
        values, size, arrays = [], 0, 0
        for value in results:
            if isinstance(value, np.ndarray):
                value = value.copy()
                size += value.nbytes
                arrays += 1
            values.append(value)
        if arrays and (size > COPY_LIMIT * arrays or size > COPY_TOTAL_LIMIT):
            step.slow = True
        return values

    @staticmethod
    def _make(session, key, tensors, fed, ops):
        fetch_names, feed_names = key[0], set(key[1])
        if (len(set(fetch_names)) != len(fetch_names) or feed_names.intersection(fetch_names)
                or not all(isinstance(t, tf.Tensor) for t in tensors)
                or not all(isinstance(op, tf.Operation) for op in ops)
                or not all(_plain(t) for t in tensors) or not all(_plain(t) for t in fed)):
            return False
        # known large before the first run: copying its results even once
        # would hold them twice (a BERT-sized step's gradients: 250 MiB)
        sizes = [_static_bytes(t) for t in tensors]
        known = [size for size in sizes if size is not None]
        if sum(known) > COPY_TOTAL_LIMIT or (
                sizes and len(known) == len(sizes) and sum(sizes) > COPY_LIMIT * len(sizes)):
            return False
        return _Step(session, tensors, fed, ops)


def _static_bytes(tensor):
    """The bytes of ``tensor`` by its static shape, or None if not known."""
    shape = tensor.shape
    if not shape.is_fully_defined():
        return None
    return shape.num_elements() * tensor.dtype.size


def _convert(value, dtype, shape, feedable):
    """The array ``Session.run`` would feed for ``value``, or None where it
    would raise or treat the value specially."""
    if not feedable or isinstance(value, (int, tf.Tensor)) or not (
            isinstance(value, (np.ndarray, np.generic, float, bool, list, tuple))):
        return None
    try:
        array = numpy_compat.np_asarray(value, dtype)
    except (TypeError, ValueError, OverflowError):
        return None
    if array.dtype != dtype or not shape.is_compatible_with(array.shape):
        return None
    return array
