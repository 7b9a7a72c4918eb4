"""The HTML report as a person sees it: rendered by headless Chromium (Debian's ``chromium``), which the test
starts itself; skipped, with the reason, where it is not installed. A probe script appended to a copy of the page
reads the rendered text and layout and writes them into the DOM that ``--dump-dom`` returns."""

from __future__ import annotations

import html as html_mod
import json
import re
import shutil
import subprocess

import pytest

from kvcanary_cupy.sim import SimConfig, parse_inject, run_simulation
from kvcanary_cupy.sim import report as report_mod

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")

# Collects what was rendered; the control span (a hyphenated word in a box too narrow for it, allowed to wrap)
# proves that the line count below does see a word broken at its hyphen.
PROBE = """
<span id="control" style="display:inline-block;width:3em">stale-expected</span>
<script>
window.addEventListener("load", () => {
  const lines = (el) => {
    const r = document.createRange();
    r.selectNodeContents(el);
    return r.getClientRects().length;
  };
  const svg = document.querySelector("figure svg");
  const box = svg ? svg.getBoundingClientRect() : null;
  const out = {
    text: document.body.innerText,
    numeric: [...document.querySelectorAll("td.num")].map(td => getComputedStyle(td).textAlign),
    names: [...document.querySelectorAll("td.name, td .name")].map(el => [el.textContent, lines(el)]),
    control: lines(document.getElementById("control")),
    svg: box ? [box.width, box.height] : null,
  };
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    if not shutil.which(CHROMIUM):
        pytest.skip(f"headless Chromium not found at {CHROMIUM} (Debian: apt-get install chromium)")
    pytest.importorskip("matplotlib")
    report = run_simulation(SimConfig(preset="mixed", steps=40, requests=10, seed=4, backend="numpy",
                                      inject=parse_inject(["all"])))
    tmp = tmp_path_factory.mktemp("page")
    page = tmp / "report.html"
    page.write_text(report_mod.render_html(report).replace("</body>", PROBE + "</body>"))
    done = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'profile'}", "--window-size=760,1000",
                           "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    match = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout, re.S)
    assert match, done.stdout[-2000:]
    return report, json.loads(html_mod.unescape(match.group(1)))


def test_the_page_shows_the_verdict_tool_version_timestamp_and_host(rendered):
    report, seen = rendered
    gen = report["generated"]
    assert report_mod.verdict(report) in seen["text"]
    for value in (f"{gen['tool']} {gen['version']}", gen["timestamp"], gen["host"]):
        assert value in seen["text"], value


def test_the_page_explains_every_reason_label(rendered):
    _, seen = rendered
    for bit, meaning in report_mod.REASON_MEANINGS.items():
        assert report_mod.short_reason(str(bit.name)) in seen["text"] and meaning in seen["text"]


def test_numbers_are_right_aligned_and_names_never_break_at_a_hyphen(rendered):
    report, seen = rendered
    assert seen["numeric"] and set(seen["numeric"]) == {"right"}
    assert seen["control"] > 1  # the measurement sees a hyphen break where one is allowed
    names = dict(seen["names"])
    for kind in report["kinds"]:
        assert names[kind["kind"]] == 1, kind["kind"]
    assert all(count == 1 for _, count in seen["names"]), [n for n in seen["names"] if n[1] != 1]


def test_the_plot_is_drawn_inline(rendered):
    _, seen = rendered
    assert seen["svg"] is not None and seen["svg"][0] > 300 and seen["svg"][1] > 150


def test_the_bars_keep_clear_of_the_plot_frame():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    report = run_simulation(SimConfig(preset="decode", steps=20, requests=4, seed=1, backend="numpy",
                                      inject=parse_inject(["kv-bitflip:0.5"])))
    fig = report_mod.plot_figure(report)
    try:
        top = fig.axes[0]
        bars = [patch for patch in top.patches if patch.get_height() > 0]
        assert bars
        x0, x1 = top.get_xlim()
        assert x0 < min(b.get_x() for b in bars) and max(b.get_x() + b.get_width() for b in bars) < x1
        assert max(b.get_y() + b.get_height() for b in bars) < top.get_ylim()[1]
    finally:
        plt.close(fig)
