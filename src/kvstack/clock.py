"""Time as a dependency: whatever keeps a deadline (pin TTLs, a tier's retry pause) reads the
time through a `Clock`, so tests move a fake one forward instead of sleeping.

A clock is any callable returning seconds on a monotonic scale; the default is
`time.monotonic`. Deadlines compare against the clock they were set with, never wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]

MONOTONIC: Clock = time.monotonic
