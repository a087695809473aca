"""`raydecode serve` stops on its signals (raydecode/commands/serve.py): `install_stop_handlers`
makes SIGINT raise KeyboardInterrupt even where the process inherited SIGINT ignored (a
background job of a non-interactive shell: CI started that way saw the served tiny example
ignore the test's SIGINT until it was killed), and `wait_for_signal` wakes to run a handler
whose signal the kernel handed to another thread (CPython runs Python handlers in the main
thread only when it executes bytecode; an untimed `threading.Event().wait()`, the old wait,
never does). Here a child process starts with SIGINT ignored and a helper thread sends SIGINT
to itself (`pthread_kill`): the main thread must raise KeyboardInterrupt within a few poll
periods; with the untimed wait it must not (the test of the test: given a timeout)."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import signal, sys, threading, time
    from raydecode.commands.serve import install_stop_handlers, wait_for_signal
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN     # inherited, as in a bg job
    install_stop_handlers()
    def poke():
        time.sleep(0.3)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)   # to this thread, not main
        time.sleep(30)                                              # and stay alive
    threading.Thread(target=poke, daemon=True).start()
    t0 = time.monotonic()
    try:
        if sys.argv[1] == "untimed":
            threading.Event().wait()
        else:
            wait_for_signal(0.1)
    except KeyboardInterrupt:
        print(f"stopped {time.monotonic() - t0:.2f}", flush=True)
        sys.exit(0)
    sys.exit(3)
""")


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run(mode: str, timeout: float) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True,
                              text=True, timeout=timeout, preexec_fn=_ignore_sigint)
    except subprocess.TimeoutExpired:
        return None


def test_a_sigint_taken_by_another_thread_stops_the_wait():
    r = _run("polled", 60)
    assert r is not None and r.returncode == 0, r
    assert r.stdout.startswith("stopped"), r.stdout
    assert float(r.stdout.split()[1]) < 2.0                    # the signal at 0.3 s, polls of 0.1


@pytest.mark.skipif(sys.platform != "linux", reason="signal delivery to a thread: Linux")
def test_the_untimed_wait_misses_it():
    """Why the wait polls: with the untimed wait the same signal never reaches the main
    thread's handler (the process is still waiting when the test gives up)."""
    assert _run("untimed", 8) is None
