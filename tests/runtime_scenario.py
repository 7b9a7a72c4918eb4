"""A toy serving engine for the runtime tests: a paged real-KV pool, ``req_to_token``, optional SWA group (own
pool, LUT, window eviction) and EAGLE draft pool, a "prefix cache" holding finished requests' slots, and a
scripted schedule. Everything is NumPy on the host; tests corrupt its state to inject faults.
"""

from __future__ import annotations

import numpy as np

from kvcanary_cupy import RealKvSource
from kvcanary_cupy.runtime import KvGroup, KvPools, StepBatch

PAGE, TOKEN_BYTES, NUM_SLOTS, ROWS, WIDTH, WINDOW = 4, 32, 96, 5, 32, 3
MAX_BS, MAX_TOKENS = 4, 16

# per step: (pool row, new tokens) for live rows; rows listed in FINISH after a step go to the prefix cache
SCHEDULE = [
    [(1, 5), (2, 3)],
    [(1, 1), (2, 1)],
    [(1, 1), (2, 1), (3, 4)],
    [(1, 1), (3, 1)],
    [(1, 1), (3, 1), (4, 2)],
    [(1, 1), (4, 1)],
]
FINISH = {1: [2], 3: [3]}


def token(rp: int, pos: int) -> int:
    return 1000 * rp + 7 * pos + 1


