"""The `amanda` command as a new user meets it: missing extras, bad arguments,
model specs, one table style."""

import io
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from amanda import cli
from amanda.cli import table as cli_table
from amanda.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _without(modules, argv):
    """Run the CLI in a fresh interpreter where importing ``modules`` fails as
    if they were not installed."""
    program = textwrap.dedent(f"""
        import sys
        for name in {modules!r}:
            sys.modules[name] = None     # `import name` raises ModuleNotFoundError
        from amanda.cli import main
        sys.exit(main({argv!r}))
    """)
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


@pytest.mark.parametrize("modules, argv, extra", [
    (["torch"], ["flops", "cnn"], "torch"),
    (["transformers"], ["prune", "bert"], "torch"),
    (["tensorflow"], ["nan-check", "keras:cnn"], "tensorflow"),
    (["matplotlib"], ["flops", "cnn", "--chart"], "viz"),
])
def test_a_missing_extra_is_one_line_naming_the_install(modules, argv, extra, tmp_path):
    done = _without(modules, argv + ["--out", str(tmp_path)])
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == [f"amanda {argv[0]}: needs {modules[0]}, which is not installed; "
                     f"pip install 'amanda-instrument[{extra}]'"], done.stderr
    assert "Traceback" not in done.stderr


def test_missing_core_dependency_says_reinstall():
    error = ModuleNotFoundError("No module named 'numpy'", name="numpy")
    assert cli.missing_extra_message("trace", error).endswith("pip install amanda-instrument")
    other = ModuleNotFoundError("No module named 'mylib'", name="mylib")
    assert cli.missing_extra_message("trace", other) is None   # a user's bug: traceback


def test_every_extra_named_exists_in_pyproject():
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project["optional-dependencies"]
    for extra in set(cli.EXTRA_OF_MODULE.values()) - {""}:
        assert extra in extras
    for module, extra in cli.EXTRA_OF_MODULE.items():
        wanted = project["dependencies"] if extra == "" else extras[extra]
        names = {r.split("=")[0].split("[")[0].replace("-", "_").lower() for r in wanted}
        assert module in names or extra in ("tensorflow",), (module, extra)
    assert {"torch", "tensorflow", "onnx", "viz", "all", "graph", "dev"} <= set(extras)
    for needed in ("pytest", "hypothesis", "transformers", "matplotlib", "networkx"):
        assert any(r.startswith(needed) for r in extras["dev"])


def _usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["trace", "cnn", "--steps", "0"], "--steps: must be at least 1, got 0"),
    (["flops", "cnn", "--top", "-1"], "--top: must be at least 1"),
    (["prune", "cnn", "--sparsity", "1.5"], "--sparsity: must be in [0, 1)"),
    (["quantize", "cnn", "--weight-bits", "1"], "must be 0 (float) or 2 to 16 bits"),
    (["quantize", "cnn", "--calibrate", "x"], "'x' is not an integer"),
])
def test_bad_numbers_are_rejected_by_the_parser(argv, message, capsys):
    assert message in _usage_error(argv, capsys)


def test_planting_beyond_the_ops_a_model_runs_is_an_error(tmp_path, capsys):
    pytest.importorskip("torch")
    assert main(["nan-check", "cnn", "--plant", "conv2d:9", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "only 4 ops named 'conv2d' (N from 0 to 3)" in err and "nothing was planted" in err
    assert not os.path.exists(tmp_path / "nan.json")
    assert main(["nan-check", "cnn", "--plant", "conv2d:two", "--out", str(tmp_path)]) == 2
    assert "expected OP or OP:N" in capsys.readouterr().err


@pytest.mark.parametrize("spec, kind", [("keras:cnn", "TensorFlow"), ("m.onnx", "ONNX")])
def test_coverage_says_it_is_pytorch_only(spec, kind, tmp_path, capsys):
    assert main(["coverage", spec, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"amanda coverage: error: {spec} is {'an' if kind == 'ONNX' else 'a'} "
                   f"{kind} model; `amanda coverage` is PyTorch-only (it compares amanda "
                   "with PyTorch module hooks)")


def test_model_help_names_every_kind_of_spec(capsys):
    with pytest.raises(SystemExit):
        main(["flops", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for kind in ("cnn", "gpt2-small", "keras:NAME[:SIZE]", "keras:resnet50",
                 "path/to/model.onnx", "path/to/file.py:factory", "amanda models"):
        assert kind in out


def test_a_factory_file_imports_its_siblings(tmp_path, capsys):
    pytest.importorskip("torch")
    models = tmp_path / "project"
    models.mkdir()
    (models / "layers.py").write_text(
        "import torch\n"
        "class Block(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return torch.relu(self.fc(x))\n")
    (models / "net.py").write_text(
        "import torch\n"
        "from layers import Block          # a sibling module, as in a script\n"
        "def build():\n"
        "    return torch.nn.Sequential(Block(), Block()), torch.rand(2, 8)\n")
    out = tmp_path / "out"
    assert main(["nan-check", f"{models / 'net.py'}:build", "--out", str(out)]) == 0
    assert "no NaN or Inf" in capsys.readouterr().out


# -- one table renderer ---------------------------------------------------------------

def test_plain_tables_are_aligned_with_a_rule_and_footer():
    table = cli_table.Table(["layer", "pruned"], [["conv", "1,024"], ["fc2", 8]], "<>",
                            title="cnn", footer=[["total", "1,032"]], notes=["a note"])
    assert cli_table.format_plain(table).splitlines() == [
        "cnn",
        "layer  pruned",
        "-----  ------",
        "conv    1,024",
        "fc2         8",
        "-----  ------",
        "total   1,032",
        "a note",
    ]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_rich_draws_on_a_terminal_plain_text_elsewhere(monkeypatch):
    monkeypatch.delenv("AMANDA_PLAIN", raising=False)
    pipe, terminal = io.StringIO(), _Terminal()
    for stream in (pipe, terminal):
        cli_table.print_table(["op type", "ops"], [["conv2d", 4]], "<>", title="t",
                              file=stream)
    assert "-------  ---" in pipe.getvalue()
    if cli_table.use_rich(terminal):          # rich installed
        assert "conv2d" in terminal.getvalue() and "-------  ---" not in terminal.getvalue()
    monkeypatch.setenv("AMANDA_PLAIN", "1")
    assert not cli_table.use_rich(terminal)


def test_commands_print_through_the_one_renderer():
    # the command modules of the amanda.cli package; the renderer itself is table.py
    package = pathlib.Path(cli.__file__).parent
    source = "".join(f.read_text() for f in sorted(package.glob("*.py")) if f.name != "table.py")
    assert "rich.table" not in source and '" | ".join' not in source
    assert source.count("print_table") >= 6


@pytest.mark.parametrize("argv", [["models"], ["prune", "cnn"]])
def test_tables_of_commands_share_the_plain_style(argv, tmp_path, capsys):
    if argv[0] != "models":
        pytest.importorskip("torch")
        argv = argv + ["--out", str(tmp_path)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rule = next(line for line in lines if set(line) <= {"-", " "} and "  " in line)
    header = lines[lines.index(rule) - 1]
    # every column of the header lies over its dashes: the gaps are blank
    gaps = [i for i, c in enumerate(rule) if c == " "]
    assert len(header) <= len(rule) and "|" not in header
    assert all(i >= len(header) or header[i] == " " for i in gaps)
