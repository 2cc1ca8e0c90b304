"""What a generation returns: shared by the eager loop (gpt2/generate.py) and the fast path
(gpt2/fast), so that neither imports the other to build one."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Generation:
    tokens: list[int]  # the new tokens, the end-of-text one included when generation stopped at it
    stopped_at_eos: bool = False
    logits: list = field(default_factory=list)  # each step's last-position logits (vocab,), if recorded
