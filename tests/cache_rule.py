"""The differential test of the one cache rule, shared by the five paths
(tests/pytorch/test_cache_rule.py, tests/tensorflow/test_cache_rule_tf.py,
tests/onnx/test_cache_rule_onnx.py): inside ``amanda.cache_disabled()`` the
tools' analysis runs at every execution, and nothing else changes.
Framework-free."""

import collections

import amanda


class Recording(amanda.Tool):
    """Counts analyses per op, and executions per (op id, point); with
    ``backward``, before every backward op too."""

    def __init__(self, backward=False):
        super().__init__()
        self.analyses = collections.Counter()
        self.executions = collections.Counter()
        self.add_inst_for_op(self.analyse)
        if backward:
            self.add_inst_for_op(self.analyse_backward, backward=True)

    def analyse(self, context):
        op = context.get_op_id()
        self.analyses[op] += 1
        context.insert_before_op(self.seen, key=(op, "before"))
        context.insert_after_op(self.seen, key=(op, "after"))

    def analyse_backward(self, context):
        op = context.get_backward_op_id()
        self.analyses[op] += 1
        context.insert_before_backward_op(self.seen, key=(op, "before backward"))

    def seen(self, *values, key):
        self.executions[key] += 1


def assert_one_rule(cached, uncached, executions, at_creation=0):
    """``cached`` and ``uncached`` ran the same program ``executions`` times,
    with the cache on and inside ``cache_disabled()``: the same executions
    of every (op id, point), one analysis per op cached, and one per op and
    execution uncached (plus ``at_creation``, where making the program
    analyses it once before its first execution)."""
    assert cached.executions, "no routine ran"
    assert uncached.executions == cached.executions
    assert set(uncached.analyses) == set(cached.analyses)
    assert set(cached.analyses.values()) == {1}, "cached: one analysis per op"
    assert set(uncached.analyses.values()) == {executions + at_creation}, \
        "uncached: one analysis per op and execution"
