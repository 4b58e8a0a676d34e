"""The README's lines-of-code table is what benchmarks/loc.py counts now."""

import pathlib

from benchmarks import loc

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_code_lines_skip_blank_comment_and_docstring_lines(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('"""Doc\nstring."""\n\n# comment\ndef f(x):\n    """Doc."""\n'
                      '    return (x +\n            1)  # trailing\n')
    assert loc.code_lines(source) == 3


def test_readme_shows_the_current_table():
    assert loc.table() in README.read_text()
