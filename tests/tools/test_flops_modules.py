"""FLOPs per module (parameters, output shape, forward/backward FLOPs),
auto-scaled units, and recurrent ops counted against a hand formula."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda.models import tutorial_cnn  # noqa: E402
from amanda.tools.flops import RNN_ELEMENTWISE, FlopsProfiler, format_count  # noqa: E402


def _count(model, x, backward=True):
    profiler = FlopsProfiler()
    with amanda.apply(profiler):
        out = model(x)
        if backward:
            (out[0] if isinstance(out, tuple) else out).sum().backward()
    return profiler


def _hand_rnn(kind, input_size, hidden, layers, bidirectional, steps, batch):
    """Matrix products 2*T*B*(gates*H)*(I_l + H) per layer and direction,
    plus the gate arithmetic per hidden unit and step."""
    gates = {"rnn_tanh": 1, "lstm": 4, "gru": 3}[kind]
    directions = 2 if bidirectional else 1
    total = 0
    for layer in range(layers):
        width = input_size if layer == 0 else hidden * directions
        per_direction = 2 * steps * batch * gates * hidden * (width + hidden)
        per_direction += RNN_ELEMENTWISE[kind] * steps * batch * hidden
        total += directions * per_direction
    return total


@pytest.mark.parametrize("kind, module, bidirectional", [
    ("rnn_tanh", torch.nn.RNN, False), ("lstm", torch.nn.LSTM, True),
    ("gru", torch.nn.GRU, False)])
def test_recurrent_ops_match_the_hand_formula(kind, module, bidirectional):
    torch.manual_seed(0)
    model = module(6, 5, num_layers=2, bidirectional=bidirectional, batch_first=True)
    profiler = _count(model, torch.rand(3, 7, 6))          # batch 3, 7 steps
    assert profiler.by_type("forward")[kind] == _hand_rnn(kind, 6, 5, 2, bidirectional, 7, 3)
    assert not profiler.unknown
    # backward nodes of a recurrent op are not charged its whole count per node
    assert kind not in profiler.by_type("backward")


def test_rnn_matrix_products_agree_with_flop_counter_mode():
    from torch.utils.flop_counter import FlopCounterMode
    model, x = torch.nn.RNN(8, 16, 3), torch.rand(5, 2, 8)
    profiler = _count(model, x, backward=False)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x)
    gates = RNN_ELEMENTWISE["rnn_tanh"] * 5 * 2 * 16 * 3   # not matrix products
    assert profiler.by_type("forward")["rnn_tanh"] - gates == counter.get_total_flops()


def test_module_table_has_parameters_output_shapes_and_flops(cnn):
    outputs = {}

    def keep_shape(name):
        def hook(module, inputs, output):
            outputs.setdefault(name, output.shape)
        return hook

    handles = [m.register_forward_hook(keep_shape(name)) for name, m in cnn.named_modules()]
    profiler = _count(cnn, torch.rand(1, 3, 32, 32))
    for handle in handles:
        handle.remove()
    rows = {r["module"]: r for r in profiler.modules()}
    named = dict(cnn.named_modules())
    assert set(rows) == set(named)
    for name, row in rows.items():
        assert row["parameters"] == sum(p.numel() for p in named[name].parameters()), name
        assert tuple(row["output_shape"]) == tuple(outputs[name]), name
        assert row["depth"] == (name.count(".") + 1 if name else 0)
    # children add up into the root; only the loss's sum runs outside the model
    assert rows[""]["forward"] == profiler.total("forward") - profiler.by_type()["sum"]
    assert rows[""]["backward"] == profiler.total("backward")
    conv1 = cnn.conv_layer1
    assert rows["conv_layer1"]["forward"] == 2 * 32 * 30 * 30 * 3 * 9
    # the first layer's input needs no gradient: its weight's gradient only
    assert rows["conv_layer1"]["backward"] == rows["conv_layer1"]["forward"]
    assert rows["conv_layer1"]["parameters"] == conv1.weight.numel() + conv1.bias.numel()
    assert [r["module"] for r in profiler.modules(max_depth=0)] == [""]
    table = profiler.module_table()
    assert "conv_layer1" in table and "(1, 32, 30, 30)" in table and "0.0M" not in table


def test_units_scale_and_never_round_a_count_to_zero():
    assert format_count(0) == "0" and format_count(128) == "128"
    assert format_count(1560) == "1.56K" and format_count(29_130_890) == "29.13M"
    assert format_count(8_174_272_512) == "8.17G" and format_count(3.2e12) == "3.20T"


def test_cli_prints_the_module_table_in_units(tmp_path, capsys):
    import json

    from amanda.cli import main
    assert main(["flops", "cnn", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "FLOPs per module" in out and "1x32x30x30" in out and "271.79K" in out
    assert "0.0M" not in out and "128" in out
    (report,) = json.loads((tmp_path / "flops.json").read_text())
    assert {r["module"] for r in report["modules"]} >= {"", "conv_layer1", "fc2"}
