"""The help of every command line (jobs, planner, checkpoint tool, exercises, benchmarks): plain text
that says each option's default.

    p = argparse.ArgumentParser(description=..., formatter_class=cli.HelpFormatter)

HelpFormatter is argparse's ArgumentDefaultsHelpFormatter with two habits: a help text that
already names its default (say what None means: "default: every rank") is left alone, and a flag
reads "(default: off)" rather than "(default: False)". tests/test_cli.py walks every parser.

Values are checked while parsing: type=cli.positive_int, nonneg_int, at_least(n, why), positive_float, nonneg_float,
probability or comm_timeout refuses a value out of range with argparse's one line and exit status 2, before any work
(tests/test_option_validation.py gives every numeric option of every parser such values); action=cli.Distinct, a list
option that names a value twice.
output_file, output_image and output_folder refuse, the same way, a path the run could not write when it
ends. given_options tells which options a command line set, so a job can refuse one it would ignore.
run_command(main) ends a command whose reader stopped reading (`... | head`) as Unix tools end.
"""
import argparse
import math
import os
import sys
import tempfile


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless the text names its default already or the
    default is None (then the text must say what no value means)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text                             # a required positional has no default
        if action.nargs == 0 and action.default is False:
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


class RawDescriptionHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """HelpFormatter that keeps the description's own line breaks (a description with examples)."""


# ---------------------------------------------------------------- values checked while parsing
# Each is an argparse ``type=``: a value out of range stops the command at parsing, before any work, with
# argparse's one line ("usage ... error: argument --lr: must be >= 0, got -1") and exit status 2.
def _integer(text):
    try:
        return int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not value.is_integer():
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        return int(value)


def _real(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text):
    """An integer >= 1 (a count: steps, ranks, layers, ...); 1e3 is read as 1000."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def nonneg_int(text):
    """An integer >= 0 (a seed, warm-up steps, a count that may be none)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text):
    """A finite number > 0 (a timeout, a bucket size)."""
    value = _real(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def nonneg_float(text):
    """A finite number >= 0 (a learning rate: 0 trains nothing, and is honoured)."""
    value = _real(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def at_least(minimum, why):
    """An integer >= minimum, for a count whose smaller values the run cannot use (a pipeline's ranks: 2); the
    refusal says why."""
    def integer_at_least(text):
        value = _integer(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text} ({why})")
        return value
    return integer_at_least


#: the least stall threshold a job takes (--comm-timeout), in seconds
MIN_COMM_TIMEOUT = 1.0
#: the most (about 31 years): the hard timeout, 3 times it, must be a wait the platform's clock can hold (a lock's
#: timeout is a time_t deadline in nanoseconds; 3e9 s past today overflows it)
MAX_COMM_TIMEOUT = 1e9


def comm_timeout(text):
    """A job's --comm-timeout, its stall threshold: seconds from MIN_COMM_TIMEOUT to MAX_COMM_TIMEOUT. The ranks of a
    healthy job drift apart by tens or hundreds of milliseconds (one still importing at start-up, one scheduled out on
    a shared core); a shorter threshold takes such a rank for a hung one and ends the job."""
    value = _real(text)
    if not value >= MIN_COMM_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"must be >= {MIN_COMM_TIMEOUT:g} s, got {text} (a shorter stall threshold takes a rank that is merely "
            f"slower, still starting up or scheduled out, for a hung one and ends a healthy job)")
    if value > MAX_COMM_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_COMM_TIMEOUT:g} s (about 31 years), got {text} (the hard timeout, 3 times the "
            f"stall threshold, must be a wait the platform's clock can hold)")
    return value


#: the longest wait the exercises take (--timeout; about 11 days): their grader polls its child process for the
#: world's 2 x --timeout + a few seconds, in milliseconds that must fit a C int (2**31 ms, about 24.8 days)
MAX_WAIT_SECONDS = 1e6


def wait_seconds(text):
    """Seconds a wait may last (the exercises' --timeout): a finite number > 0, at most MAX_WAIT_SECONDS (a longer
    one overflows the grader's poll, which would fail the check as if the code graded had)."""
    value = positive_float(text)
    if value > MAX_WAIT_SECONDS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_WAIT_SECONDS:g} s (about 11 days), got {text} (the "
                                         f"grader waits up to twice that, in milliseconds that must fit a C int)")
    return value


