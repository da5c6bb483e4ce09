"""Grad mode: whether operations record the graph. Thread-local, as in PyTorch, so that ranks
simulated as threads do not switch each other's mode."""
import contextlib
import threading


class _GradState(threading.local):
    enabled = True


_state = _GradState()


def is_grad_enabled():
    return _state.enabled


def set_grad_enabled(mode):
    _state.enabled = bool(mode)


class no_grad(contextlib.ContextDecorator):
    """Operations inside the block build no graph and save nothing (``with minitrain.no_grad():``)."""

    def __enter__(self):
        self._prev = _state.enabled
        _state.enabled = False

    def __exit__(self, *exc):
        _state.enabled = self._prev
        return False


class enable_grad(contextlib.ContextDecorator):
    def __enter__(self):
        self._prev = _state.enabled
        _state.enabled = True

    def __exit__(self, *exc):
        _state.enabled = self._prev
        return False


