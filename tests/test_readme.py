"""The README's runnable examples print exactly what the README shows.

A ```python block followed by a line "prints" and a ```text block is executed in a fresh namespace and its
standard output compared with that block. The demo table is compared with what `make demo`'s command prints
(its cost line aside, which is wall-clock time).
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


def _text_block_after(heading: str) -> str:
    text = README.read_text()
    start = text.index("```text\n", text.index(heading)) + len("```text\n")
    return text[start:text.index("```", start)]


def _without_timings(lines: list[str]) -> list[str]:
    """Drop the cost line and its continuation lines: wall-clock figures differ from run to run."""
    kept: list[str] = []
    timing = False
    for line in lines:
        if not line.startswith("  "):
            timing = line.startswith("canary cost per step")
        if not timing:
            kept.append(line)
    return kept


def test_the_readme_demo_table_is_what_make_demo_prints(monkeypatch, capsys):
    pytest.importorskip("rich")  # the README shows the rich table; `make demo` installs the report extra
    monkeypatch.setenv("COLUMNS", "80")
    for forcing in ("FORCE_COLOR", "TTY_COMPATIBLE"):  # a CI that forces colour would add escape codes
        monkeypatch.delenv(forcing, raising=False)
    from kvcanary_cupy.cli import main

    # make demo's command, without the report files (their paths are printed, the README leaves them out)
    assert main(["simulate", "--preset", "mixed", "--inject", "all", "--steps", "200", "--requests", "48",
                 "--seed", "7", "--quiet"]) == 0
    printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    shown = _text_block_after("## Does it catch KV-cache corruption?").splitlines()
    assert _without_timings(printed) == _without_timings(shown)
