"""Starting, watching and stopping the processes of a disaggregated run (torch.distributed, loopback only).

The parent binds a socket to 127.0.0.1:0 and hosts the TCPStore on it (``master_listen_fd``: nothing listens
on any other interface, and no port can be taken between choosing and listening). It starts one prefill
process (rank 0) and the decode workers (ranks 1..N) with ``torch.multiprocessing.start_processes`` (spawn),
which join the process group through that store; gloo is pinned to the loopback interface, and every
collective and point-to-point call is bounded by the transfer timeout. Each process leaves its result (or
its error) in the store. The parent polls the processes against an overall deadline: the first non-zero exit
ends the run, the survivors get a moment to record what they saw and are then killed. Children die with the
parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import time
import traceback
from typing import Any

from .config import DisaggConfig
from .wire import timeout

GRACE_S = 3.0  # after a failure, how long the survivors may take to record theirs


class DisaggRunError(RuntimeError):
    """The run could not complete: a process died, failed or the deadline passed. The message says which."""


def _role(rank: int) -> str:
    return "prefill process" if rank == 0 else f"decode worker {rank}"


def _worker(rank: int, world: int, port: int, cfg_dict: dict[str, Any], inherited_fd: int) -> None:
    """Entry point of every child (rank given by start_processes). ``inherited_fd``: the parent's bound socket,
    which a forked child holds a copy of and closes (-1 when spawned)."""
    if inherited_fd >= 0:
        os.close(inherited_fd)
    if hasattr(signal, "SIGKILL"):
        try:  # die with the parent: orphans would keep the run's sockets open
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
        except OSError:
            pass
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cfg = DisaggConfig.from_dict(cfg_dict)
    limit = timeout(cfg.transfer_timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=limit)
    try:
        from ..config import resolve_backend

        backend, _, _ = resolve_backend(cfg.backend)
        # NCCL wants one GPU per rank; with fewer GPUs the pages go through gloo (host memory).
        on_gpu = backend == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() >= world
        if on_gpu:
            import cupy

            torch.cuda.set_device(rank)
            cupy.cuda.Device(rank).use()
        dist.init_process_group("nccl" if on_gpu else "gloo", store=store, rank=rank, world_size=world,
                                timeout=limit)
        result = _run_role(cfg, rank, torch, "cuda" if on_gpu else "cpu")
        store.set(f"result/{rank}", json.dumps(result))
        dist.destroy_process_group()
    except Exception as exc:
        store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}")
        raise SystemExit(1) from None


def _run_role(cfg: DisaggConfig, rank: int, torch: Any, device: str) -> dict[str, Any]:
    from .decode import DecodeSide
    from .prefill import PrefillSide, wire_sizes
    from .wire import Channel

    if rank == 0:
        return PrefillSide(cfg, Channel(torch, device, max_tokens=1, words=1, buffers=1)).run()
    return DecodeSide(cfg, rank, Channel(torch, device, **wire_sizes(cfg))).run()


def _describe(rank: int, code: int | None, errors: dict[int, str]) -> str:
    if rank in errors:
        return f"{_role(rank)} failed: {errors[rank].strip().splitlines()[0]}"
    if code is None:
        return f"{_role(rank)} was still running and was stopped"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"{_role(rank)} died (killed by {name})"
    return f"{_role(rank)} exited with status {code}"


def run_processes(cfg: DisaggConfig) -> tuple[dict[int, dict[str, Any]], float]:
    """Run every process to completion; returns ({rank: result}, seconds). Raises DisaggRunError."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    world = cfg.decode_workers + 1
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    start = time.monotonic()
    # Fork (where the platform has it) while this process has no thread, no process group and no store
    # yet: the children start in milliseconds instead of importing torch again (seconds each). They connect
    # to the store, retrying until it listens.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    inherited = sock.fileno() if method == "fork" else -1
    ctx = mp.start_processes(_worker, args=(world, port, cfg.as_dict(), inherited), nprocs=world, join=False,
                             start_method=method)
    sock_fd = sock.detach()  # the store takes the bound socket over (and closes it with itself)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=sock_fd,
                          timeout=timeout(cfg.transfer_timeout_s))
    try:
        failed_at = None
        while True:
            codes = [p.exitcode for p in ctx.processes]
            if all(c == 0 for c in codes):
                break
            now = time.monotonic()
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if failed_at is not None and (all(c is not None for c in codes) or now - failed_at > GRACE_S):
                raise DisaggRunError(_failure(store, codes, world))
            if now - start > cfg.deadline_s:
                raise DisaggRunError(f"the run did not finish within its deadline of {cfg.deadline_s:g} s; "
                                     + _failure(store, codes, world))
            time.sleep(0.05)
        results = {rank: json.loads(store.get(f"result/{rank}")) for rank in range(world)}
        return results, time.monotonic() - start
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(timeout=5)
        del store


def _failure(store: Any, codes: list[int | None], world: int) -> str:
    errors = {}
    for rank in range(world):
        key = f"error/{rank}"
        if store.check([key]):
            errors[rank] = store.get(key).decode()
    # A process killed by a signal is the likely root cause; the others mostly report losing it.
    order = sorted(range(world), key=lambda r: (not (codes[r] or 0) < 0, r))
    return "; ".join(_describe(r, codes[r], errors) for r in order if codes[r] != 0)