def largest_mib(text):
    """The largest message of a sweep that starts at 1 KiB, in MiB: at least 1/1024."""
    value = _real(text)
    if not value >= 1 / 1024:
        raise argparse.ArgumentTypeError(f"must be at least 1/1024 MiB (the sizes start at 1 KiB), got {text}")
    return value


def probability(text):
    """A dropout probability, in [0, 1) (1 would drop everything and divide by zero)."""
    value = _real(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


class Distinct(argparse.Action):
    """action= of a list option (nargs="+" or "*") whose values are runs or measurements: each once (--ranks 2 2
    would measure p = 2 twice, the second result written over the first)."""

    def __call__(self, parser, namespace, values, option_string=None):
        repeated = [v for i, v in enumerate(values) if v in values[:i]]
        if repeated:
            raise argparse.ArgumentError(self, f"{repeated[0]} given more than once (each value runs once)")
        setattr(namespace, self.dest, values)


# ---------------------------------------------------------------- paths a command writes when it ends
# Checked while parsing too: a file the run would write at its end (--json, --trace, --plot) or a folder it
# saves into (--save-dir) must be writable before the run starts, not found wanting after it.
def _writable_folder(folder, text):
    """A folder that takes a file: probed with a temporary one, removed at once (os.access says yes to root on a
    read-only file system, /proc among them)."""
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {folder} is not a folder" if os.path.exists(folder)
                                         else f"cannot write {text}: there is no folder {folder}")
    try:
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text}: the folder {folder} takes no file "
                                         f"({e.strerror or e})") from None


def output_file(text):
    """A file written when the run ends: not a folder, in a folder that exists and is writable."""
    if os.path.isdir(text) or text.endswith(("/", os.sep)):     # "out/": a folder's name, whether or not it exists
        raise argparse.ArgumentTypeError(f"{text} is a folder: give a file name in it")
    _writable_folder(os.path.dirname(os.path.abspath(text)), text)
    if os.path.exists(text) and not os.access(text, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: the file is read-only")
    return text


def output_image(text):
    """An image written when the run ends (matplotlib's savefig): an output_file whose extension names a
    format matplotlib writes (none: PNG)."""
    output_file(text)
    extension = os.path.splitext(text)[1][1:].lower()
    if extension:
        from matplotlib.backend_bases import FigureCanvasBase
        formats = FigureCanvasBase.get_supported_filetypes()
        if extension not in formats:
            raise argparse.ArgumentTypeError(f"cannot draw {text}: matplotlib writes {', '.join(sorted(formats))}, "
                                             f"not {extension}")
    return text


def output_folder(text):
    """A folder saved into (made if missing, as os.makedirs does): a folder, or made in a writable one."""
    path = os.path.abspath(text)
    while not os.path.exists(path):               # the nearest one that exists holds the new folders
        path = os.path.dirname(path)
    _writable_folder(path, text)
    return text


def given_options(parser, argv):
    """The options ``argv`` sets explicitly (their first option string, e.g. {"--dp", "--lr"}), whatever their
    value: ``argv`` parsed again with every default suppressed (abbreviations and --opt=value included)."""
    saved = [(action, action.default) for action in parser._actions]
    for action, _ in saved:
        action.default = argparse.SUPPRESS
    try:
        seen = vars(parser.parse_args(argv))
    finally:
        for action, default in saved:
            action.default = default
    return {action.option_strings[0] for action in parser._actions
            if action.option_strings and action.dest in seen}


def refuse(parser, option, setting, reason):
    """The one line for an option this setting cannot apply: "--X is not supported with Y (reason)"."""
    parser.error(f"{option} is not supported with {setting} ({reason})")


#: the exit status of a Unix tool killed by SIGPIPE (128 + 13), as a shell reports `yes | head`'s yes
BROKEN_PIPE_STATUS = 141


def run_command(main):
    """``sys.exit(main())``, except that a reader that stopped reading (``... | head -3``) ends the command
    quietly with status 141, as it ends Unix tools, not in a BrokenPipeError traceback (Python ignores
    SIGPIPE, so the next write raises; the rest of the output has no reader)."""
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout once more at exit: pointed at /dev/null, that flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = BROKEN_PIPE_STATUS
    sys.exit(status)
