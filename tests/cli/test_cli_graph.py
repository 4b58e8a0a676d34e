"""Issue 30: `amanda graph` pictures: PNG drawn by Graphviz from the SVG's
DOT; without `dot`, one HTML page whose forward chain is one column with the
edge labels beside the edges; `flops --chart` bars readable on a log axis."""

import contextlib
import io
import re
import shutil

import pytest

from amanda.cli import main

pytest.importorskip("torch")


def _graph(argv, folder):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["graph", "cnn", *argv, "--out", str(folder)])
    assert status == 0, err.getvalue()
    return out.getvalue(), err.getvalue()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_png_is_graphviz_drawing_the_dot(tmp_path, monkeypatch):
    from amanda.tools import graph as graph_tool
    from amanda.tools import graph_view
    monkeypatch.setattr(graph_tool, "render_png", None)   # the old matplotlib layout: unused
    calls = []
    render = graph_view.render
    monkeypatch.setattr(graph_view, "render",
                        lambda view, path, fmt, title=None: calls.append(fmt)
                        or render(view, path, fmt, title))
    _graph(["--formats", "png,svg"], tmp_path)
    assert sorted(calls) == ["png", "svg"]
    assert (tmp_path / "graph.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "graph.html").exists()


def test_without_dot_the_html_page_stands_in(tmp_path, monkeypatch):
    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "dot"
                        else real(name, *a, **k))
    out, err = _graph(["--formats", "png"], tmp_path)
    assert "writing graph.html instead of graph.png" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph.html"]
    page = (tmp_path / "graph.html").read_text()
    # forward boxes: one column (the same centre), top to bottom
    boxes = re.findall(r'<rect x="(\d+)" y="(\d+)" width="(\d+)" height="\d+" rx="\d+" '
                       r'fill="#dbe9f7"', page)
    centres = {int(x) + int(w) // 2 for x, _, w in boxes}
    assert len(boxes) == 11 and max(centres) - min(centres) <= 1, boxes
    ys = [int(y) for _, y, _ in boxes]
    assert ys == sorted(ys)
    # an edge's label starts beside the edge, right of where it leaves its box
    edges = re.findall(r'<path d="M(\d+),(\d+) C[^"]*"[^>]*/>\s*<text x="(\d+)" y="(\d+)" '
                       r'class="edge">', page)
    assert edges and all(int(tx) > int(x) and int(ty) > int(y) for x, y, tx, ty in edges)


def test_flops_chart_is_log_scaled_with_a_label_per_bar(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes
    seen = {}
    barh, text = matplotlib.axes.Axes.barh, matplotlib.axes.Axes.text

    def spy_barh(self, *args, **kwargs):
        seen.setdefault("log", []).append(kwargs.get("log"))
        return barh(self, *args, **kwargs)

    def spy_text(self, x, y, label, *args, **kwargs):
        seen.setdefault("labels", []).append(label)
        return text(self, x, y, label, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "barh", spy_barh)
    monkeypatch.setattr(matplotlib.axes.Axes, "text", spy_text)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["flops", "cnn", "--chart", "--out", str(tmp_path)]) == 0
    assert seen["log"] == [True, True]
    # 5 op types x forward and backward, each bar labelled with its count
    assert seen["labels"] == ["28.69M", "412.16K", "31.49K", "128", "10",
                              "55.82M", "824.32K", "31.49K", "128", "0"]
    assert (tmp_path / "flops-cnn.png").read_bytes()[:4] == b"\x89PNG"
