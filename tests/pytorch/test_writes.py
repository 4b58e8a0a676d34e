"""What an op writes is carried into the originals of tensors a before-routine
replaced, however the op is reached: ``F.batch_norm``, ``torch.native_batch_norm``
and ``torch.ops.aten`` packets and overloads (whose schemas declare their writes,
or do not and are probed)."""

import pytest
import torch

import amanda


class Clones(amanda.Tool):
    """A before-routine handing back copies of every input."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        context.insert_before_op(self.copy)

    def copy(self, *tensors):
        return [t.clone() for t in tensors]


def _stats():
    return torch.zeros(3), torch.ones(3)


CALLS = {
    "F.batch_norm": lambda x, m, v: torch.nn.functional.batch_norm(x, m, v, training=True),
    "torch.batch_norm": lambda x, m, v: torch.batch_norm(x, None, None, m, v, True, 0.1, 1e-5,
                                                         False),
    "torch.native_batch_norm": lambda x, m, v: torch.native_batch_norm(x, None, None, m, v,
                                                                       True, 0.1, 1e-5),
    "aten._batch_norm_with_update": lambda x, m, v: torch.ops.aten._batch_norm_with_update(
        x, None, None, m, v, 0.1, 1e-5),
    "aten._native_batch_norm_legit.default":
        lambda x, m, v: torch.ops.aten._native_batch_norm_legit.default(x, None, None, m, v,
                                                                         True, 0.1, 1e-5),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_running_statistics_are_updated_under_a_copying_routine(name):
    call = CALLS[name]
    x = torch.randn(4, 3, 5)
    plain = _stats()
    call(x, *plain)
    assert not torch.equal(plain[0], torch.zeros(3)), "the op updated nothing plainly"
    for run in range(2):   # the first call of its kind probes; the second uses what it saw
        with amanda.apply(Clones()):
            stats = _stats()
            call(x, *stats)
        assert torch.equal(stats[0], plain[0]) and torch.equal(stats[1], plain[1]), (name, run)


def test_evaluation_mode_writes_nothing_under_a_copying_routine():
    x = torch.randn(4, 3, 5)
    with amanda.apply(Clones()):
        for _ in range(2):
            mean, var = _stats()
            torch.nn.functional.batch_norm(x, mean, var, training=False)
            assert torch.equal(mean, torch.zeros(3)) and torch.equal(var, torch.ones(3))
