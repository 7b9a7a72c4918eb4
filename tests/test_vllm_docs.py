"""docs/vllm.md names every vLLM internal the integration patches or reads (no vLLM needed here)."""

from __future__ import annotations

from pathlib import Path

from kvcanary_cupy.integrations.vllm.internals import INTERNALS

DOC = Path(__file__).resolve().parent.parent / "docs" / "vllm.md"


def test_the_docs_table_lists_exactly_the_internals_the_code_uses():
    text = DOC.read_text()
    table = [line.split("`")[1] for line in text.splitlines() if line.startswith("| `vllm.")]
    assert table == [i.target for i in INTERNALS]


def test_the_docs_support_table_is_the_support_modules_list():
    from kvcanary_cupy.integrations.vllm.support import support_table

    lines = DOC.read_text().splitlines()
    start = lines.index("| area | configuration | what the canary does | why |")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    assert lines[start:end] == support_table()
