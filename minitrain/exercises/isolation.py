"""Grading in a child process, so that no hand-in can end the grader's own process.

A hand-in can end the process it runs in: os._exit(0), os.kill(os.getpid(), SIGKILL), os.abort(), a
crash in C code. In the grader's process, any of these ends check with no verdict (os._exit(0) with
exit status 0, as if it passed). Intercepting each way out can never be complete (a signal, a crash),
so grade_in_child forks: the child imports the file and grades it, sending each check's start and
result up a pipe; the parent prints and records. A child that ends before its last message is a
failed check whose explanation says how it ended and in which check; the child names the call itself
when it can (os._exit, os.abort, os.kill of itself) by leaving a note just before it goes. A fork costs
milliseconds (the parent has imported everything already: ring_all_reduce's 7 checks, 0.37 s in process,
0.40 s in a child); without fork (Windows) grading stays here. The parent never touches the GPU before
it forks: a CUDA context does not survive a fork, so the child is the first to create one.
"""
import multiprocessing
import os
import signal
import sys
import traceback

from .grading import LoadError, Result, where

# Past a check's limit and this with no word from the child, it is stuck beyond help (the margin
# covers PyTorch's import, which no check's limit counts, from a cold disk).
SILENCE_MARGIN_S = 60.0


def grade_in_child(exercise, load, fail_fast=False):
    """``exercise.grade(load(), fail_fast)`` in a forked child; returns its list of Results, or raises
    LoadError (from load, or because the child ended while importing the file)."""
    if not hasattr(os, "fork"):
        return exercise.grade(load(), fail_fast=fail_fast)
    sys.stdout.flush()
    sys.stderr.flush()
    reader, writer = multiprocessing.Pipe(duplex=False)      # whole pickled messages, no read-ahead
    pid = os.fork()
    if pid == 0:                                  # the child: never returns into the caller
        reader.close()
        _child(exercise, load, fail_fast, writer)
    writer.close()
    return _parent(exercise, pid, reader)


def _child(exercise, load, fail_fast, pipe):
    exit_now = os._exit
    status = 0
    try:
        send = pipe.send
        _leave_notes(send)
        send(("loading",))
        try:
            impl = load()
        except LoadError as e:
            send(("load_error", str(e)))
        else:
            exercise.grade(impl, fail_fast=fail_fast, on_start=lambda check: send(("start", check.label, check.hint)),
                           on_result=lambda result: send(("result", result)))
            send(("done",))
    except KeyboardInterrupt:                     # the user's Ctrl-C: the parent stops too
        status = 130
    except BaseException:                         # a bug in the grader itself, not in the hand-in
        try:
            send(("grader_error", traceback.format_exc()))
        except BaseException:
            traceback.print_exc()
        status = 1
    finally:
        for stream in (sys.stdout, sys.stderr):   # what the learner printed, then go, threads and all
            try:
                stream.flush()
            except BaseException:
                pass
        exit_now(status)


def _leave_notes(send):
    """Make os._exit and os.abort, and os.kill of this process, say first what called them and where."""
    def note(call):
        try:
            send(("ending", call, where(traceback.extract_stack()[:-2])))
        except BaseException:
            pass

    real_exit, real_abort = os._exit, os.abort

    def _exit(status):
        note(f"os._exit({status})")
        real_exit(status)

    def abort():
        note("os.abort()")
        real_abort()

    def audit(event, args):
        if event == "os.kill" and args[0] == os.getpid():
            note(f"os.kill(os.getpid(), {_signal_name(args[1])})")

    os._exit, os.abort = _exit, abort
    sys.addaudithook(audit)


def _signal_name(number):
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _parent(exercise, pid, pipe):
    from .grading import check_limit
    results, running, loading, done, ending, load_error, silent, grader_error = [], None, False, False, *[None] * 4
    try:
        while True:
            if not pipe.poll(check_limit() + SILENCE_MARGIN_S):   # stuck where no check's limit reaches
                os.kill(pid, signal.SIGKILL)
                silent = check_limit() + SILENCE_MARGIN_S
                break
            try:
                message = pipe.recv()
            except (EOFError, OSError):               # the child has gone (perhaps in mid-message)
                break
            kind = message[0]
            if kind == "loading":
                loading = True
            elif kind == "load_error":
                load_error = message[1]
            elif kind == "start":
                loading, running = False, message[1:]
            elif kind == "result":
                results.append(message[1])
                running = None
            elif kind == "ending":
                ending = message[1:]
            elif kind == "done":
                done = True
            elif kind == "grader_error":
                grader_error = message[1]
    except KeyboardInterrupt:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    finally:
        pipe.close()
    _, status = os.waitpid(pid, 0)
    if grader_error is not None:
        raise RuntimeError(f"the grader itself failed (a bug in minitrain, not in your code):\n{grader_error}")
    if load_error is not None:
        raise LoadError(load_error)
    if done:
        return results
    how = _how_it_ended(status, ending)
    if loading or (running is None and not results):
        if silent:
            raise LoadError(f"importing the file did not finish; it was stopped after {silent:g} s")
        raise LoadError(f"importing the file ended the grader's process ({how}) before the import returned; "
                        "keep your own tests under if __name__ == \"__main__\":")
    who = f"your {exercise.defines}" if isinstance(exercise.defines, str) else "your code"
    label, hint = running if running else ("after the last check", results[-1].hint)
    if silent:
        explanation = (f"{who} did not finish and could not be interrupted (waiting in C code?); its process was "
                       f"stopped after {silent:g} s. Grading stopped here.")
    else:
        explanation = f"{who} ended the grader's process ({how}) before it returned. Grading stopped here."
    return results + [Result(label, "fail", explanation, hint)]


def _how_it_ended(status, ending):
    """'os._exit(0) at mine.py line 3: os._exit(0)', or the exit status / signal when nothing was noted."""
    if ending:
        call, at = ending
        return f"{call} at {at}" if at else call
    if os.WIFSIGNALED(status):
        return f"killed by {_signal_name(os.WTERMSIG(status))}"
    return f"exit status {os.WEXITSTATUS(status)}"
