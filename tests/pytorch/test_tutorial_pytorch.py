"""The seed tutorial's PyTorch cells, with today's models and op names."""

import copy

import pytest
import torch

import amanda
from amanda.tools.mapping import MappingTool
from tests.models import FunctionalReluNet, build_model, first_output


class CountOPTool(amanda.Tool):
    """The tutorial's counter: forward calls of one op, backward calls of one
    backward op."""

    def __init__(self, op_name, backward_op_name):
        super().__init__()
        self.counter = 0
        self.backward_counter = 0
        self.op_name = op_name
        self.backward_op_name = backward_op_name
        self.forward_ids = set()
        self.backward_owner_ids = set()
        self.add_inst_for_op(self.callback)
        self.add_inst_for_op(self.backward_callback, backward=True, require_outputs=True)

    def callback(self, context):
        if self.op_name in context.get_op().__name__:
            self.forward_ids.add(context.get_op_id())
            context.insert_before_op(self.counter_op)

    def backward_callback(self, context):
        if self.backward_op_name in context.get_backward_op().__name__:
            self.backward_owner_ids.add(context.get_op_id())
            context.insert_after_backward_op(self.counter_backward_op)

    def counter_op(self, *inputs):
        self.counter += 1
        return inputs

    def counter_backward_op(self, *inputs):
        self.backward_counter += 1
        return inputs


def run_counted(model, x, tool):
    with amanda.tool.apply(tool):
        y = first_output(model(x))
        y.backward(torch.rand_like(y))
    return tool


def test_cnn_counts_conv_forward_and_backward(cnn):
    tool = run_counted(cnn, torch.rand(1, 3, 32, 32), CountOPTool("conv2d", "Conv"))
    assert (tool.counter, tool.backward_counter) == (4, 4)
    # every counted backward op belongs to a counted forward conv
    assert tool.backward_owner_ids == tool.forward_ids


def test_counts_accumulate_over_iterations_with_cached_analysis(cnn):
    tool = CountOPTool("conv2d", "Conv")
    analysed = []
    tool.add_inst_for_op(lambda c: analysed.append(c.get_op_id()))
    x = torch.rand(1, 3, 32, 32)
    for _ in range(3):
        run_counted(cnn, x, tool)
    assert (tool.counter, tool.backward_counter) == (12, 12)
    # analysis ran once per op: the second and third steps replayed actions
    assert len(analysed) == len(set(analysed))


def test_functional_relu_seen_by_amanda_missed_by_module_hooks(functional_cnn):
    x = torch.rand(1, 3, 32, 32)
    hooked = []
    handles = [m.register_forward_hook(lambda *a: hooked.append(1))
               for m in functional_cnn.modules() if type(m).__name__ == "ReLU"]
    tool = run_counted(functional_cnn, x, CountOPTool("relu", "Relu"))
    for h in handles:
        h.remove()
    assert hooked == []
    assert (tool.counter, tool.backward_counter) == (1, 1)


@pytest.mark.slow
def test_resnet50_conv_counts():
    model, x = build_model("resnet50")
    tool = run_counted(model, x, CountOPTool("conv2d", "Conv"))
    assert (tool.counter, tool.backward_counter) == (53, 53)


@pytest.mark.slow
def test_bert_linear_counts_follow_the_backward_path():
    model, x = build_model("bert")
    tool = run_counted(model, x, CountOPTool("linear", "Addmm"))
    assert tool.counter == 73
    # the pooler's linear is not on last_hidden_state's backward path
    assert tool.backward_counter == 72
    assert len(tool.backward_owner_ids) == 72
    assert tool.backward_owner_ids < tool.forward_ids


