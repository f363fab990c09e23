"""How much of the machine's CPU time the hypervisor gave to other guests while a benchmark ran.

On a shared virtual machine a vCPU is sometimes not running at all: Linux counts that time as
*steal* (the eighth field of /proc/stat's `cpu` line). A run measured while a neighbour took a
third of the CPU reads a third slower in every configuration it timed then, and a two-thread run
can read no faster than one thread when the other vCPU is the one taken. Ratios measured side by
side in one run still compare, but absolute figures from such a run do not: every benchmark
records the share of its machine's CPU time stolen while it ran (`machine.steal` in its JSON,
on its results page beside the machine) and says so when it is large.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

# From this share of stolen CPU time on, a benchmark says that its absolute figures were disturbed.
NOTICEABLE_STEAL = 0.02


def cpu_ticks(stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(stolen, total) CPU ticks of all CPUs since boot from /proc/stat (total: user, nice, system,
    idle, iowait, irq, softirq and steal); None where the file or its steal field is missing."""
    try:
        with open(stat) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]
    return ticks[7], sum(ticks)


class StealMeter:
    """Started when made; `share()` is the part of all CPU time stolen since then (None where the
    kernel does not count steal, or no tick has passed)."""

    def __init__(self, read: Callable[[], tuple[int, int] | None] = cpu_ticks) -> None:
        self._read = read
        self._start = read()

    def share(self) -> float | None:
        now = self._read()
        if self._start is None or now is None or now[1] <= self._start[1]:
            return None
        return (now[0] - self._start[0]) / (now[1] - self._start[1])


def steal_notice(share: float | None) -> str | None:
    """The line a benchmark prints when the run lost a noticeable share of its CPU time, else None."""
    if share is None or share < NOTICEABLE_STEAL:
        return None
    return (f"the hypervisor took {share:.0%} of this machine's CPU time during the run (steal): its absolute "
            "figures read low; the ratios between configurations measured side by side still compare")
