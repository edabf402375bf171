"""CPU cost of one ubatch hand-off: the greenlet scheduler against OS threads.

    python -m dbo.cli.bench_switch [--yields 200000] [--repeats 5]
    dbo bench-switch

Both sides run two ubatches that hand control back and forth `--yields` times each.
`greenlet`: UBatchScheduler with stand-in streams, each hand-off being
`dbo_yield_and_switch_from_compute_to_comm` / `..._from_comm_to_compute` alternately, so
the figure includes the event record/wait, stream and thread-state bookkeeping a real
MoE layer pays. `greenlet_bare`: the same with `dbo_yield`. `greenlet_floor`: two plain
greenlets switching to each other, nothing else (what no bookkeeping can go below).
`thread`: two OS threads handing off through a pair of `threading.Event`s (the way a
thread-based runtime imitates coroutines).

The greenlet rows are CPU time of the calling thread (`time.thread_time`: every greenlet
runs on it), so other processes on a shared machine disturb them little; the thread row
is wall time (its cost is mostly the OS waking the other thread). Prints a table, then one
JSON line with `greenlet_us_per_yield`, `greenlet_floor_us_per_yield`,
`thread_us_per_yield` and `ratio` (medians over repeats; `greenlet_us_per_yield_min` is
the best repeat).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time

import greenlet

from dbo import (UBatchScheduler, dbo_yield, dbo_yield_and_switch_from_comm_to_compute,
                 dbo_yield_and_switch_from_compute_to_comm)
from dbo.cli import Parser, check_int_option


def time_greenlet(num_yields: int, *, with_streams: bool = True) -> float:
    """Seconds per yield for the greenlet scheduler (two ubatches, `num_yields` each)."""
    sched = UBatchScheduler("cpu")

    def ubatch() -> None:
        if with_streams:
            for _ in range(num_yields // 2):
                dbo_yield_and_switch_from_compute_to_comm()
                dbo_yield_and_switch_from_comm_to_compute()
        else:
            for _ in range(num_yields):
                dbo_yield()

    per_ubatch = num_yields // 2 * 2 if with_streams else num_yields
    start = time.thread_time()
    sched.run([ubatch, ubatch])
    return (time.thread_time() - start) / (2 * per_ubatch)


def time_greenlet_floor(num_yields: int) -> float:
    """Seconds per switch between two bare greenlets (`num_yields` switches each)."""
    def ping() -> None:
        for _ in range(num_yields):
            pong.switch()

    def pong_body() -> None:
        for _ in range(num_yields):
            ping_glet.switch()

    ping_glet, pong = greenlet.greenlet(ping), greenlet.greenlet(pong_body)
    start = time.thread_time()
    ping_glet.switch()
    elapsed = time.thread_time() - start
    if not pong.dead:  # pong is parked at its last switch; let it finish
        pong.switch()
    return elapsed / (2 * num_yields)


def time_threads(num_yields: int) -> float:
    """Seconds per hand-off between two OS threads signalling with `threading.Event`."""
    turn = [threading.Event(), threading.Event()]

    def worker(me: int) -> None:
        other = 1 - me
        for _ in range(num_yields):
            turn[me].wait()
            turn[me].clear()
            turn[other].set()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    start = time.perf_counter()
    turn[0].set()
    for t in threads:
        t.join()
    return (time.perf_counter() - start) / (2 * num_yields)


DESCRIPTION = """\
Measures the CPU cost of one hand-off between DBO's two micro-batches: dbo's greenlet
scheduler with its stream and event bookkeeping, without it, and two bare greenlets (the
floor), against two OS threads handing off through events. Prints a table, then one JSON
line."""

EXAMPLES = """\
examples:
  dbo bench-switch
  dbo bench-switch --yields 1e6 --repeats 3
"""


def _count(text: str) -> int:
    """An int, also written as 1e6 (a float that is a whole number)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number, e.g. 100000 or 1e5")
    return int(value)


