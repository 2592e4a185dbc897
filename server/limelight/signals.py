"""Signal handlers whose work runs on a thread of its own, not inside the handler.

A Python signal handler runs in the main thread between two bytecodes, wherever that thread
happens to be: inside ``threading.Event.wait`` too, holding the event's lock. A handler that
then takes the same lock (``Event.set`` does) waits for itself forever. The ``--workers``
supervisor, polling ``Event.wait(0.2)`` and stopped by a handler calling ``Event.set``, hung
this way (in CI) on a SIGTERM that landed in that window.

``on_signals`` installs a handler that only writes the signal's number to a pipe (no lock
taken); a daemon thread reads the pipe and runs the callback, where locks, logging and
``Event.set`` are safe. asyncio's ``loop.add_signal_handler`` does the same for a running loop;
this is for the processes that have none (the supervisor, ``limelight worker``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import FrameType

log = logging.getLogger(__name__)


def on_signals(
    signals: Iterable[signal.Signals], callback: Callable[[signal.Signals], None], name: str
) -> None:
    """From now on, each of ``signals`` received by this process runs ``callback(signal)`` on
    a daemon thread called ``name``, in the order received. Call from the main thread (as
    ``signal.signal`` requires)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)

    def note(signum: int, frame: FrameType | None) -> None:
        # Full only with 64 KiB of signals not yet handled: one more adds nothing.
        with contextlib.suppress(BlockingIOError):
            os.write(write_end, bytes([signum]))

    def dispatch() -> None:
        while True:
            for signum in os.read(read_end, 64):
                try:
                    callback(signal.Signals(signum))
                except Exception:  # a failed callback must not end the handling of signals
                    log.exception("handling signal %d failed", signum)

    threading.Thread(target=dispatch, name=name, daemon=True).start()
    for sig in signals:
        signal.signal(sig, note)


def exit_with_parent(parent: int) -> None:
    """Run on a daemon thread of a child process (a ``--workers`` worker, the sidecar and the
    load generator a benchmark starts): when ``parent`` is gone (killed outright, no chance to
    stop its children), stop gracefully by SIGTERM to this process."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


#: Set by a parent to its pid for the children it starts (``child_env``).
PARENT_PID_ENV = "LIMELIGHT_PARENT_PID"


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a child that calls :func:`watch_parent`: it
    names this process as the parent to watch."""
    return {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}


def watch_parent(parent: int | None = None) -> None:
    """Start :func:`exit_with_parent` for the process that started this one: the pid its
    spawner put in ``LIMELIGHT_PARENT_PID`` (``child_env``), else the parent as it is now.
    The variable matters: a parent killed while this process still imported its modules
    left it a child of init by the time it looked, and it watched init forever (a bench
    killed outright left its load generator running). A parent already gone ends this
    process at once. The variable is taken out of this process's environment so that its
    own children do not inherit a parent that is not theirs. ``parent``: given by the
    spawner another way (a multiprocessing child's arguments)."""
    named = os.environ.pop(PARENT_PID_ENV, "")
    if parent is None:
        parent = int(named) if named.isdigit() else os.getppid()
    threading.Thread(
        target=exit_with_parent, args=(parent,), name="watch-parent", daemon=True
    ).start()


def interrupt_on(signals: Iterable[signal.Signals]) -> None:
    """Make ``signals`` end this process as Ctrl-C does, by ``KeyboardInterrupt`` (what
    Python's own SIGINT handler raises; it takes no lock): for commands whose cleanup is
    their Ctrl-C path (``limelight bench`` stops the sidecar and the load it started)."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    for sig in signals:
        signal.signal(sig, interrupt)
