"""`raydecode serve` stops on a Ctrl-C that the kernel handed to another thread
(raydecode/commands/serve.py `wait_for_signal`). A process-directed signal goes to any thread
that does not block it — in a serving process often one of Ray's or gRPC's; CPython runs the
Python handler in the main thread only when that thread executes bytecode again, which an
untimed `threading.Event().wait()` (the old wait) never did: CI once saw the served tiny
example ignore the test's SIGINT for 60 s. Here a helper thread sends SIGINT to itself
(`pthread_kill`): the main thread must raise KeyboardInterrupt within a few poll periods, and
the untimed wait must not (the test of the test: it would hang, so it is given a timeout)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import signal, sys, threading, time
    from raydecode.commands.serve import wait_for_signal
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


def _run(mode: str, timeout: float) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def test_a_sigint_taken_by_another_thread_stops_the_wait():
    r = _run("polled", 20)
    assert r is not None and r.returncode == 0, r
    assert r.stdout.startswith("stopped"), r.stdout
    assert float(r.stdout.split()[1]) < 2.0                    # the signal at 0.3 s, polls of 0.1


@pytest.mark.skipif(sys.platform != "linux", reason="signal delivery to a thread: Linux")
def test_the_untimed_wait_misses_it():
    """Why the wait polls: with the untimed wait the same signal never reaches the main
    thread's handler (the process is still waiting when the test gives up)."""
    assert _run("untimed", 4) is None
