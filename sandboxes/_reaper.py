"""Run a command and kill everything it leaves behind: ``python -I -S _reaper.py ARGV...``.

For the local sandbox without bubblewrap and without root, where no PID namespace, cgroup or
user of its own holds the command's processes. This process makes itself a child subreaper
(``PR_SET_CHILD_SUBREAPER``): a descendant whose parent dies is re-parented here, not to init,
whatever session, process group or environment it moved to. When the command exits, or when this
process gets SIGTERM (the sandbox's timeout), every descendant is killed, stopped first so that
none can fork meanwhile. It exits with the command's status (143 when terminated).

What it cannot hold: a command that kills this process first (same user) lets its orphans go to
init. The bubblewrap and root modes of the sandbox have no such gap.
"""

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36


def descendants(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(name))
    found, todo = [], list(parents.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(parents.get(pid, []))
    return found


def reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_all() -> None:
    """Stop every descendant (a stopped process cannot fork), kill them, and look again until none
    is left: a killed process's children are re-parented here a moment after it dies."""
    for _ in range(100):
        pids = descendants(os.getpid())
        if not pids:
            return
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        reap_zombies()


class Terminated(Exception):
    pass


def terminate(*_) -> None:
    raise Terminated  # out of the blocking waitpid below (a handler that returns would resume it)


def main(argv: list[str]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("agentrl reaper: prctl(PR_SET_CHILD_SUBREAPER) failed", file=sys.stderr)
        return 126
    signal.signal(signal.SIGTERM, terminate)
    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    try:
        _, status = os.waitpid(child, 0)
        code = os.waitstatus_to_exitcode(status)
    except Terminated:
        code = 143
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kill_all()
    return code


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.exit(128 - code if code < 0 else code)  # killed by signal N: the shell's 128 + N