# Upper bounds: a greenlet hand-off costs about 1 us of CPU and a thread hand-off about
# 10 us, so at the bound one measurement takes ~10 s and the whole run (three greenlet
# measurements and one thread measurement per repeat) minutes, not days.
MAX_YIELDS = 10_000_000
MAX_THREAD_YIELDS = 1_000_000
MAX_REPEATS = 100
GREENLET_US, THREAD_US = 1.0, 10.0


def check_bounds(yields: int, thread_yields: int, repeats: int) -> None:
    """ValueError (one line, with the bound and why) for counts below what a measurement
    needs or above what finishes in minutes; the message says how long it would take."""
    def takes(seconds: float) -> str:
        for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
            if seconds >= 2 * size:
                return f"about {seconds / size:.0f} {unit}"
        return f"about {seconds:.0f} s"

    per_repeat = 3 * 2 * yields * GREENLET_US * 1e-6 + 2 * thread_yields * THREAD_US * 1e-6
    run = f" (this run would take {takes(repeats * per_repeat)})"
    check_int_option("yields", yields, low=2, high=MAX_YIELDS,
                     why=f": three greenlet measurements per repeat of 2 x N hand-offs at "
                         f"~{GREENLET_US:.0f} us each{run}")
    check_int_option("thread_yields", thread_yields, low=1, high=MAX_THREAD_YIELDS,
                     why=f": 2 x N thread hand-offs per repeat at ~{THREAD_US:.0f} us each{run}")
    check_int_option("repeats", repeats, low=1, high=MAX_REPEATS,
                     why=f": the medians settle within a few repeats{run}")


def main(argv: list[str] | None = None) -> int:
    parser = Parser("dbo bench-switch", description=DESCRIPTION, epilog=EXAMPLES)
    parser.add_argument("--yields", type=_count, default=100_000,
                        help="hand-offs per ubatch in one greenlet measurement")
    parser.add_argument("--thread-yields", type=_count, default=20_000,
                        help="hand-offs per thread in one thread measurement")
    parser.add_argument("--repeats", type=_count, default=5, help="measurements per method")
    args = parser.parse_args(argv)
    try:
        check_bounds(args.yields, args.thread_yields, args.repeats)
    except ValueError as exc:
        parser.error(str(exc))

    results = {"greenlet": [], "greenlet_bare": [], "greenlet_floor": [], "thread": []}
    for i in range(args.repeats):
        print(f"repeat {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
        results["greenlet"].append(time_greenlet(args.yields) * 1e6)
        results["greenlet_bare"].append(time_greenlet(args.yields, with_streams=False) * 1e6)
        results["greenlet_floor"].append(time_greenlet_floor(args.yields) * 1e6)
        results["thread"].append(time_threads(args.thread_yields) * 1e6)
    med = {k: statistics.median(v) for k, v in results.items()}
    ratio = med["thread"] / med["greenlet"]

    print(f"{'method':<44} {'us/yield (median)':>18} {'min':>8} {'max':>8}")
    labels = {"greenlet": "greenlet + stream/event bookkeeping",
              "greenlet_bare": "greenlet, dbo_yield only",
              "greenlet_floor": "two bare greenlets (the floor)",
              "thread": "two OS threads, threading.Event pairs"}
    for key, label in labels.items():
        print(f"{label:<44} {med[key]:>18.3f} {min(results[key]):>8.3f} {max(results[key]):>8.3f}")
    print(f"ratio thread / greenlet: {ratio:.1f}x")
    print(json.dumps({"bench": "switch", "greenlet_us_per_yield": round(med["greenlet"], 4),
                      "greenlet_us_per_yield_min": round(min(results["greenlet"]), 4),
                      "greenlet_bare_us_per_yield": round(med["greenlet_bare"], 4),
                      "greenlet_floor_us_per_yield": round(med["greenlet_floor"], 4),
                      "thread_us_per_yield": round(med["thread"], 4), "ratio": round(ratio, 2),
                      "repeats": args.repeats, "yields": args.yields}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
