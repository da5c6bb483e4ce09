"""How a rank waits for its messages (Communicator.wait_all): sched_yield for a window, then sleep.

A rank that spins while it waits takes the core of the rank it waits for where ranks share cores:
spinning made a 4 MiB ring all-reduce on 2 cores 5x slower. One that sleeps at once wakes late. So
wait_all yields (sched_yield) for YIELD_WINDOW_S, or longer for a big message (its bytes over
YIELD_BYTES_PER_S: MPI moves a big message only while one of its ends polls), then sleeps from
50 us, doubling up to MAX_SLEEP_S. MINITRAIN_COMM_YIELD_S sets the window in seconds (below 0: 0;
the test suite sets 0, its workers sharing the cores); anything but a finite number is refused when
minitrain.comm is imported, in one line that names the variable. The CPU time a thread spends polling is
kept apart (waiting_cpu_seconds): the jobs leave it out of a step's own CPU time.
"""
import math
import os
import threading

ENV = "MINITRAIN_COMM_YIELD_S"
DEFAULT_YIELD_S = 10e-3
MAX_SLEEP_S = 1e-3
YIELD_BYTES_PER_S = 1e9           # ... or bytes / this (measured.md)


def yield_window(text):
    """The window in seconds from MINITRAIN_COMM_YIELD_S's text (None or empty: unset, 10 ms)."""
    try:
        value = DEFAULT_YIELD_S if text is None or not text.strip() else float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{ENV} must be a finite number of seconds (the sched_yield window of a waiting rank), "
                         f"got {text!r}")
    return max(0.0, value)


YIELD_WINDOW_S = yield_window(os.environ.get(ENV))

_waiting = threading.local()      # per thread: CPU seconds spent polling (wait_all adds to .cpu)


def waiting_cpu_seconds():
    """CPU seconds this thread has spent polling in ``wait_all`` (the jobs leave it out of a step's CPU time)."""
    return getattr(_waiting, "cpu", 0.0)
