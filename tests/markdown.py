"""Run the ``python`` blocks of a Markdown page, in order, in one namespace;
a ``text`` block right after one is the output it must print."""

import contextlib
import io
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def examples(path):
    """Pairs of (code, expected output or None), in page order."""
    blocks = BLOCK.findall((ROOT / path).read_text())
    found = []
    for i, (lang, body) in enumerate(blocks):
        if lang != "python":
            continue
        follows = blocks[i + 1] if i + 1 < len(blocks) else None
        found.append((body, follows[1] if follows and follows[0] == "text" else None))
    return found


def run_examples(path):
    """Execute every example of the page and check what it prints."""
    namespace = {"__name__": "__docs__"}
    for number, (code, expected) in enumerate(examples(path), 1):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"{path} example {number}", "exec"), namespace)
        if expected is not None:
            assert out.getvalue() == expected, f"{path} example {number} printed:\n{out.getvalue()}"
    return namespace
