"""TailThread: one piece of work at a time on one worker thread, joined by wait(), its error raised there."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from kvcanary_cupy.integrations.common.tail import TailThread


def test_work_runs_on_the_worker_thread_and_wait_joins_it():
    tail = TailThread(name="tail-test")
    seen: list[tuple[str, int]] = []
    gate = threading.Event()

    def work(n: int) -> None:
        gate.wait(5)
        seen.append((threading.current_thread().name, n))

    tail.submit(work, 1)
    assert tail.busy and seen == []  # not run on the caller's thread, not waited for by submit
    gate.set()
    tail.wait()
    assert not tail.busy and len(seen) == 1 and seen[0][0].startswith("tail-test") and seen[0][1] == 1
    tail.close()


def test_submit_waits_for_the_previous_work_so_steps_run_in_order():
    tail = TailThread()
    order: list[int] = []

    def work(n: int) -> None:
        time.sleep(0.01 * (5 - n))  # earlier work takes longer: without the wait the order would flip
        order.append(n)

    for n in range(5):
        tail.submit(work, n)
    tail.close()
    assert order == list(range(5))


def test_an_error_of_the_work_is_raised_by_wait_once_and_the_thread_keeps_serving():
    tail = TailThread()

    def fail() -> None:
        raise ValueError("kv-canary: planted")

    tail.submit(fail)
    with pytest.raises(ValueError, match="planted"):
        tail.wait()
    tail.wait()  # raised once, not again
    done: list[int] = []
    tail.submit(done.append, 7)
    tail.close()
    assert done == [7]


def test_an_error_is_raised_by_the_next_submit_before_new_work_starts():
    tail = TailThread()
    ran: list[int] = []
    tail.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        tail.submit(ran.append, 1)
    tail.close()
    assert ran == []


def test_close_stops_the_worker_and_a_later_submit_starts_a_new_one():
    tail = TailThread(name="tail-close")
    tail.submit(lambda: None)
    tail.close()
    assert not any(t.name.startswith("tail-close") and t.is_alive() for t in threading.enumerate())
    out: list[int] = []
    tail.submit(out.append, 3)
    tail.close()
    assert out == [3]


def test_threads_on_this_thread_caps_the_calling_threads_launches_only():
    from kvcanary_cupy.hostcuda import _capped, threads_on_this_thread

    assert _capped(4) == 4
    with threads_on_this_thread(1):
        assert _capped(4) == 1 and _capped(1) == 1
        other: list[int] = []
        worker = threading.Thread(target=lambda: other.append(_capped(4)))
        worker.start()
        worker.join()
        assert other == [4]  # another thread's launches keep their count
        with threads_on_this_thread(2):
            assert _capped(4) == 2
        assert _capped(4) == 1
    assert _capped(4) == 4
    with pytest.raises(ValueError, match=r"^kv-canary: threads"), threads_on_this_thread(0):
        pass
    assert _capped(4) == 4


def test_join_waits_for_the_work_and_leaves_its_error_for_wait():
    tail = TailThread()
    gate = threading.Event()
    done: list[int] = []

    def work() -> None:
        gate.wait(5)
        done.append(1)
        raise ValueError("kv-canary: planted")

    tail.submit(work)
    threading.Timer(0.05, gate.set).start()
    tail.join()
    assert done == [1] and tail.busy  # done, its error still pending
    with pytest.raises(ValueError, match="planted"):
        tail.wait()
    tail.close()


def test_held_work_starts_only_when_released_and_runs_on_the_worker_thread():
    tail = TailThread(name="tail-held")
    seen: list[str] = []
    tail.hold(lambda: seen.append(threading.current_thread().name))
    time.sleep(0.05)  # submitted work would have run by now
    assert tail.busy and seen == []
    tail.release()
    tail.wait()
    assert not tail.busy and len(seen) == 1 and seen[0].startswith("tail-held")
    tail.release()  # nothing held: nothing runs
    tail.wait()
    assert len(seen) == 1
    tail.close()


@pytest.mark.parametrize("reader", ["wait", "join", "close"])
def test_a_wait_join_or_close_starts_held_work_and_returns_after_it(reader):
    tail = TailThread()
    seen: list[int] = []
    tail.hold(seen.append, 7)
    getattr(tail, reader)()
    assert seen == [7]
    assert tail.busy == (reader == "join")  # join leaves the finished work for wait (its error, if any)
    tail.close()
    assert not tail.busy


def test_hold_waits_for_the_work_in_flight_and_a_held_error_is_raised_by_wait():
    tail = TailThread()
    order: list[int] = []

    def slow(n: int) -> None:
        time.sleep(0.05)
        order.append(n)

    tail.submit(slow, 1)
    tail.hold(order.append, 2)
    assert order == [1]  # hold returned after the work in flight
    tail.release()
    tail.wait()
    assert order == [1, 2]

    def fail() -> None:
        raise RuntimeError("held work failed")

    tail.hold(fail)
    tail.join()  # started and joined: the error is kept for wait
    with pytest.raises(RuntimeError, match="held work failed"):
        tail.wait()
    tail.close()


def test_a_tail_thread_given_cores_runs_its_work_there_and_leaves_its_creator_where_it_was():
    import os

    creator = os.sched_getaffinity(0)
    # each CPU this process may use in turn (up to 8): ``pinned`` is the worker's own, whichever it is, never
    # another process's that happens to match one of them
    for cpu in sorted(creator)[:8]:
        tail = TailThread(cores=frozenset({cpu}))
        seen: list[set[int]] = []
        tail.submit(lambda seen=seen: seen.append(os.sched_getaffinity(0)))
        tail.submit(lambda seen=seen: seen.append(os.sched_getaffinity(0)))
        tail.close()
        assert seen == [{cpu}, {cpu}] and tail.pinned == {cpu}
        assert os.sched_getaffinity(0) == creator


def test_by_default_the_worker_is_named_kvcanary_tail_and_without_cores_it_pins_nothing():
    tail = TailThread()
    assert tail.pinned is None and not tail.started
    seen: list[str] = []
    tail.submit(lambda: seen.append(threading.current_thread().name))
    tail.wait()
    assert len(seen) == 1 and seen[0].startswith("kvcanary-tail_") and tail.pinned is None and tail.started
    tail.close()


def test_every_piece_of_work_runs_on_one_and_the_same_worker_thread():
    """Submitted back to back (each waits for the one before), held and released: one worker thread runs them
    all; no second thread starts, even when the next work arrives as the last one finishes."""
    tail = TailThread(name="tail-one")
    seen: set[int] = set()
    for i in range(300):
        if i % 3 == 2:
            tail.hold(lambda: seen.add(threading.get_ident()))
            tail.release()
        else:
            tail.submit(lambda: seen.add(threading.get_ident()))
    tail.wait()
    assert len(seen) == 1 and threading.get_ident() not in seen
    assert sum(t.name.startswith("tail-one") for t in threading.enumerate()) == 1
    tail.close()


def test_a_tail_thread_given_cores_it_may_not_use_stays_on_its_creators_and_still_runs_its_work():
    import os

    creator = os.sched_getaffinity(0)
    tail = TailThread(cores=frozenset({(os.cpu_count() or 1) + 64}))  # no such CPU: the call is refused
    seen: list[set[int]] = []
    tail.submit(lambda: seen.append(os.sched_getaffinity(0)))
    tail.close()
    assert seen == [creator] and tail.pinned is None


@pytest.fixture
def switch_interval():
    """The interpreter's switch interval before the test, put back after it whatever the test left."""
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_a_thread_asking_for_a_shorter_switch_interval_has_it_from_its_start_to_its_close(switch_interval):
    asked = switch_interval / 10
    tail = TailThread(switch_interval=asked)
    assert sys.getswitchinterval() == switch_interval  # not started: the interpreter is left alone
    tail.submit(lambda: None)
    tail.wait()
    assert sys.getswitchinterval() == pytest.approx(asked, rel=1e-3)
    tail.close()
    assert sys.getswitchinterval() == switch_interval


