"""Live requests (:class:`Request`) and one forward step's batch (:class:`Batch`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .workload import RequestSpec

if TYPE_CHECKING:
    from .radix import RadixNode


class Request:
    """A live request: its row, the ground-truth slot of every position, and how far it got."""

    def __init__(self, spec: RequestSpec, rp: int, max_seq_len: int) -> None:
        self.spec = spec
        self.rid = spec.rid
        self.rp = rp
        self.slots = np.zeros(max_seq_len, np.int64)  # ground truth: slot of position p
        self.computed = 0  # positions whose KV is written
        self.assigned = 0  # positions that have a slot (computed + this step's new tokens)
        self.num_tokens = spec.prompt_len  # tokens known so far (prompt + sampled)
        self.tree_len = 0  # leading positions shared from the prefix cache
        self.node: RadixNode | None = None
        self.swa_evicted = 0
        self.skip_scatter = False  # set by the stale-expected-tokens fault until the first decode step
        self.recycled = False  # its row held another request before
        self.admitted_step = 0

    @property
    def tokens(self) -> np.ndarray:
        return self.spec.tokens

    @property
    def prompt_len(self) -> int:
        return self.spec.prompt_len

    @property
    def prefilling(self) -> bool:
        return self.computed < self.spec.prompt_len

    @property
    def kv_left(self) -> int:
        return self.spec.total_len - 1 - self.computed


@dataclass
class Batch:
    """One forward step. Host arrays (``*_h``) describe the real rows; the device arrays are what the canary
    launches take (padding rows and their single garbage token are included, trailing)."""

    step: int
    reqs: list[Request]
    prefix_h: np.ndarray
    extend_h: np.ndarray
    admitted: list[Request]
    num_padding: int
    token_row: np.ndarray  # batch row of each real token
    token_pos: np.ndarray  # true position of each real token
    token_slot: np.ndarray  # full slot of each real token
    num_real_tokens: int = 0
    # device (xp) arrays
    req_pool_indices: Any = None
    prefix_lens: Any = None
    extend_seq_lens: Any = None
    valid_lens: Any = None
    input_ids: Any = None  # what the forward is fed (faults may change it)
    positions: Any = None
    out_cache_loc: Any = None
    swa_out_cache_loc: Any = None
    expected_tokens: Any = None  # the oracle: true tokens and positions
    expected_positions: Any = None
    draft_input_ids: Any = None  # EAGLE: token p + 1 for the draft slot at position p
    row_of_req: dict[int, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.reqs) + self.num_padding

    def token_index(self, row: int, position: int) -> int:
        """Flat index of the token that ``row`` writes at ``position`` this step."""
        start = int(self.extend_h[:row].sum())
        return start + position - int(self.prefix_h[row])
