"""The ``amanda`` command line."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from amanda.cli import main  # noqa: E402


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
