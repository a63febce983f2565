"""Last-resort cleanup of what sandboxes leave on the host: the functions registered here run at
interpreter exit and on SIGINT/SIGTERM of the process (then the previous handler runs, so Ctrl-C
still raises ``KeyboardInterrupt`` and SIGTERM still ends the process). ``close()`` remains the
normal path; this covers a process stopped before it got there. Nothing survives ``kill -9``:
``agentrl sandbox gc`` is for that."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
from collections.abc import Callable

_lock = threading.Lock()
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
    run_hooks()
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