def test_rnn_one_forward_op_owns_all_its_backward_ops():
    model, x = build_model("rnn")

    class Owners(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.forward, self.backward = [], []
            self.add_inst_for_op(lambda c: self.forward.append(c.get_op_name()))
            self.add_inst_for_op(lambda c: self.backward.append(
                (c.get_op_name(), c.get_op_id(), c.get_backward_op().__name__)), backward=True)

    tool = Owners()
    with amanda.apply(tool):
        y = model(x)[0]
        y.backward(torch.rand_like(y))
    rnn_ops = [name for name in tool.forward if name.startswith("rnn")]
    assert rnn_ops == ["rnn_tanh"]
    owned = [b for b in tool.backward if b[0] == "rnn_tanh"]
    assert len({op_id for _, op_id, _ in owned}) == 1
    # 4 layers x 16 steps: one tanh backward per layer and step, all owned by rnn_tanh
    assert sum(1 for *_, name in owned if name == "TanhBackward0") == 64
    assert len(owned) > 200


def compute_mask(tensor, sparsity=0.5):
    """The tutorial's magnitude mask (1 keeps a value, 0 prunes it)."""
    with torch.no_grad():
        flat = tensor.reshape(-1).abs()
        k = int(flat.numel() * sparsity)
        _, indices = torch.topk(flat, k, largest=False)
        mask = torch.ones_like(flat)
        mask[indices] = 0
    return mask.view_as(tensor)


class PruningTool(amanda.Tool):
    """The tutorial's pruning tool, extended with gradient masking."""

    def __init__(self):
        super().__init__()
        self.masks = {}
        self.add_inst_for_op(self.forward_analysis)
        self.add_inst_for_op(self.backward_analysis, backward=True, require_outputs=True)

    def forward_analysis(self, context):
        if context.get_op().__name__ not in ("conv2d", "linear"):
            return
        weight = context.get_inputs()[1]
        mask = compute_mask(weight)
        context["mask"] = mask
        self.masks[context.get_op_id()] = (weight, mask)
        context.insert_before_op(self.mask_weight, inputs=[1], mask=mask)

    def backward_analysis(self, context):
        name = context.get_backward_op().__name__
        if "mask" in context and name in ("ConvolutionBackward0", "TBackward0"):
            # the weight's gradient: ConvolutionBackward0 output 1, or the
            # transpose node's only output for linear layers
            position = 1 if name == "ConvolutionBackward0" else 0
            context.insert_after_backward_op(self.mask_grad, grad_inputs=[position],
                                             mask=context["mask"])

    def mask_weight(self, weight, mask):
        return torch.mul(weight, mask)

    def mask_grad(self, grad, mask):
        return grad * mask if grad is not None else None


def test_pruning_tool_in_a_training_loop(cnn):
    x = torch.rand(4, 3, 32, 32)
    target = torch.randint(0, 10, (4,))
    params_before = [p.detach().clone() for p in cnn.parameters()]
    tool = PruningTool()
    with amanda.apply(tool):
        out = cnn(x)
        loss = torch.nn.functional.cross_entropy(out, target)
        loss.backward()
    assert len(tool.masks) == 6  # 4 conv + 2 linear
    # parameters themselves are untouched by the forward masking
    for before, p in zip(params_before, cnn.parameters()):
        assert torch.equal(before, p)
    # gradients of masked weights are zero where the mask is zero
    for weight, mask in tool.masks.values():
        assert weight.grad is not None
        assert torch.count_nonzero(weight.grad[mask == 0]) == 0
        assert torch.count_nonzero(weight.grad[mask == 1]) > 0
    # the forward ran with masked weights: compare against masking by hand
    with torch.no_grad():
        expected_model = copy.deepcopy(cnn)
        for module in expected_model.modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
                module.weight.mul_(compute_mask(module.weight))
        assert torch.allclose(expected_model(x), out.detach(), atol=1e-6)
    # a few SGD steps: masked weights receive zero updates
    optimizer = torch.optim.SGD(cnn.parameters(), lr=0.1)
    start = {id(w): w.detach().clone() for w, _ in tool.masks.values()}
    for _ in range(3):
        optimizer.zero_grad()
        with amanda.apply(tool):
            torch.nn.functional.cross_entropy(cnn(x), target).backward()
        optimizer.step()
    for weight, mask in tool.masks.values():
        moved = weight.detach() != start[id(weight)]
        assert not moved[mask == 0].any()
        assert moved[mask == 1].any()


def torch_op_name_rule(context):
    context["op_name"] = context.get_op().__name__
    backward_op = context.get_backward_op()
    context["backward_op_name"] = backward_op.__name__ if backward_op is not None else None


class MappedCountOPTool(amanda.Tool):
    """The tutorial's final counter: names come from the mapping rules."""

    def __init__(self, op_name, backward_op_name, mapping_tool):
        super().__init__()
        self.depends_on(mapping_tool)
        self.counter = 0
        self.backward_counter = 0
        self.op_name = op_name
        self.backward_op_name = backward_op_name
        self.add_inst_for_op(self.callback)
        self.add_inst_for_op(self.backward_callback, backward=True, require_outputs=True)

    def callback(self, context):
        if self.op_name in context["op_name"]:
            context.insert_before_op(self.counter_op)

    def backward_callback(self, context):
        if self.backward_op_name in context["backward_op_name"]:
            context.insert_after_backward_op(self.counter_backward_op)

    def counter_op(self, *inputs):
        self.counter += 1
        return inputs

    def counter_backward_op(self, *inputs):
        self.backward_counter += 1
        return inputs


def test_mapping_tool_counter(cnn):
    ignored = []
    mapping = MappingTool(rules=[["pytorch", torch_op_name_rule],
                                 ["tensorflow", lambda c: ignored.append(c)]])
    tool = MappedCountOPTool("conv2d", "Conv", mapping)
    run_counted(cnn, torch.rand(1, 3, 32, 32), tool)
    assert (tool.counter, tool.backward_counter) == (4, 4)
    assert ignored == []


def test_functional_model_counter_via_mapping():
    mapping = MappingTool(rules=[["pytorch", torch_op_name_rule]])
    tool = MappedCountOPTool("relu", "Relu", mapping)
    run_counted(FunctionalReluNet(10), torch.rand(1, 3, 32, 32), tool)
    assert (tool.counter, tool.backward_counter) == (1, 1)
