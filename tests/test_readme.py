"""The documentation's runnable examples print exactly what the pages show: the README and every page under
``docs/`` (pages added later are picked up by the glob).

A ```python block followed by a line "prints" and a ```text block is executed in a fresh namespace and its
standard output compared with that block. The demo table is compared with what `make demo`'s command prints
(its cost line aside, which is wall-clock time). Links to this repository's own files and headings must resolve.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
REPO_URL = "https://github.com/kvcanary/kvcanary-cupy"
# The code may not cross a fence: a python block without "prints" must not swallow the next example.
EXAMPLE = re.compile(r"```python\n(?P<code>(?:(?!```).)*?)```\n+prints\n+```text\n(?P<output>.*?)```", re.S)


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def examples() -> list[tuple[str, int, str, str]]:
    """(page, index on the page, code, expected output) of every example of every page."""
    found = []
    for page in PAGES:
        for k, m in enumerate(EXAMPLE.finditer(page.read_text())):
            found.append((page_name(page), k, m["code"], m["output"]))
    return found


def test_the_pages_have_runnable_examples():
    pages = {page for page, *_ in examples()}
    assert len(examples()) >= 5 and "docs/engines.md" in pages and "docs/disaggregated.md" in pages


def test_the_readme_is_a_front_page():
    assert len(README.read_text().splitlines()) <= 300


@pytest.mark.parametrize(("page", "index", "code", "expected"),
                         [pytest.param(*e, id=f"{e[0]}-{e[1]}") for e in examples()])
def test_every_example_prints_what_its_page_shows(page, index, code, expected):
    if "import torch" in code:
        pytest.importorskip("torch")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{page} example {index}", "exec"), {"__name__": "__readme__"})
    assert out.getvalue() == expected


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a page (headings outside code blocks)."""
    anchors, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            text = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_links_to_this_repository_resolve_to_a_file_and_heading(page):
    links = re.findall(rf"\]\({re.escape(REPO_URL)}([^)\s]*)\)", page.read_text())
    for link in links:
        path, _, anchor = link.partition("#")
        target = README if path in ("", "/") else ROOT / path.removeprefix("/blob/main/")
        assert path in ("", "/") or path.startswith("/blob/main/"), link
        assert target.is_file(), link
        if anchor:
            assert anchor in _anchors(target), link


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

    # make demo's command, without the report files (their paths are printed, the README leaves them out); the
    # demo pins the NumPy reference so that its table reads the same on a machine without g++
    assert main(["simulate", "--preset", "mixed", "--inject", "all", "--steps", "200", "--requests", "48",
                 "--seed", "7", "--backend", "numpy", "--quiet"]) == 0
    printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    shown = _text_block_after("## Does it catch KV-cache corruption?").splitlines()
    assert _without_timings(printed) == _without_timings(shown)
