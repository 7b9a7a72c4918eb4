"""The transfer protocol between the prefill process (rank 0) and the decode workers (ranks 1..N).

Everything moves through ``torch.distributed`` point-to-point calls on one process group (gloo on CPU,
NCCL when the processes hold GPUs), every call bounded by the group's timeout. A receiver must know each
message's size, so fixed-size int64 headers go first. Per prefill step and decode worker, in this order:

1. tick ``int64[4]`` = (op, step, transfers for this worker, 0); op STOP ends the run;
2. per transfer: header ``int64[HEADER_WORDS]`` = (request id, tokens, KV words per token, canary buffers,
   fault kind index or -1, four fault parameters, 0...), then the KV payload ``int64 [tokens, words]`` (every
   layer's K, then V, of each position) and the records ``int64 [buffers, tokens, 4]``;
3. the worker's ack ``int64[2 + transfers]`` = (step, 1, per transfer: 1 if its receiver-side fault was
   placed). The ack is the liveness check: a worker that died or hangs fails the prefill's receive.

The fault fields are the simulator's bookkeeping (so the decode side can attribute what it finds); the canary
never reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

OP_TICK, OP_STOP = 1, 2
TICK_WORDS = 4
HEADER_WORDS = 12
PREFILL_RANK = 0


@dataclass
class Transfer:
    """One request's KV and canary records, as sent or received."""

    rid: int
    kv: np.ndarray  # int64 [tokens, words]
    records: np.ndarray  # int64 [buffers, tokens, 4]
    fault: int = -1  # index into TRANSFER_KINDS, -1: none
    params: tuple[int, int, int, int] = (0, 0, 0, 0)

    @property
    def tokens(self) -> int:
        return int(self.kv.shape[0])

    def header(self) -> np.ndarray:
        out = np.zeros(HEADER_WORDS, np.int64)
        out[:9] = (self.rid, self.tokens, self.kv.shape[1], self.records.shape[0], self.fault, *self.params)
        return out


class Channel:
    """Blocking sends and receives of NumPy int64 arrays over the process group, on ``device`` ("cpu" for
    gloo, "cuda" for NCCL). Receives land in buffers preallocated for the largest message."""

    def __init__(self, torch: Any, device: str, max_tokens: int, words: int, buffers: int) -> None:
        self.torch, self.device = torch, device
        self.dist = torch.distributed
        self._kv = torch.empty(max_tokens * words, dtype=torch.int64, device=device)
        self._records = torch.empty(buffers * max_tokens * 4, dtype=torch.int64, device=device)
        self.bytes_sent = 0
        self.bytes_received = 0

    def _out(self, arr: np.ndarray) -> Any:
        tensor = self.torch.from_numpy(np.ascontiguousarray(arr))
        return tensor if self.device == "cpu" else tensor.to(self.device)

    def send(self, arr: np.ndarray, dst: int) -> None:
        self.dist.send(self._out(arr), dst)
        self.bytes_sent += arr.nbytes

    def recv_small(self, words: int, src: int) -> np.ndarray:
        buf = self.torch.empty(words, dtype=self.torch.int64, device=self.device)
        self.dist.recv(buf, src)
        return buf.cpu().numpy()

    def _recv_into(self, pool: Any, count: int, src: int) -> np.ndarray:
        view = pool[:count]  # a contiguous prefix: received in place
        if count:
            self.dist.recv(view, src)
        self.bytes_received += count * 8
        return view.cpu().numpy()

    # -- messages ------------------------------------------------------------------------------------------

    def send_tick(self, dst: int, op: int, step: int, transfers: int) -> None:
        self.send(np.array([op, step, transfers, 0], np.int64), dst)

    def recv_tick(self) -> tuple[int, int, int]:
        op, step, transfers, _ = (int(v) for v in self.recv_small(TICK_WORDS, PREFILL_RANK))
        return op, step, transfers

    def send_transfer(self, dst: int, transfer: Transfer) -> None:
        self.send(transfer.header(), dst)
        if transfer.tokens:
            self.send(transfer.kv, dst)
            self.send(transfer.records, dst)

    def recv_transfer(self) -> Transfer:
        """The next transfer; its arrays are views of the receive buffers, valid until the next receive."""
        h = self.recv_small(HEADER_WORDS, PREFILL_RANK)
        rid, tokens, words, buffers, fault = (int(v) for v in h[:5])
        if tokens * words > self._kv.shape[0] or buffers * tokens * 4 > self._records.shape[0]:
            raise RuntimeError(f"transfer of request {rid} announces {tokens} tokens x {words} words and {buffers} "
                               "canary buffers, more than this worker's pool can hold")
        kv = self._recv_into(self._kv, tokens * words, PREFILL_RANK).reshape(tokens, words)
        records = self._recv_into(self._records, buffers * tokens * 4, PREFILL_RANK).reshape(buffers, tokens, 4)
        return Transfer(rid, kv, records, fault, tuple(int(v) for v in h[5:9]))  # type: ignore[arg-type]

    def send_ack(self, step: int, placed: list[bool]) -> None:
        self.send(np.array([step, 1, *[int(p) for p in placed]], np.int64), PREFILL_RANK)

    def recv_ack(self, src: int, step: int, transfers: int) -> list[bool]:
        ack = self.recv_small(2 + transfers, src)
        if int(ack[0]) != step or int(ack[1]) != 1:
            raise RuntimeError(f"decode worker {src} acknowledged step {int(ack[0])} while step {step} was expected")
        return [bool(v) for v in ack[2:]]


def timeout(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def describe(exc: BaseException) -> str:
    """The first sentence of a torch.distributed error, without gloo's source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ")[0].rstrip(".")


class PeerLost(RuntimeError):
    """A send or receive failed: the peer died, hung past the timeout, or broke the protocol."""
