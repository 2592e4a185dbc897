"""``limelight.signals.on_signals``: a handler's work runs on a thread, so it may take locks the
interrupted main thread holds."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import limelight

STORM = textwrap.dedent(
    """
    import os, signal, subprocess, threading
    from limelight.signals import on_signals

    stop = threading.Event()
    handled = []

    def on_usr1(sig):
        handled.append(sig)
        if len(handled) == 1:
            raise RuntimeError("a failing callback")  # logged; later signals still handled
        stop.set()  # takes the lock the main thread holds inside stop.wait below
        stop.clear()

    on_signals([signal.SIGUSR1], on_usr1, "signals")
    storm = f"for i in $(seq 20000); do kill -USR1 {os.getpid()} || exit; done"
    sender = subprocess.Popen(["bash", "-c", storm])
    while sender.poll() is None:
        stop.wait(0.0001)  # the main thread holds the event's lock most of the time
    os.kill(os.getpid(), signal.SIGUSR1)
    while len(handled) < 2 or stop.is_set():
        stop.wait(0.01)
    assert sender.returncode == 0, sender.returncode
    assert set(handled) == {signal.SIGUSR1}
    print("handled", len(handled))
    """
)


def test_a_storm_of_signals_landing_inside_event_wait_is_handled() -> None:
    """A handler calling ``Event.set`` directly deadlocked this loop in most runs within a
    second (the handler waits for the lock its own thread holds); through ``on_signals`` every
    signal is handled and the process ends. The timeout only stops a hung child."""
    done = subprocess.run(
        [sys.executable, "-c", STORM], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("handled "), done.stdout
    assert "handling signal 10 failed" in done.stderr  # the failing callback was logged
    assert "RuntimeError: a failing callback" in done.stderr


def test_the_server_installs_signal_handlers_only_through_on_signals() -> None:
    """``signal.signal`` with a handler that does real work is the deadlock above waiting to
    happen. Allowed: ``limelight/signals.py`` itself, and ``cli/serve.py``'s early SIGHUP note,
    which only sets a bool."""
    root = Path(limelight.__file__).parent
    allowed = {root / "signals.py", root / "cli" / "serve.py"}
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "signal"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "signal"
                and path not in allowed
            ):
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offenders, f"use limelight.signals.on_signals instead: {offenders}"


def test_a_child_whose_parent_died_before_it_looked_still_ends() -> None:
    """A child watches the parent its spawner named (``child_env``), not its parent at the
    time it looks: a bench killed while its load generator still imported its modules left
    the generator a child of init by then, and it watched init forever."""
    import os

    from tests.waiting import wait_until

    grandchild = textwrap.dedent(
        """
        import time
        time.sleep(1.5)  # its parent is gone by now: it exits right after spawning us
        from limelight.signals import watch_parent
        watch_parent()
        time.sleep(600)
        """
    )
    middle = textwrap.dedent(
        f"""
        import subprocess, sys
        from limelight.signals import child_env
        child = subprocess.Popen([sys.executable, "-c", {grandchild!r}], env=child_env())
        print(child.pid, flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", middle], capture_output=True, text=True, timeout=120, check=True
    )
    pid = int(done.stdout.strip())

    def ended() -> bool:  # gone, or a zombie where init does not reap
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        return "\nState:\tZ" in status

    try:
        wait_until(ended, timeout=120)  # generous: a hang, not a duration, fails here
    finally:
        if not ended():
            os.kill(pid, 9)
