"""The ``amanda`` command line."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from amanda.cli import main


def _coverage(tmp_path, *models):
    assert main(["coverage", *models, "--out", str(tmp_path)]) == 0
    with open(tmp_path / "coverage.json") as f:
        return {r["model"]: r for r in json.load(f)}


def test_coverage_of_the_tutorial_cnn(tmp_path, capsys):
    report = _coverage(tmp_path, "cnn")["cnn"]
    assert report["amanda_forward_by_op"]["conv2d"] == 4
    assert report["missed_by_hooks"] == {"reshape": 1}   # out.reshape(...) in forward
    assert report["amanda_forward"] == 11 and report["hooks_forward"] == 10
    assert report["amanda_backward"] == 25 and report["hooks_backward"] == 10
    assert report["hooks_error"] is None
    out = capsys.readouterr().out
    assert "forward points amanda / hooks" in out
    assert "11 / 10 (9)" in out and "25 / 10" in out
    assert str(tmp_path / "coverage.json") in out


def test_coverage_of_a_model_from_a_file(tmp_path):
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh()), "
        "torch.rand(2, 8)\n")
    spec = f"{tmp_path / 'mymodel.py'}:build"
    report = _coverage(tmp_path, spec)[spec]
    assert report["amanda_forward_by_op"] == {"linear": 1, "tanh": 1, "sum": 1}
    assert report["hooks_forward"] == 3 and report["missed_by_hooks"] == {}


def test_unknown_model_fails_before_running_anything(tmp_path, capsys):
    assert main(["coverage", "cnn", "resnet5O", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "unknown model 'resnet5O'" in captured.err and "resnet50" in captured.err
    assert not os.path.exists(tmp_path / "coverage.json")


def test_help_teaches_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "coverage" in out and "demo" in out and "amanda coverage bert resnet50" in out


def test_coverage_help_names_the_models(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["coverage", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "gpt2-small" in out and "file.py:factory" in out and "example:" in out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_models_lists_the_builtins(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("cnn", "bert", "gpt2", "gpt2-small", "resnet50", "vit", "rnn"):
        assert f"\n{name} " in out


def test_demo_on_small_models(tmp_path, capsys):
    assert main(["demo", "--models", "cnn", "gpt2-small", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "class CountOPTool(amanda.Tool)" in out
    with open(tmp_path / "demo.json") as f:
        demo = json.load(f)
    counts = {c["model"]: c for c in demo["count"]}
    assert counts["cnn"]["forward"] == {"conv2d": 4, "linear": 2}
    assert counts["cnn"]["backward"] == {"Convolution": 4, "Addmm": 2}
    # GPT-2's Conv1D layers call torch.addmm directly, not F.linear
    assert counts["gpt2-small"]["forward"]["linear"] == 0
    assert counts["gpt2-small"]["backward"]["Addmm"] == 8
    coverage = {r["model"]: r for r in demo["coverage"]}
    assert coverage["gpt2-small"]["amanda_forward"] > coverage["gpt2-small"]["hooks_forward"]
    tools = demo["tools"]                       # part 3 runs on the first model
    assert tools["model"] == "cnn" and tools["quantize"]["ops"] == 6
    assert 0 < tools["quantize"]["relative_error"] < 0.02
    assert tools["flops"]["backward"] > tools["flops"]["forward"] > 0
    assert tools["nan_check"]["module_path"] == "conv_layer3"
    assert "amanda nan-check cnn --plant conv2d:2" in out


def test_console_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "amanda.cli", "--help"],
                            capture_output=True, text=True, check=True)
    assert "amanda coverage" in result.stdout


@pytest.mark.slow
def test_amanda_sees_more_points_than_module_hooks_on_bert(tmp_path):
    report = _coverage(tmp_path, "bert")["bert"]
    assert report["amanda_forward"] > report["hooks_forward"]
    assert report["amanda_backward"] > report["hooks_backward"]
    assert report["amanda_forward_by_op"]["linear"] == 73
    # residual adds and attention reshapes run in non-leaf modules' forward
    assert report["missed_by_hooks"]["add"] > 0
    assert report["amanda_backward_by_op"]["AccumulateGrad"] > 0


@pytest.mark.slow
def test_resnet50_full_backward_hooks_fail_and_are_reported(tmp_path):
    report = _coverage(tmp_path, "resnet50")["resnet50"]
    assert report["amanda_forward_by_op"]["conv2d"] == 53
    assert report["missed_by_hooks"] == {"add_": 16}   # the residual connections
    assert report["hooks_backward"] is None
    assert "modified inplace" in report["hooks_error"]


@pytest.mark.slow
def test_demo_default_models_count_the_tutorial_numbers(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "demo.json") as f:
        demo = json.load(f)
    counts = {c["model"]: c for c in demo["count"]}
    assert counts["cnn"]["forward"]["conv2d"] == 4
    assert counts["cnn"]["backward"]["Convolution"] == 4
    assert counts["bert"]["forward"]["linear"] == 73
    assert [r["model"] for r in demo["coverage"]] == ["bert", "resnet50"]


# -- the tool subcommands, run as docs/cli.md shows them ------------------------------------

import contextlib
import io
import pathlib
import shlex

from amanda import cli

CLI_DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _doc_commands():
    return [line[len("$ amanda "):] for line in CLI_DOC.read_text().splitlines()
            if line.startswith("$ amanda ")]


class Run:
    def __init__(self, status, out, err, folder):
        self.status, self.out, self.err, self.folder = status, out, err, folder

    def json(self, name):
        with open(self.folder / name) as f:
            return json.load(f)


def _run(argv, folder):
    argv = [str(folder / a[len("amanda-out/"):]) if a.startswith("amanda-out/") else a
            for a in argv] + ["--out", str(folder)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return Run(status, out.getvalue(), err.getvalue(), folder)


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory):
    """Every `$ amanda ...` line of docs/cli.md, run once: command line -> Run."""
    runs = {}
    for number, command in enumerate(_doc_commands()):
        runs[command] = _run(shlex.split(command), tmp_path_factory.mktemp(f"cli{number}"))
    return runs


def _conv_flops(model, size=32):
    """2 * output elements * Cin * kernel area per conv, walking the tutorial CNN."""
    import torch
    total, x = 0, torch.zeros(1, 3, size, size)
    for module in [model.conv_layer1, model.conv_layer2, model.max_pool1, model.conv_layer3,
                   model.conv_layer4]:
        x = module(x)
        if isinstance(module, torch.nn.Conv2d):
            total += 2 * x.numel() * module.in_channels * module.kernel_size[0] ** 2
    return total


def test_docs_commands_all_run(doc_runs):
    assert len(doc_runs) >= 9
    planted = ("--plant", "--perturb")
    for command, run in doc_runs.items():
        expected = 1 if any(p in command for p in planted) else 0
        assert run.status == expected, (command, run.err[-2000:])


def test_flops_cnn_and_its_keras_twin(doc_runs):
    from amanda.models import tutorial_cnn
    run = doc_runs["flops cnn keras:cnn --chart"]
    results = {r["model"]: r for r in run.json("flops.json")}
    conv = _conv_flops(tutorial_cnn())
    linear = 2 * (1600 * 128 + 128 * 10)
    for spec in ("cnn", "keras:cnn"):
        assert results[spec]["by_type"]["conv2d"]["forward"] == conv
        assert results[spec]["by_type"]["linear"]["forward"] == linear
    # two gradients per convolution, but the first one's input needs none:
    # the same backward count on both frameworks (and torch's FlopCounterMode)
    first = 2 * 30 * 30 * 32 * 3 * 3 * 3
    for spec in ("cnn", "keras:cnn"):
        assert results[spec]["by_type"]["conv2d"]["backward"] == 2 * conv - first
    assert results["keras:cnn"]["framework"] == "tensorflow"
    assert (run.folder / "flops-cnn.png").read_bytes()[:4] == b"\x89PNG"
    assert (run.folder / "flops-keras-cnn.png").exists()
    from amanda.tools.flops import format_count
    assert format_count(conv) in run.out and "conv_layer1" in run.out   # per-module table


def test_trace_writes_a_chrome_trace(doc_runs):
    run = doc_runs["trace cnn --kernels"]
    with open(run.folder / "trace.json") as f:
        events = json.load(f)["traceEvents"]
    names = [e.get("name") for e in events if e.get("ph") == "X" and e.get("cat") != "kernel"]
    assert names.count("conv2d") == 2 * 4                   # 2 measured steps, 4 convs ...
    assert names.count("ConvolutionBackward0") == 2 * 4     # ... and their backward ops
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert any(e["name"] == "ConvolutionBackward0" for e in kernels)   # --kernels nested
    profile = run.json("profile.json")
    assert profile["steps_measured"] == 2
    assert profile["forward_by_type"]["conv2d"]["calls"] == 2 * 4
    assert profile["by_type"]["conv2d"]["backward_us"] > 0
    assert "aten::" in run.out                               # the kernel breakdown


def test_quantize_and_export_qdq(doc_runs):
    run = doc_runs["quantize cnn --export amanda-out/cnn-qdq.onnx"]
    result = run.json("quantization.json")
    assert len(result["ops"]) == 6 and result["weight"] == "8-bit symmetric per-channel"
    assert 0 < result["relative_error"] < 0.02
    export = result["export"]
    assert export["quantize_linear"] == export["dequantize_linear"] == 12
    assert export["max_abs_diff_vs_eager"] < 1e-5
    import onnx
    model = onnx.load(run.folder / "cnn-qdq.onnx")
    assert sum(n.op_type == "QuantizeLinear" for n in model.graph.node) == 12
    conv1 = next(r for r in result["ops"] if r["module"] == "conv_layer1")
    assert len(conv1["weight"]["scale"]) == 32               # per output channel


def test_qat_beats_post_training_quantization_at_four_bits(doc_runs, tmp_path):
    qat = doc_runs["quantize cnn --weight-bits 4 --qat 20"].json("quantization.json")
    ptq_run = _run(["quantize", "cnn", "--weight-bits", "4"], tmp_path)
    assert ptq_run.status == 0
    ptq = ptq_run.json("quantization.json")
    losses = qat["qat_losses"]
    assert len(losses) == 20 and losses[-1] < losses[0]
    assert qat["relative_error"] < ptq["relative_error"]
    assert qat["weight"] == ptq["weight"] == "4-bit symmetric per-channel"


def test_nan_check_names_the_planted_ops(doc_runs, tmp_path):
    forward = doc_runs["nan-check cnn --plant conv2d:2"].json("nan.json")
    assert forward["found"] and not forward["report"]["backward"]
    assert forward["report"]["op_name"] == "conv2d"
    assert forward["report"]["module_path"] == "conv_layer3"
    backward = doc_runs["nan-check cnn --plant-backward linear:1"].json("nan.json")
    assert backward["report"]["backward"]
    assert backward["report"]["module_path"] == "fc2"
    assert backward["report"]["backward_op_name"] == "AddmmBackward0"
    clean = _run(["nan-check", "cnn", "--stats"], tmp_path)
    assert clean.status == 0 and not clean.json("nan.json")["found"]
    stats = clean.json("stats.json")
    assert sum(row["op_name"] == "conv2d" for row in stats) == 4


def test_diff_names_the_perturbed_module(doc_runs, tmp_path):
    result = doc_runs["diff cnn --perturb conv_layer3"].json("diff.json")
    assert result["first"]["module"] == "conv_layer3"
    assert "conv_layer2" in result["compared"]
    clean = _run(["diff", "cnn"], tmp_path)
    assert clean.status == 0 and clean.json("diff.json")["first"] is None


def test_diff_names_the_perturbed_keras_layer(doc_runs, tmp_path):
    pytest.importorskip("tf2onnx")
    run = doc_runs["diff keras:cnn --perturb conv2d:2"]
    result = run.json("diff.json")
    assert result["framework"] == "tensorflow" and result["perturbed_layer"]
    first = result["first"]
    assert first["tf_type"] == "Conv2D" and first["onnx_type"] == "Conv"
    assert first["tf_op"] in result["perturbed_ops"] and first["tf_op"] in run.out
    before = [m["tf_op"] for m in result["compared"]].index(first["tf_op"])
    assert sum(m["tf_type"] == "Conv2D" for m in result["compared"][:before]) == 2
    clean = _run(["diff", "keras:cnn"], tmp_path)
    assert clean.status == 0 and clean.json("diff.json")["first"] is None


def test_prune_reaches_the_pattern(doc_runs):
    result = doc_runs["prune cnn --pattern 2:4"].json("pruning.json")
    assert result["pattern"] == "2:4"
    assert {row["sparsity"] for row in result["layers"]} == {0.5}
    assert len(result["layers"]) == 5 and len(result["skipped"]) == 1   # conv_layer1: Cin 3
    assert result["output_relative_change"] > 0


def test_graph_exports(doc_runs):
    from amanda.ir import Graph
    run = doc_runs["graph cnn"]
    graph = Graph.from_json(run.json("graph.json"))
    types = [op.type for op in graph.ops]
    assert types.count("conv2d") == 4 and types.count("ConvolutionBackward0") == 4
    dot = (run.folder / "graph.dot").read_text()
    assert dot.startswith("digraph") and "weight 32x3x3x3" in dot
    drawing = run.folder / "graph.svg"
    if not drawing.exists():                      # no Graphviz: the HTML page
        drawing = run.folder / "graph.html"
    assert "conv_layer1" in drawing.read_text()


def test_keras_and_onnx_specs(tmp_path):
    tf_run = _run(["quantize", "keras:cnn", "--calibrate", "2"], tmp_path / "tf")
    assert tf_run.status == 0, tf_run.err
    result = tf_run.json("quantization.json")
    assert result["framework"] == "tensorflow" and len(result["ops"]) == 6
    assert 0 < result["relative_error"] < 0.05
    onnx = pytest.importorskip("onnx")
    light = pathlib.Path(onnx.__file__).parent / "backend/test/data/light/light_squeezenet.onnx"
    graph_run = _run(["graph", str(light), "--formats", "json"], tmp_path / "onnx")
    assert graph_run.status == 0, graph_run.err
    ops = graph_run.json("graph.json")
    assert "Conv" in json.dumps(ops) and "squeezenet" in graph_run.out


def test_bad_specs_and_missing_pieces(tmp_path, capsys):
    assert main(["quantize", "keras:nosuchnet", "--out", str(tmp_path)]) == 2
    assert "no Keras application 'nosuchnet'" in capsys.readouterr().err
    onnx_file = pathlib.Path(pytest.importorskip("onnx").__file__).parent / \
        "backend/test/data/light/light_squeezenet.onnx"
    assert main(["diff", str(onnx_file), "--out", str(tmp_path)]) == 2
    assert "works on pytorch and tensorflow models" in capsys.readouterr().err
    with pytest.raises(cli.MissingPiece, match=r"amanda\.tools\.nope"):
        cli._require("amanda.tools.nope", "trace", "the op profiler")


def test_every_command_has_help_with_an_example(capsys):
    for name in ("trace", "flops", "prune", "quantize", "nan-check", "diff", "graph"):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        out = capsys.readouterr().out
        assert f"amanda {name} " in out and "example:" in out and "--out" in out
