"""Every ``python`` block of README.md runs, in order, in one namespace; a
``text`` block right after it is the output it must print."""

import contextlib
import io
import pathlib
import re

import pytest

pytest.importorskip("torch")    # the README's tutorial runs PyTorch models

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def readme_examples():
    """Pairs of (code, expected output or None), in README order."""
    blocks = BLOCK.findall(README.read_text())
    examples = []
    for i, (lang, body) in enumerate(blocks):
        if lang != "python":
            continue
        follows = blocks[i + 1] if i + 1 < len(blocks) else None
        expected = follows[1] if follows and follows[0] == "text" else None
        examples.append((body, expected))
    return examples


def test_readme_has_examples():
    assert len(readme_examples()) >= 8


@pytest.mark.slow
def test_readme_examples_run_and_print_what_they_show():
    namespace = {"__name__": "__readme__"}
    for number, (code, expected) in enumerate(readme_examples(), 1):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"README.md example {number}", "exec"), namespace)
        if expected is not None:
            assert out.getvalue() == expected, f"README example {number} printed:\n{out.getvalue()}"
