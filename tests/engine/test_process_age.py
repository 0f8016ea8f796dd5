"""The start-up timeline's clock (rlserve.engine.wire.process.process_age_s): seconds since the process started,
the interpreter's start and imports included, which a clock read inside the program cannot see."""

from __future__ import annotations

import subprocess
import sys
import time

from rlserve.engine.wire.process import process_age_s


def test_a_process_age_counts_from_the_process_start() -> None:
    script = (
        "import time; time.sleep(0.5); from rlserve.engine.wire.process import process_age_s; print(process_age_s())"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    wall = time.monotonic() - started
    age = float(done.stdout)
    assert 0.5 <= age <= wall + 0.02, (age, wall)  # the sleep, and no more than the child lived (10 ms ticks)


def test_this_process_is_older_than_a_moment_ago() -> None:
    before = process_age_s()
    time.sleep(0.05)
    assert process_age_s() >= before + 0.03
