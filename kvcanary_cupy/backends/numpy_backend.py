"""The ``numpy`` backend: the vectorized reference implementations behind the common backend interface."""

from __future__ import annotations

from typing import Any

from .numpy_chain import scatter_reference, verify_reference, write_reference
from .numpy_plan import plan_reference
from .numpy_transfer import gather_records_reference, scatter_records_reference


class NumpyBackend:
    """Reference backend. ``on_invalid="raise"`` refuses out-of-range device values with ValueError;
    ``"flag"`` reports them exactly like the kernels do (status bits, neutralised entries)."""

    name = "numpy"

    def __init__(self, on_invalid: str = "raise") -> None:
        self.on_invalid = on_invalid

    def plan(self, launch: Any) -> None:
        plan_reference(launch, self.on_invalid)

    def write(self, launch: Any) -> None:
        write_reference(launch, self.on_invalid)

    def verify(self, launch: Any) -> None:
        verify_reference(launch, self.on_invalid)

    def scatter(self, launch: Any) -> None:
        scatter_reference(launch, self.on_invalid)

    def gather_records(self, launch: Any) -> None:
        gather_records_reference(launch, self.on_invalid)

    def scatter_records(self, launch: Any) -> None:
        scatter_records_reference(launch, self.on_invalid)
