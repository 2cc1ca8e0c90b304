"""Switch: an option that is on, or off with the reason why; what a fast engine's optional launch modes
(programmatic dependent launch, the persistent step) and lab.py's choice of the fast path hold, in place
of notes whose wording steered the code."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ASKED = "asked"  # off because the caller said so
UNSUPPORTED = "unsupported"  # off because the device or the model cannot take it: expected, said in the note
FAILED = "failed"  # off because a check that should have passed did not: worth a warning


@dataclass(frozen=True)
class Switch:
    on: bool
    why: str | None = None  # None when on
    kind: str | None = None  # off: ASKED, UNSUPPORTED or FAILED

    @classmethod
    def off(cls, why: str, kind: str = UNSUPPORTED) -> Switch:
        return cls(False, why, kind)

    def __bool__(self) -> bool:
        return self.on

    def __str__(self) -> str:  # the note a summary shows: "on", "off (asked)", "off (why)"
        return "on" if self.on else f"off ({self.why})"


ON = Switch(True)


def decide(asked: bool | None, check: Callable[[], Switch], what: str) -> Switch:
    """An option that is on where it works: asked False keeps it off, None takes it where check()
    allows, True insists (RuntimeError, saying why, where it cannot be on)."""
    if asked is False:
        return Switch.off(ASKED, ASKED)
    state = check()
    if asked and not state.on:
        raise RuntimeError(f"{what} does not work here: {state.why}")
    return state
