"""Lines of code of amanda's built-in tools, beside the paper's Tbl. 4.

Counts source lines that hold code: blank lines, comments and docstrings are
not counted (the paper does not say how it counted; this is the strictest
reasonable reading). Run ``python -m benchmarks.loc`` to print the table the
README shows; ``tests/test_loc.py`` keeps the README in step with it.
"""

from __future__ import annotations

import io
import pathlib
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: tool module -> what it does (the README's wording)
TOOLS = {
    "pruning": "pruning: unstructured, N:M, channel-wise; static/dynamic; weights + gradients",
    "quantization": "quantization-aware training: fake-quant, observers, calibration",
    "profiler": "op profiler / tracer (Chrome trace, kernel breakdown)",
    "flops": "FLOPs profiler (forward + backward, formula table)",
    "debugging": "NaN/Inf detector, per-op statistics, tensor dumps",
    "effective_path": "effective path (Qiu et al. 2019)",
    "diff": "numeric diff, PyTorch vs ONNX export and TF vs its ONNX conversion",
    "coverage": "op coverage vs module hooks",
}

#: modules a tool was split into besides its own: counted with it, since
#: they are its code (issue 15 split the large tool modules along their seams)
PARTS = {
    "profiler": ("profiler_events", "profiler_trace", "profiler_kernels"),
    "flops": ("flops_formulas",),
    "effective_path": ("effective_path_rules", "effective_path_params"),
    "diff": ("diff_tf", "diff_values"),
}

#: the paper's Tbl. 4 (project, interface of the original, its LoC, amanda tool LoC)
PAPER = [
    ("Tile-wise pruning", "TensorFlow session hook", 1203, 213),
    ("Dynamic channel pruning", "PyTorch source modification", 387, 115),
    ("Activation pruning", "PyTorch source modification", 650, 193),
    ("Attention pruning", "PyTorch source modification", 1105, 179),
    ("APEX vector-wise pruning", "PyTorch module hook", 499, 279),
]


def code_lines(path):
    """Number of lines of ``path`` that hold code (not blank, comment or docstring)."""
    source = pathlib.Path(path).read_text()
    lines = set()
    previous = tokenize.INDENT
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        kind = token.type
        if kind in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                    tokenize.DEDENT, tokenize.ENDMARKER):
            if kind != tokenize.COMMENT:
                previous = kind
            continue
        if kind == tokenize.STRING and previous in (tokenize.INDENT, tokenize.DEDENT,
                                                    tokenize.NEWLINE):
            previous = kind   # a docstring (a string standing alone as a statement)
            continue
        lines.update(range(token.start[0], token.end[0] + 1))
        previous = kind
    return len(lines)


def table():
    """The Markdown table of our tools and the paper's Tbl. 4."""
    rows = ["| amanda tool (`amanda/tools/`) | what it does | lines of code |", "|---|---|---|"]
    for module, what in TOOLS.items():
        path = ROOT / "amanda" / "tools" / f"{module}.py"
        if path.exists():
            parts = [ROOT / "amanda" / "tools" / f"{part}.py" for part in PARTS.get(module, ())]
            count = code_lines(path) + sum(code_lines(part) for part in parts if part.exists())
            shown = " + ".join([f"`{module}.py`"] + [f"`{part.name}`" for part in parts])
            rows.append(f"| {shown} | {what} | {count} |")
    rows += ["", "| paper, Tbl. 4: project | original interface | original LoC | amanda tool LoC |",
             "|---|---|---|---|"]
    rows += [f"| {name} | {interface} | {original} | {ours} |"
             for name, interface, original, ours in PAPER]
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
