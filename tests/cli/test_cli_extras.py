"""Issue 30: the `amanda` command as installed by a user: its distribution
name, and extras checked before any work (no model built, no file written,
nothing stale or partial left behind)."""

import json
import os
import subprocess
import sys
import textwrap
import tomllib

import pytest

from amanda import cli
from amanda.cli import common, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_distribution_has_a_name_of_its_own():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    # `amanda` on PyPI is an unrelated project; the command keeps its name
    assert project["name"] == cli.DISTRIBUTION == "amanda-instrument"
    assert project["scripts"] == {"amanda": "amanda.cli:main"}
    assert all(r.startswith("amanda-instrument[") for r in project["optional-dependencies"]["all"])
    error = ModuleNotFoundError("No module named 'onnx'", name="onnx")
    assert cli.missing_extra_message("diff", error) == (
        "amanda diff: needs onnx, which is not installed; pip install 'amanda-instrument[onnx]'")
    for doc in ("README.md", "docs/cli.md"):
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        assert "'amanda[" not in text and "amanda-instrument[" in text, doc
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "pip install -c constraints.txt '.[torch]'" in readme
    assert "| `graph` | `networkx` |" in readme


def _without(modules, argv, cwd):
    """Run the CLI in a fresh interpreter where ``modules`` cannot be imported
    (as if their extra were not installed); building a model prints BUILT."""
    program = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        for name in {modules!r}:
            sys.modules[name] = None     # `import name` raises ModuleNotFoundError
        import amanda.models
        load = amanda.models.load
        def traced(spec):
            print("BUILT", spec, file=sys.stderr)
            return load(spec)
        amanda.models.load = traced
        from amanda.cli import main
        sys.exit(main({argv!r}))
    """)
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


@pytest.mark.parametrize("missing, argv, extra", [
    ("matplotlib", ["flops", "cnn", "--chart"], "viz"),
    ("matplotlib", ["trace", "cnn", "--timeline"], "viz"),
    ("onnx", ["quantize", "cnn", "--export", "OUT/cnn.onnx"], "onnx"),
    ("onnxruntime", ["diff", "cnn", "--perturb", "conv_layer3"], "onnx"),
    ("tf2onnx", ["diff", "keras:cnn"], "onnx"),
    ("torch", ["graph", "cnn"], "torch"),
])
def test_a_missing_extra_stops_the_command_before_any_work(missing, argv, extra, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    before = {"flops.json": '{"previous": "run"}\n'}
    for name, text in before.items():
        (out / name).write_text(text)
    argv = [a.replace("OUT", str(out)) for a in argv] + ["--out", str(out)]
    done = _without([missing], argv, tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"amanda {argv[0]}: needs {missing}, which is not installed; "
        f"pip install 'amanda-instrument[{extra}]'"], done.stderr
    assert "BUILT" not in done.stderr and done.stdout == ""      # no model built, no table
    assert sorted(os.listdir(out)) == sorted(before)             # nothing written
    assert (out / "flops.json").read_text() == before["flops.json"]
    assert not os.path.exists(tmp_path / "amanda-out")


def test_outputs_move_into_place_only_when_the_command_succeeds(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    out = tmp_path / "out"
    out.mkdir()
    (out / "flops.json").write_text('{"previous": "run"}\n')

    def chart_fails(profiler, spec, path, top=10):
        common.staged(path)                  # a partial picture on disk
        raise RuntimeError("the chart broke")

    from amanda.cli import flops
    monkeypatch.setattr(flops, "_flops_chart", chart_fails)
    with pytest.raises(RuntimeError, match="the chart broke"):
        main(["flops", "cnn", "--chart", "--out", str(out)])
    # the previous run's report untouched, no partial file of this run
    assert os.listdir(out) == ["flops.json"]
    assert json.loads((out / "flops.json").read_text()) == {"previous": "run"}

    monkeypatch.undo()
    assert main(["flops", "cnn", "--chart", "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["flops-cnn.png", "flops.json"]
    assert json.loads((out / "flops.json").read_text())[0]["model"] == "cnn"