class ToyEngine:
    """The engine's state the canary watches; ``groups`` picks FULL and optionally SWA, DRAFT."""

    def __init__(self, *, swa: bool = False, draft: bool = False, with_v: bool = False, paged: bool = False) -> None:
        """``paged``: slots come in blocks of ``PAGE`` (a block table, blocks handed out in a scrambled order)
        instead of one by one."""
        self.swa, self.draft, self.with_v, self.paged = swa, draft, with_v, paged
        self.block_table = np.zeros((ROWS, WIDTH // PAGE), np.int32)
        self.free_blocks = [int(b) for b in np.random.default_rng(1).permutation(np.arange(1, NUM_SLOTS // PAGE))]
        self.req_to_token = np.zeros((ROWS, WIDTH), np.int32)
        self.lut = np.zeros(NUM_SLOTS + 1, np.int64)
        names = ["FULL"] + (["SWA"] if swa else []) + (["DRAFT"] if draft else [])
        self.kv = {g: {kv: np.zeros((NUM_SLOTS // PAGE, PAGE, TOKEN_BYTES), np.uint8) for kv in ("K", "V")}
                   for g in names}
        self.slots: dict[int, list[int]] = {}
        self.cached: list[list[int]] = []  # slot paths the prefix cache holds (finished requests)
        self.next_slot, self.next_swa = 1, 1

    # -- description for the runtime -----------------------------------------------------------------------

    def sources(self, group: str, kv: str) -> tuple[RealKvSource, ...]:
        return (RealKvSource(self.kv[group][kv], page_size=PAGE, num_bytes_per_token=TOKEN_BYTES,
                             read_bytes=TOKEN_BYTES),)

    def groups(self) -> tuple[KvGroup, ...]:
        v = (lambda g: self.sources(g, "V")) if self.with_v else (lambda g: None)
        out = [KvGroup.full("FULL", NUM_SLOTS, self.sources("FULL", "K"), v("FULL"))]
        if self.swa:
            out.append(KvGroup.swa("SWA", NUM_SLOTS, window=WINDOW, lut=self.lut, k_sources=self.sources("SWA", "K"),
                                   v_sources=v("SWA")))
        if self.draft:
            out.append(KvGroup.draft("DRAFT", NUM_SLOTS, self.sources("DRAFT", "K"), v("DRAFT")))
        return tuple(out)

    def pools(self) -> KvPools:
        return KvPools(self.groups(), req_to_token=self.req_to_token)

    def held(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The sweep source: every cached slot with its position and predecessor."""
        slots, positions, prevs = [], [], []
        for path in self.cached:
            for p, s in enumerate(path):
                slots.append(s)
                positions.append(p)
                prevs.append(path[p - 1] if p else -1)
        return np.array(slots, np.int64), np.array(positions, np.int64), np.array(prevs, np.int64)

    # -- a step --------------------------------------------------------------------------------------------

    def schedule(self, step: int, *, padding_rows: int = 1) -> dict[str, np.ndarray]:
        """Give this step's new tokens slots; the batch as host arrays (one padding row at the end)."""
        rows, prefix, extend, ids, pos, loc = [], [], [], [], [], []
        for rp, n in SCHEDULE[step]:
            held = self.slots.setdefault(rp, [])
            p = len(held)
            new = self.new_slots(rp, p, n)
            held.extend(new)
            self.req_to_token[rp, p : p + n] = new
            if self.swa:
                for s in new:
                    self.lut[s] = self.next_swa
                    self.next_swa += 1
            rows.append(rp)
            prefix.append(p)
            extend.append(n)
            ids += [token(rp, q) for q in range(p, p + n)]
            pos += list(range(p, p + n))
            loc += new
        rows += [0] * padding_rows
        prefix += [0] * padding_rows
        extend += [0] * padding_rows
        arrays = {"req_pool_indices": rows, "prefix_lens": prefix, "extend_seq_lens": extend, "input_ids": ids,
                  "positions": pos, "out_cache_loc": loc}
        return {k: np.array(v, np.int64) for k, v in arrays.items()}

    def new_slots(self, rp: int, p: int, n: int) -> list[int]:
        if not self.paged:
            self.next_slot += n
            return list(range(self.next_slot - n, self.next_slot))
        out = []
        for q in range(p, p + n):
            if q % PAGE == 0:
                self.block_table[rp, q // PAGE] = self.free_blocks.pop()
            out.append(int(self.block_table[rp, q // PAGE]) * PAGE + q % PAGE)
        return out

    def history(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Token histories (prompt + every token written so far) of the batch's live rows."""
        rows = [int(r) for r in batch["req_pool_indices"] if r]
        parts = [[token(r, q) for q in range(len(self.slots[r]))] for r in rows]
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum([len(p) for p in parts], out=offsets[1:])
        valid = [len(self.slots[int(r)]) if r else 0 for r in batch["req_pool_indices"]]
        return {"history_ids": np.array([t for p in parts for t in p], np.int64), "history_offsets": offsets,
                "history_req_pool_indices": np.array(rows, np.int64), "valid_lens": np.array(valid, np.int64)}

    def step_batch(self, batch: dict[str, np.ndarray], *, oracle: bool = False, tokens: bool = False,
                   draft: bool = False) -> StepBatch:
        b = dict(batch)
        if draft:  # the draft's input rotation: slot p takes token p + 1
            b["input_ids"] = self.draft_ids(batch)
        extra = {}
        if oracle:
            extra = {"expected_input_ids": b["input_ids"].copy(), "expected_positions": b["positions"].copy()}
        if tokens:
            hist = self.history(batch)
            extra["valid_lens"] = hist["valid_lens"]
            if not draft:
                extra.update({k: hist[k] for k in ("history_ids", "history_offsets", "history_req_pool_indices")})
        return StepBatch(**b, **extra)

    def draft_ids(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        out = []
        for rp, p, e in zip(batch["req_pool_indices"], batch["prefix_lens"], batch["extend_seq_lens"], strict=True):
            out += [token(int(rp), q + 1) for q in range(int(p), int(p + e))]
        return np.array(out, np.int64)

    def forward(self, batch: dict[str, np.ndarray], group: str, ids: np.ndarray | None = None) -> None:
        """The model writes every new token's KV (bytes derived from token, position, slot) into ``group``."""
        ids = batch["input_ids"] if ids is None else ids
        for t, p, s in zip(ids.tolist(), batch["positions"].tolist(), batch["out_cache_loc"].tolist(), strict=True):
            if s < 0:  # a write the model lost
                continue
            slot = int(self.lut[s]) if group == "SWA" else s
            for kv in ("K", "V"):
                self.kv[group][kv][slot // PAGE, slot % PAGE] = self.kv_bytes(t, p, slot, group, kv)

    @staticmethod
    def kv_bytes(t: int, p: int, slot: int, group: str, kv: str) -> np.ndarray:
        seed = (t * 1_000_003 + p * 7919 + slot * 104_729 + len(group) * 31 + ord(kv)) % (2**32)
        return np.random.default_rng(seed).integers(0, 256, TOKEN_BYTES, dtype=np.uint8)

    def finish_step(self, step: int) -> None:
        """Retire finished rows into the prefix cache; slide SWA windows of live rows."""
        for rp in FINISH.get(step, []):
            self.cached.append(self.slots.pop(rp))
        if self.swa:
            for held in self.slots.values():
                for s in held[: max(0, len(held) - WINDOW)]:
                    self.lut[s] = 0

    def copy_kv(self, src: list[int], dst: list[int]) -> None:
        """The engine's own copy of the KV of slots ``src`` to ``dst`` in every group (SWA through the LUT)."""
        for group, pools in self.kv.items():
            lut = (lambda s: int(self.lut[s])) if group == "SWA" else (lambda s: s)
            for pool in pools.values():
                rows = [pool[lut(s) // PAGE, lut(s) % PAGE].copy() for s in src]
                for d, row in zip(dst, rows, strict=True):
                    pool[lut(d) // PAGE, lut(d) % PAGE] = row

    def flip_kv_bit(self, group: str, slot: int, kv: str = "K") -> None:
        self.kv[group][kv][slot // PAGE, slot % PAGE, 3] ^= 0x10
