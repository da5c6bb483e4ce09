"""Running a learner's rank code on ThreadWorld so that nothing it does can hang or crash a grader.

run_ranks(p, fn) calls fn(comm) on p ranks (threads) with a short wait timeout: a rank whose
receive is never answered raises minitrain's own timeout error, and RanksFailed then says, for
every rank, what it raised and at which line of the learner's file it was waiting (or that it
had already returned). A rank still running (an endless loop, no communication) when the others
have ended, or after the wall limit world_limit(), is reported with the line it is executing, and stopped.

This module is the one place that knows how minitrain reports a hang (the wait timeout given to
ThreadWorld / minitrain.comm.init, and the exception it raises): exercises only see RanksFailed.
"""
import inspect
import threading
import traceback

from .grading import Mismatch, StopGrading, current_frames, mixes_host_and_device, stop_thread, where

DEFAULT_WAIT_TIMEOUT = 5.0      # seconds a rank may wait for a message before it is declared stuck
# A world may run WALL_FACTOR wait timeouts + WALL_EXTRA_S in all (12 s by default): every correct
# hand-in's and reference's world ends within 0.2 s on a busy 2-core machine, and a rank computing longer
# than one wait timeout without a message fails anyway (its peers stop waiting). --timeout S scales it.
WALL_FACTOR = 2
WALL_EXTRA_S = 2.0
# On the GPU CuPy compiles each new kernel at its first use (seconds each from a cold cache), while the
# rank's peers wait for its next message: every wait gets this much more there, so that a compile is not a hang.
GPU_EXTRA_S = 30.0


class RanksFailed(AssertionError):
    """One or more ranks raised, or waited forever; the message says what each rank was doing."""
    explained = True


_settings = {"wait_timeout": DEFAULT_WAIT_TIMEOUT}


def set_wait_timeout(seconds):
    _settings["wait_timeout"] = float(seconds)


def wait_timeout():
    return _settings["wait_timeout"]


def rank_wait(timeout=None):
    """Seconds a rank waits for a message before it counts as stuck: the wait timeout (``timeout`` or
    --timeout's), GPU_EXTRA_S more on the GPU."""
    from .. import backend
    return (wait_timeout() if timeout is None else timeout) + (GPU_EXTRA_S if backend.get_device() == "cuda" else 0.0)


def world_limit(timeout=None):
    """Seconds a world may run before its ranks still running count as stuck (an endless loop)."""
    return WALL_FACTOR * rank_wait(timeout) + WALL_EXTRA_S


def make_world(p, timeout):
    """ThreadWorld(p) whose blocking waits give up after ``timeout`` seconds."""
    from minitrain.comm import ThreadWorld
    params = inspect.signature(ThreadWorld).parameters
    if "comm_timeout" in params:          # issue 15: a stall threshold and a hard limit
        return ThreadWorld(p, timeout=timeout, comm_timeout=timeout)
    return ThreadWorld(p, timeout=timeout)


def mpi_world(timeout):
    """minitrain.comm.init with a wait timeout of ``timeout`` seconds (debugging exercises under mpiexec)."""
    from minitrain import comm as library
    return library.init(timeout=timeout)


def _is_timeout(e):
    """minitrain's report of a wait that never ended (today CollectiveTimeout)."""
    from minitrain.comm import CollectiveTimeout
    return isinstance(e, CollectiveTimeout) or "Timeout" in type(e).__name__ or "Stall" in type(e).__name__


def _is_mismatch(e):
    """minitrain's check_collectives (issue 15): the ranks called different collectives, caught
    before any of them waited (without it, they would have hung)."""
    from minitrain.comm import CollectiveMismatchError
    return isinstance(e, CollectiveMismatchError)


def _is_rank_failed(e):
    """minitrain's note that this rank stopped waiting because another one failed."""
    from minitrain.comm import RankFailedError
    return isinstance(e, RankFailedError)


def run_ranks(p, fn, *args, timeout=None, **kwargs):
    """``fn(comm, *args, **kwargs)`` on ``p`` ThreadWorld ranks; returns the list of results.
    Raises RanksFailed (explained) if any rank raised, waited too long, or never finished."""
    limit = world_limit(timeout)
    timeout = rank_wait(timeout)
    world = make_world(p, timeout)
    errors, finished, idents = {}, {}, {}

    def body(comm):
        idents[comm.rank] = threading.get_ident()
        try:
            out = fn(comm, *args, **kwargs)
        except BaseException as e:
            errors[comm.rank] = e
            raise
        finished[comm.rank] = True
        return out

    box = {}

    def runner():
        try:
            box["results"] = world.run(body)
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=runner, name=f"grader-world-{p}", daemon=True)
    thread.start()
    thread.join(limit)
    # ThreadWorld itself gives up ``timeout`` s after the first rank ended; ranks it left running never
    # returned and were not waiting (a wait would have ended): left alone, they would spin through later checks
    frames = current_frames()
    left = [r for r in range(p) if r not in errors and not finished.get(r) and idents.get(r) in frames]
    if thread.is_alive() or left:
        why = (f"did not finish within {limit:g} s" if thread.is_alive() else
               f"ended {timeout:g} s after its first rank, but not every rank did")
        raise StopGrading(_stuck_report(p, why, idents, errors, finished, thread))
    if "error" in box:
        for r in sorted(errors):             # a grader's own check that failed inside a rank
            if isinstance(errors[r], Mismatch):
                raise errors[r]
        raise RanksFailed(_failure_report(p, errors, finished, timeout)) from box["error"]
    return box["results"]


