"""The README's runnable examples print exactly what the README shows.

A ```python block followed by a line "prints" and a ```text block is executed in a fresh namespace and its
standard output compared with that block.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
# The code may not cross a fence: a python block without "prints" must not swallow the next example.
EXAMPLE = re.compile(r"```python\n(?P<code>(?:(?!```).)*?)```\n+prints\n+```text\n(?P<output>.*?)```", re.S)


def examples() -> list[tuple[str, str]]:
    return [(m["code"], m["output"]) for m in EXAMPLE.finditer(README.read_text())]


def test_readme_has_runnable_examples():
    assert len(examples()) >= 2


@pytest.mark.parametrize("index", range(len(examples())))
def test_readme_example_prints_what_the_readme_shows(index):
    code, expected = examples()[index]
    if "import torch" in code:
        pytest.importorskip("torch")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README example {index}", "exec"), {"__name__": "__readme__"})
    assert out.getvalue() == expected
