"""The examples of docs/architecture.md run and their assertions hold."""

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_doc_has_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("number", range(len(EXAMPLES)))
def test_example_runs(number):
    exec(compile(EXAMPLES[number], f"docs/architecture.md example {number}", "exec"), {})
