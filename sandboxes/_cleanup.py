"""Last-resort cleanup of what sandboxes leave on the host: the functions registered here run at
interpreter exit, and on SIGINT/SIGTERM when the signal's action would end the process at once
(the default action: they run, then the signal ends the process). Where a Python handler takes
the signal (Ctrl-C's ``KeyboardInterrupt``, the ``agentrl`` command's clean stop), it runs
instead, the program unwinds through every sandbox's ``close()``, and the hooks run at exit.
Nothing survives ``kill -9``: ``agentrl sandbox gc`` is for that."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
from collections.abc import Callable

_lock = threading.RLock()  # re-entrant: run_hooks may run in a signal handler
_hooks: list[Callable[[], None]] = []
_installed = False


def on_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` (once registered, idempotent to call again) at exit and on SIGINT/SIGTERM."""
    global _installed
    with _lock:
        if hook not in _hooks:
            _hooks.append(hook)
        if _installed:
            return
        _installed = True
    atexit.register(run_hooks)
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:  # a background job's SIGINT: leave it ignored
                continue
            signal.signal(signum, lambda s, f, p=previous: _on_signal(s, f, p))


def run_hooks() -> None:
    with _lock:
        hooks = list(_hooks)
    for hook in hooks:
        with contextlib.suppress(Exception):
            hook()


def _on_signal(signum, frame, previous) -> None:
    if callable(previous):
        # A Python handler (KeyboardInterrupt, the agentrl command's own) unwinds the program: every
        # sandbox's close() runs on the way out, and the hooks at exit for what is left; running them
        # here would pull workspaces and containers from under episodes that are closing anyway.
        previous(signum, frame)
        return
    # The default action ends the process at once: clean up first, with these signals held back so
    # that a second one cannot cut the hooks short.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        run_hooks()
    finally:
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    os.kill(os.getpid(), signum)
