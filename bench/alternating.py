"""Two calls timed back to back in alternating order, rounds after rounds: the ratio of their times that a
machine's drift (other work, frequency) cancels out of, where rows timed one after another drift apart."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def alternating_ratio(subject: Callable[[], object], baseline: Callable[[], object], rounds: int,
                      setup: Callable[[], object] | None = None) -> float:
    """Median over ``rounds`` rounds of time(subject) / time(baseline), the two timed back to back (baseline
    first in even rounds), ``setup`` run untimed before each call."""
    ratios = []
    for r in range(rounds):
        times = {}
        for name in (("s", "b") if r % 2 else ("b", "s")):
            if setup is not None:
                setup()
            start = time.perf_counter()
            (subject if name == "s" else baseline)()
            times[name] = time.perf_counter() - start
        ratios.append(times["s"] / times["b"])
    return statistics.median(ratios)
