"""How long to check for a message without sleeping before sleeping for it.

A thread asleep in ``poll()`` or ``epoll_wait()`` is woken by the kernel from
another core, which on a virtual machine is most of a round trip's time. The
client checks for its reply, and the daemon's event loop for the next
request, without sleeping for a while first (docs/daemon.md, "Polling for
the reply"); :class:`Spin` says how long.
"""

from __future__ import annotations

import dedupcore._core as _core

__all__ = ["MAX_SPIN", "SPIN_UP_TO", "Spin", "check_spin"]

#: The longest the adaptive :class:`Spin` checks, in seconds, and the typical wait
#: above which it does not check at all.
SPIN_UP_TO = 250e-6
#: The longest a fixed spin may be, in seconds: past that checking is a busy wait
#: (``_core.exchange`` refuses more).
MAX_SPIN: float = _core.MAX_SPIN
#: The weight of the newest wait in the typical one (an exponential average).
_WEIGHT = 0.125


def check_spin(value: object, name: str = "spin") -> float | None:
    """``value`` as a spin: None (adaptive) or 0 to MAX_SPIN seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds or None, not {type(value).__name__}")
    if not 0 <= value <= MAX_SPIN:
        raise ValueError(f"{name} must be 0 to {MAX_SPIN} seconds, got {value!r}")
    return float(value)


class Spin:
    """How long the next wait checks without sleeping: ``fixed`` seconds, or with
    ``fixed`` None twice the typical wait (an exponential average of the waits
    counted with :meth:`took`), at most SPIN_UP_TO, and not at all while the
    typical wait is longer than that: the checking takes a core for as long as
    it lasts, which pays only when the message usually comes within it."""

    __slots__ = ("fixed", "typical")

    def __init__(self, fixed: float | None = None) -> None:
        self.fixed = fixed
        self.typical = 0.0  # seconds; 0 before the first wait

    def budget(self) -> float:
        """Seconds the next wait checks without sleeping (0: it sleeps at once)."""
        if self.fixed is not None:
            return self.fixed
        if self.typical > SPIN_UP_TO:
            return 0.0
        return min(SPIN_UP_TO, 2 * self.typical) if self.typical else SPIN_UP_TO

    def took(self, seconds: float) -> None:
        """Counts a wait into the typical one."""
        if self.typical:
            self.typical += _WEIGHT * (seconds - self.typical)
        else:
            self.typical = seconds
