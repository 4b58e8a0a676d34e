"""Issue 30, small items: tables explain every row and column they show, and
`amanda demo` prints the same quantization error as `amanda quantize`."""

import contextlib
import io
import json

import pytest

from amanda.cli import main
from amanda.cli.coverage import coverage_table
from amanda.cli.table import format_plain
from amanda.cli.trace import _print_profile


def _report(missed=None, partial=None):
    return {"model": "m", "amanda_forward": 10, "hooks_forward": 5, "hooks_forward_leaf": 4,
            "amanda_backward": 12, "hooks_backward": 5, "hooks_error": None,
            "missed_by_hooks": missed or {}, "partially_covered": partial or {}}


def test_the_coverage_legend_explains_only_what_the_table_shows():
    plain = format_plain(coverage_table([_report(missed={"view": 3})]))
    assert "hooks miss 3: view 3" in plain and '"hooks miss":' in plain
    assert "share a module hook" not in plain           # no such note in the table
    plain = format_plain(coverage_table([_report(partial={"linear": 2})]))
    assert "2 share a module hook" in plain and '"share a module hook":' in plain
    assert '"hooks miss"' not in plain


class _Profiler:
    events = [None] * 6
    by_type = by_name = None

    def by_module(self, depth=None):
        row = {"calls": 2, "forward_us": 1000.0, "backward_us": 500.0, "total_us": 1500.0}
        return {"fc": row, "": row, None: row}

    def total_us(self, phase="all"):
        return {"all": 4500.0, "forward": 3000.0, "backward": 1500.0}[phase]


def test_trace_by_module_names_and_explains_its_special_rows(capsys):
    _print_profile(_Profiler(), "module", 10)
    out = capsys.readouterr().out
    rows = [line.split("  ")[0] for line in out.splitlines()]
    assert "(model itself)" in rows and "(outside the model)" in rows
    assert "(root)" not in out and "\n-  " not in out
    assert "(model itself): ops run directly in the model's forward" in out
    assert "(outside the model): ops run outside the model's forward (the loss" in out


def test_demo_and_quantize_print_the_same_error(tmp_path):
    pytest.importorskip("torch")
    from amanda.cli.common import _Workloads
    from amanda.cli.demo import _demo_tools
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["quantize", "cnn", "--out", str(tmp_path)]) == 0
        demo = _demo_tools("cnn", _Workloads(["cnn"]))
    with open(tmp_path / "quantization.json") as f:
        error = json.load(f)["relative_error"]
    assert demo["quantize"]["relative_error"] == pytest.approx(error, rel=1e-6)
    printed = out.getvalue()
    assert f"relative error {error:.4f}" in printed.split("ops quantized")[1]
    assert f"output relative error {error:.4f}" in printed