def _rank_lines(p, describe):
    """'rank r: ...' lines, ranks with the same description grouped ('ranks 0-3: ...')."""
    lines, r = [], 0
    while r < p:
        text = describe(r)
        last = r
        while last + 1 < p and describe(last + 1) == text:
            last += 1
        who = f"rank {r}" if last == r else f"ranks {r}-{last}" if last > r + 1 else f"ranks {r}, {last}"
        lines.append(f"  {who}: {text}")
        r = last + 1
    return lines


REPORT_LINES = 12       # lines of minitrain's own report shown for the rank that failed first


def _describe_error(e, lines=1):
    at = where(e.__traceback__)
    if _is_rank_failed(e):
        text = "was waiting here; it stopped when another rank failed"
    else:
        message = "\n      ".join(str(e).strip().splitlines()[:lines])
        text = f"{type(e).__name__}: {message}" if message else type(e).__name__
    return text + (f"\n      at {at}" if at else "")


def _failure_report(p, errors, finished, timeout):
    timed_out = sorted(r for r, e in errors.items() if _is_timeout(e))
    raised = sorted(r for r, e in errors.items() if not _is_timeout(e) and not _is_rank_failed(e))

    first = (raised or timed_out or [None])[0]

    def describe(r):
        if r in errors:
            return _describe_error(errors[r], REPORT_LINES if r == first else 1)
        return "returned normally" if finished.get(r) else "was stopped"

    lines = _rank_lines(p, describe)
    if any(mixes_host_and_device(e) for e in errors.values()):
        lines.append("  On the GPU, NumPy and CuPy arrays do not mix: make new arrays with the input's module, "
                     "xp = minitrain.backend.array_module(x), never np, and copy between host and GPU only on "
                     "purpose (minitrain.backend.to_host / to_device)")
    if raised:
        e = errors[raised[0]]
        if isinstance(e, NotImplementedError):
            return f"not written yet: {e}" if str(e) else "not written yet (NotImplementedError)"
        head = f"rank {raised[0]} raised {type(e).__name__}"
        if _is_mismatch(e) and "split sizes disagree" in str(e):
            head = (f"ThreadWorld({p}): the ranks' split sizes disagree (caught by minitrain's check before any "
                    "row moved); every rank must expect exactly the rows each other rank sends it")
        elif _is_mismatch(e):
            head = (f"ThreadWorld({p}) would have hung: the ranks called different collectives (caught by "
                    "minitrain's check before any rank waited forever); every rank must make the same "
                    "collective calls, in the same order")
        elif len(errors) > len(raised):
            head += " (the ranks waiting for it then stopped)"
    elif timed_out:
        gone = [r for r in range(p) if finished.get(r)]
        waiting = [r for r in range(p) if r not in gone and r not in timed_out]
        head = (f"ThreadWorld({p}) hung: rank(s) {timed_out} waited {timeout:g} s for a message that "
                "never came")
        if gone:
            head += (f", and rank(s) {gone} had already returned: every rank must make the same "
                     "collective calls, and every receive needs a matching send")
        else:
            head += ((f" while rank(s) {waiting} waited too" if waiting else "")
                     + ": a deadlock, every rank waits for another; check that each receive has a "
                     "matching send on the rank it names")
    else:
        head = f"ThreadWorld({p}) failed"
    return head + "\n" + "\n".join(lines)


def _stuck_report(p, why, idents, errors, finished, world_thread):
    frames = current_frames()
    lines = []
    running = []
    for r in range(p):
        ident = idents.get(r)
        if r in errors:
            lines.append(f"  rank {r}: {type(errors[r]).__name__}: {str(errors[r]).splitlines()[0] if str(errors[r]) else ''}")
        elif finished.get(r):
            lines.append(f"  rank {r}: returned normally")
        elif ident in frames:
            running.append(r)
            lines.append(f"  rank {r}: still running at {where(traceback.extract_stack(frames[ident]))}")
        else:
            lines.append(f"  rank {r}: did not start")
    for r in running:                       # stop the endless loops so later checks can run
        stop_thread(idents[r])
    world_thread.join(2.0)
    return (f"ThreadWorld({p}) {why}: rank(s) {running} never returned "
            "and were not waiting for a message (an endless loop? if your code is only slow, give it longer "
            "with --timeout S). Grading stopped here.\n" + "\n".join(lines))


def count_launches(comm):
    """Record, on ``comm``, every collective at the moment it is called (before it runs, even
    asynchronously): a list that grows with [name, asynchronous] entries. (A collective takes its
    sequence number with comm.next_tag when called; an asynchronous one is then comm.submit-ted.)"""
    launched = []
    next_tag, submit = comm.next_tag, comm.submit

    def spy_next_tag(name):
        launched.append([name, False])
        return next_tag(name)

    def spy_submit(name, fn, *args):
        if launched:
            launched[-1][1] = True
        return submit(name, fn, *args)

    comm.next_tag, comm.submit = spy_next_tag, spy_submit
    return launched
