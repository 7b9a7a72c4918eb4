"""The documentation's runnable examples print exactly what the pages show: the README and every page under
``docs/`` (pages added later are picked up by the glob).

A ```python block followed by a line "prints" and a ```text block is executed in a fresh namespace and its
standard output compared with that block. The demo table is compared with what `make demo`'s command prints
(its cost line aside, which is wall-clock time). Every other code block is marked as run by a named test or as not
run here. Links are relative (no absolute address of this project) and resolve to a file and heading.
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
    assert len(README.read_text().splitlines()) <= 250


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
    """GitHub's heading anchors of a page (headings outside code blocks) and its explicit ``<a id="...">``."""
    anchors, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            text = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower())
            anchors.add(text.replace(" ", "-"))
        elif not fence:
            anchors.update(re.findall(r'<a id="([^"]+)"></a>', line))
    return anchors


LINKED_PAGES = [*PAGES, ROOT / "CHANGELOG.md"]


def _links(page: Path) -> list[str]:
    """Every Markdown link and image target of a page outside code blocks."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", LINKED_PAGES, ids=page_name)
def test_no_page_links_to_an_absolute_address_of_this_project(page):
    own = [link for link in _links(page) if re.match(r"https?://", link) and "kvcanary" in link.lower()]
    assert not own, f"{page_name(page)}: make these relative: {own}"


@pytest.mark.parametrize("page", LINKED_PAGES, ids=page_name)
def test_relative_links_resolve_to_a_file_and_heading(page):
    for link in _links(page):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.is_file(), f"{page_name(page)}: {link}"
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target), f"{page_name(page)}: {link}"


# A code block the tests do not execute as an example says so on the line above its fence: either which test runs
# it ("run by tests/...", a file that names the page) or why it is not run here ("not run by the tests: ...").
RUN_BY = re.compile(r"<!-- run by (tests/\S+\.py)\b.*-->")
NOT_RUN = re.compile(r"<!-- not run by the tests[^:]*: \S.*-->")
CODE = re.compile(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```\n", re.S | re.M)


def _code_blocks(page: Path) -> list[tuple[str, str, str, str]]:
    """(language, the line above the fence, the text after the block, body) of every fenced block."""
    text = page.read_text()
    found = []
    for m in CODE.finditer(text):
        above = text[:m.start()].rstrip("\n").rpartition("\n")[2]
        found.append((m["lang"], above, text[m.end():m.end() + 40], m["body"]))
    return found


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_every_code_block_is_executed_or_marked_as_not_run(page):
    for lang, above, after, body in _code_blocks(page):
        assert lang, f"{page_name(page)}: a fence without a language: {body[:60]!r}"
        if lang == "text":  # output and illustrations, not code
            continue
        if lang == "python" and re.match(r"\n*prints\n+```text\n", after):
            continue  # an example test_every_example_prints_what_its_page_shows runs
        run_by = RUN_BY.search(above)
        if run_by:
            runner = ROOT / run_by[1]
            assert runner.is_file() and page.name in runner.read_text(), f"{page_name(page)}: {above}"
            continue
        assert NOT_RUN.search(above), f"{page_name(page)}: mark this {lang} block: {body[:60]!r}"


def test_the_readme_holds_the_three_ways_in_as_executed_code():
    text = README.read_text()
    executed = [code for page, _, code, _ in examples() if page == "README.md"]
    assert any("integrations.transformers import" in c and "install(model" in c for c in executed)
    assert any("CanaryRuntime.create" in c for c in executed)
    blocks = _code_blocks(README)
    vllm = [b for lang, above, _, b in blocks if lang == "python" and RUN_BY.search(above) and "kv.install(llm" in b]
    assert len(vllm) == 1, "the in-process vLLM block, run by tests/vllm/test_readme_vllm.py"
    assert "KVCANARY_VLLM=log" in text and "kvcanary_cupy.compat.sglang" in text and "SGLang" in text
    assert "make demo" in text and "make test" in text


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
