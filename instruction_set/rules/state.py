"""Buffer updates: `copy_(buffer, new)` writes the new value of a buffer the forward mutates
(planner.lower turns functionalization's BUFFER_MUTATION outputs into these nodes).

Every rank stores buffers whole (R), so the new value is needed R: a statistic computed from
a batch-split tensor arrives as P and the planner all-reduces it, like any collective. The
runtime writes the value into the rank's buffer after the backward pass.
"""

from __future__ import annotations

from hetsynth.instruction_set.rules.registry import register, replicated

BUFFER_UPDATE = "aten.copy_.default"

register([BUFFER_UPDATE], replicated)