def test_with_several_threads_the_lowest_interval_holds_until_the_last_closes(switch_interval):
    wide, narrow = TailThread(switch_interval=switch_interval / 4), TailThread(switch_interval=switch_interval / 20)
    for tail in (wide, narrow):
        tail.submit(lambda: None)
    assert sys.getswitchinterval() == pytest.approx(switch_interval / 20, rel=1e-3)
    narrow.close()
    assert sys.getswitchinterval() == pytest.approx(switch_interval / 4, rel=1e-3)
    wide.close()
    assert sys.getswitchinterval() == switch_interval


def test_a_thread_never_raises_the_switch_interval(switch_interval):
    sys.setswitchinterval(0.0001)
    low = sys.getswitchinterval()
    tail = TailThread(switch_interval=0.002)
    tail.submit(lambda: None)
    assert sys.getswitchinterval() == low
    tail.close()
    assert sys.getswitchinterval() == low


def test_an_interval_changed_by_someone_else_meanwhile_is_not_put_back(switch_interval):
    tail = TailThread(switch_interval=switch_interval / 10)
    tail.submit(lambda: None)
    sys.setswitchinterval(0.003)
    theirs = sys.getswitchinterval()
    tail.close()
    assert sys.getswitchinterval() == theirs


@pytest.mark.parametrize("seconds", [0, -0.001, 1.5])
def test_a_switch_interval_outside_zero_to_one_second_is_refused_by_name(seconds, switch_interval):
    with pytest.raises(ValueError, match=r"^kv-canary: switch_interval must be in \(0, 1\] seconds"):
        TailThread(switch_interval=seconds)
    assert sys.getswitchinterval() == switch_interval


def test_an_interpreter_that_exits_without_closing_the_thread_is_not_held_by_it():
    """An engine that never removes its canary still exits: the idle worker thread does not keep the process."""
    import subprocess

    code = ("from kvcanary_cupy.integrations.common.tail import TailThread\n"
            "tail = TailThread()\ntail.submit(print, 'ran')\ntail.wait()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "ran", proc.stderr
