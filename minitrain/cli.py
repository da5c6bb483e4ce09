"""The help of every command line (jobs, planner, checkpoint tool, exercises, benchmarks): plain text
that says each option's default.

    p = argparse.ArgumentParser(description=..., formatter_class=cli.HelpFormatter)

HelpFormatter is argparse's ArgumentDefaultsHelpFormatter with two habits: a help text that
already names its default (say what None means: "default: every rank") is left alone, and a flag
reads "(default: off)" rather than "(default: False)". tests/test_cli.py walks every parser.
"""
import argparse


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
