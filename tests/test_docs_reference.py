"""The documentation as a reference: the runbook covers exactly what the code can report, the cost page is what
the bench JSON renders, history lives in CHANGELOG.md, and the glossary defines the shared terms.

The lists compared with the runbook come from the code (the reason bits and their labels as the ring decoder
prints them, the status flag enums, the step report's fields), never from a copy.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from kvcanary_cupy.constants import (
    VIOLATION_FIELD_FAIL_REASON_BITS,
    VIOLATION_FIELDS,
    CanaryStatus,
    FailReason,
    PlanStatus,
)
from kvcanary_cupy.integrations.vllm.connector import LoadReason
from kvcanary_cupy.runtime.reporting import StepReport
from kvcanary_cupy.sim.report import short_reason
from kvcanary_cupy.violations import decode_row

ROOT = Path(__file__).resolve().parent.parent
RUNBOOK = ROOT / "docs" / "violations.md"
ANCHOR = re.compile(r'<a id="((?:reason|status|report|load)-[^"]+)"></a>\n+#{2,6} (.+)')
# What the runtime reports besides ring rows and status bits (StepReport fields), each with a runbook section.
REPORT_FIELDS = ("overflowed", "dropped", "health_problems")


def anchor_name(name: str) -> str:
    """The runbook's anchor rule: the code's name in lower case, underscores as hyphens."""
    return name.lower().replace("_", "-")


def reason_label(reason: FailReason) -> str:
    """The label the ring decoder prints for one reason bit (a row with that bit alone, decoded)."""
    row = np.zeros(VIOLATION_FIELDS, np.int64)
    row[VIOLATION_FIELD_FAIL_REASON_BITS] = int(reason)
    (label,) = decode_row(0, row).labels
    return label


def code_anchors() -> dict[str, str]:
    """Every anchor the runbook must have -> the name its section heading must show."""
    wanted = {f"reason-{anchor_name(str(reason.name))}": str(reason.name) for reason in FailReason}
    for flag in (*CanaryStatus, *PlanStatus):
        wanted[f"status-{anchor_name(str(flag.name))}"] = str(flag.name)
    fields = {f.name for f in dataclasses.fields(StepReport)}
    for name in REPORT_FIELDS:
        assert name in fields, f"StepReport has no field {name}: update the runbook and this list"
        wanted[f"report-{anchor_name(name)}"] = f"StepReport.{name}"
    for load in LoadReason:  # the canary KV connector's refused loads
        wanted[f"load-{anchor_name(load.name.removeprefix('LOAD_'))}"] = load.name
    return wanted


def page_anchors() -> dict[str, str]:
    """The runbook's reason/status/report anchors -> the heading right below each."""
    found = ANCHOR.findall(RUNBOOK.read_text())
    names = [a for a, _ in found]
    assert len(names) == len(set(names)), "an anchor appears twice"
    return dict(found)


def test_every_reason_and_status_bit_has_exactly_one_runbook_section_named_after_it():
    wanted, have = code_anchors(), page_anchors()
    assert len(wanted) == len(FailReason) + len(CanaryStatus) + len(PlanStatus) + len(REPORT_FIELDS) + len(LoadReason)
    assert sorted(set(wanted) - set(have)) == [], "the code reports these; the runbook lacks their sections"
    assert sorted(set(have) - set(wanted)) == [], "the runbook has sections for names the code lacks"
    for anchor, name in wanted.items():
        assert f"`{name}`" in have[anchor] or f"({name})" in have[anchor].replace("`", ""), (anchor, have[anchor])


def test_each_reason_section_names_the_labels_a_row_and_the_simulator_print():
    text = RUNBOOK.read_text()
    for reason in FailReason:
        anchor = f'<a id="reason-{anchor_name(str(reason.name))}"></a>'
        section = text[text.index(anchor):].split("\n<a id=", 1)[0]
        wanted = (f"print it as `{reason_label(reason)}`, the simulator's tables as "
                  f"`{short_reason(str(reason.name))}`")
        assert wanted in section, (reason.name, wanted)


def _render_costs():
    spec = importlib.util.spec_from_file_location("render_costs", ROOT / "bench" / "render_costs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cost_page_is_what_the_bench_json_renders():
    rc = _render_costs()
    page = rc.PAGE_PATH.read_text()
    assert page.count(rc.BEGIN) == 1 and page.count(rc.END) == 1
    rendered = rc.render(json.loads(rc.JSON_PATH.read_text()))
    assert rc.splice(page, rendered) == page, "run: python bench/render_costs.py"


def test_the_cost_renderer_takes_its_figures_from_the_json():
    # a changed measurement changes the page: the renderer copies nothing from the page itself
    rc = _render_costs()
    data = json.loads(rc.JSON_PATH.read_text())
    data["share"][0]["share_median"] = 0.4321
    data["scaling"][0]["host_ms"] = 12.345
    rendered = rc.render(data)
    assert "43.2 %" in rendered and "12.35 ms" in rendered
    assert rc.splice(rc.PAGE_PATH.read_text(), rendered) != rc.PAGE_PATH.read_text()
    assert rc.main(["--check"]) == 0


def test_the_cost_checker_fails_on_a_page_that_differs(tmp_path):
    rc = _render_costs()
    page = tmp_path / "costs.md"
    page.write_text(rc.PAGE_PATH.read_text().replace(rc.END, "| a stale row |\n" + rc.END))
    assert rc.main(["--check", "--page", str(page)]) == 1
    assert rc.main(["--page", str(page)]) == 0 and rc.main(["--check", "--page", str(page)]) == 0
    with pytest.raises(ValueError, match="markers"):
        rc.splice("no markers here", "x")


# Dates and "before/now" narration belong to the changelog; mutation.md is the record of its last run.
HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bbefore this round\b|\b(?:earlier|previous) measurements?\b"
                     r"|\bafter the (?:third )?round of cuts\b|\bwas cut\b", re.I)


REFERENCE_PAGES = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "mutation.md")]


@pytest.mark.parametrize("page", REFERENCE_PAGES, ids=lambda p: p.name)
def test_reference_pages_hold_no_dated_history(page):
    hits = [line for line in page.read_text().splitlines() if HISTORY.search(line)]
    assert not hits, f"move to CHANGELOG.md: {hits[:3]}"


def test_the_changelog_holds_the_dated_measurements():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog")
    assert re.findall(r"^## .*\b20\d\d-\d\d-\d\d\b", text, re.M), "dated sections"


def test_the_glossary_defines_the_shared_terms_and_is_linked():
    text = (ROOT / "docs" / "glossary.md").read_text()
    terms = re.findall(r"^\*\*([^*]+)\.\*\*", text, re.M)
    for term in ("HEAD / TAIL", "Sweep", "Plan", "Expected-token pool", "Ring", "Chain", "Real-KV fingerprint",
                 "Bounded verify"):
        assert term in terms, term
    assert "](docs/glossary.md)" in (ROOT / "README.md").read_text()
    assert "](glossary.md)" in RUNBOOK.read_text()
