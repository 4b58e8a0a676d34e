"""The PyTorch eager path: every operator call is an instrumentation point.

Its modules (see "How the runtime is organised" in ``docs/pytorch-eager.md``):
``sites`` (which calls are points, calling sites), ``records`` (op records,
the session cache), ``segments`` (per-thread state, checkpointed segments),
``mode`` (the ``TorchFunctionMode``, the hot path), ``routines`` (analysis,
actions, ``replace_op``), ``writes`` (in-place writes and replacements),
``backward`` (the autograd walk and node hooks) and ``driver`` (``DRIVER``,
the global module hooks). :mod:`amanda.runtime.pytorch` re-exports the names
other modules, tests and docs use.
"""
