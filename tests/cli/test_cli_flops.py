"""Issue 30: `amanda flops` prints no 0 for "no formula" (forward or
backward: a count, `?` with the types listed, or `-` where nothing ran), and
its per-module table has a layer type, parameters (total, trainable), a
share of the total, and repeated blocks as one row."""

import contextlib
import io
import json
import re

import pytest

from amanda.cli import main

pytest.importorskip("torch")
pytest.importorskip("transformers")

# op types whose arithmetic in that phase is truly none: an embedding lookup
# (forward), an addition's and a sum's gradients (passed through, broadcast)
TRULY_ZERO = {("embedding", "forward"), ("add", "backward"), ("sum", "backward")}


def _flops(argv, folder):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["flops", *argv, "--out", str(folder)])
    assert status == 0
    with open(folder / "flops.json") as f:
        return out.getvalue(), {r["model"]: r for r in json.load(f)}


def _table(text, title):
    """Rows (cells split on 2+ spaces) of the plain table titled ``title``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    header, rows = lines[start + 1], []
    for line in lines[start + 3:]:
        if not line.strip() or set(line) <= {"-", " "}:
            break
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == len(re.split(r"\s{2,}", header.strip())):   # not a note
            rows.append(cells)
    return header, rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _flops(["bert", "gpt2", "cnn"], tmp_path_factory.mktemp("flops"))


@pytest.mark.parametrize("spec", ["bert", "gpt2", "cnn"])
def test_no_count_prints_zero_unless_the_op_costs_nothing(runs, spec):
    out, results = runs
    _, rows = _table(out, f"{spec} (pytorch): FLOPs per op type")
    assert rows
    for op_type, forward, backward, _ in rows:
        for phase, cell in (("forward", forward), ("backward", backward)):
            if cell == "0":
                assert (op_type, phase) in TRULY_ZERO, (spec, op_type, phase)
    result = results[spec]
    assert result["unknown"] == {"forward": {}, "backward": {}}
    by_type = result["by_type"]
    # the backward of attention, layer_norm and gelu are computed, not 0
    for op_type in ("scaled_dot_product_attention", "layer_norm", "gelu", "mul", "pow",
                    "tanh", "max_pool2d", "relu", "embedding"):
        if op_type in by_type and op_type != "tanh" or (spec == "gpt2" and op_type == "tanh"):
            assert by_type[op_type]["backward"] > 0, (spec, op_type)
    if spec != "cnn":
        sdpa = by_type["scaled_dot_product_attention"]
        assert sdpa["backward"] == 2 * sdpa["forward"]    # four products of two's size
        # BERT's pooler gets no gradient: "-", not a computed 0
        if spec == "bert":
            assert dict((r[0], r[2]) for r in rows)["tanh"] == "-"


def test_an_op_without_a_backward_formula_is_a_question_mark(tmp_path, monkeypatch):
    from amanda.tools import flops_formulas
    monkeypatch.delitem(flops_formulas.BACKWARD_FORMULAS, "relu")
    out, results = _flops(["cnn"], tmp_path)
    _, rows = _table(out, "cnn (pytorch): FLOPs per op type")
    relu = next(r for r in rows if r[0] == "relu")
    assert relu[1] == "128" and relu[2] == "?"
    assert "? = no FLOP formula, not in the totals (backward: relu x1)" in out
    _, modules = _table(out, "cnn (pytorch): FLOPs per module")
    assert next(r for r in modules if r[0] == "relu1")[6] == "?"
    assert next(r for r in modules if r[0] == "model")[6].endswith("M+?")
    cnn = results["cnn"]
    assert cnn["unknown"] == {"forward": {}, "backward": {"relu": 1}}
    assert cnn["by_type"]["relu"] == {"forward": 128, "backward": None}


def test_the_module_table_has_types_parameters_shares_and_collapsed_blocks(runs):
    out, results = runs
    header, rows = _table(out, "bert (pytorch): FLOPs per module")
    assert re.split(r"\s{2,}", header.strip()) == [
        "module", "type", "params", "trainable", "output shape", "forward FLOPs",
        "backward FLOPs", "% FLOPs"]
    by_name = {r[0]: r for r in rows}
    assert by_name["model"][1:4] == ["BertModel", "109.48M", "109.48M"]
    assert by_name["model"][7] == "100.0%"
    block = by_name["encoder.layer.0-11"]
    assert block[1] == "BertLayer x12" and block[2] == "85.05M"
    assert by_name["encoder.layer.0-11.attention"][1] == "BertAttention x12"
    assert not any(r[0].startswith("encoder.layer.1") for r in rows)   # collapsed
    _, rows = _table(out, "gpt2 (pytorch): FLOPs per module")
    assert {r[0]: r[1] for r in rows}["h.0-11"] == "GPT2Block x12"
    # every block's own row in the JSON, with type and parameters
    modules = {m["module"]: m for m in results["bert"]["modules"]}
    assert modules["encoder.layer.11"]["type"] == "BertLayer"
    assert modules["encoder.layer.11"]["trainable"] == modules["encoder.layer.0"]["trainable"]


def test_no_collapse_and_depth_list_every_block(tmp_path):
    out, _ = _flops(["bert", "--no-collapse", "--depth", "3"], tmp_path)
    _, rows = _table(out, "bert (pytorch): FLOPs per module")
    names = [r[0] for r in rows]
    assert [f"encoder.layer.{i}" for i in range(12)] == [n for n in names
                                                           if n.startswith("encoder.layer.")]
