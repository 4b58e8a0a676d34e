"""A replacement takes the memory layout of the tensor it replaces, broadcast
tensors included: the gradient ``sum()`` sends back is a stride-0 ``expand``,
and batch norm's backward sums it to other bits than its compact copy (found
by the module sweep, ``test_module_sweep.py``: every batch and instance norm
under backward routines returning clones)."""

import torch

import amanda


class Copies(amanda.Tool):
    """Routines returning clones of what they receive: of the inputs of every
    op and the gradients every backward op gives (``sum``'s is broadcast)."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analyse)
        self.add_inst_for_op(self.analyse_backward, backward=True, require_outputs=True)

    def analyse(self, context):
        context.insert_before_op(self.copy)

    def analyse_backward(self, context):
        context.insert_after_backward_op(self.copy)

    def copy(self, *tensors):
        return [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors]


def _batch_norm_gradients():
    torch.manual_seed(0)
    x = torch.randn(4, 5, requires_grad=True)
    weight = torch.randn(5, requires_grad=True)
    out = torch.nn.functional.batch_norm(x, torch.zeros(5), torch.ones(5), weight,
                                         training=True)
    return torch.autograd.grad(out.sum(), [x, weight])


def test_a_copied_broadcast_gradient_keeps_batch_norms_backward_bit_exact():
    plain = _batch_norm_gradients()
    with amanda.apply(Copies()):
        got = _batch_norm_gradients()
    for want, have in zip(plain, got):
        assert torch.equal(want, have)


def _replaced(tensor, routine):
    seen = []

    class Tool(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op_name() == "mul":
                context.insert_before_op(routine, inputs=[0])

    def look(*tensors):
        seen.append(tensors[0])

    class Look(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op_name() == "mul":
                context.insert_before_op(look, inputs=[0])

    with amanda.apply(Tool(), Look()):
        out = tensor * 2
    return seen[0], out


def test_a_copy_of_a_broadcast_tensor_is_broadcast_again():
    original = torch.randn(1, 3).expand(4, 3)
    got, out = _replaced(original, lambda t: t.clone())
    assert got.stride() == original.stride() == (0, 1)
    assert torch.equal(out, original * 2)


def test_other_values_along_a_broadcast_dimension_are_kept_as_made():
    original = torch.zeros(1, 3).expand(4, 3)
    other = torch.arange(12.0).reshape(4, 3)
    got, out = _replaced(original, lambda t: other.clone())
    assert torch.equal(got, other) and got.is_contiguous()
    assert torch.equal(out, other * 2)
