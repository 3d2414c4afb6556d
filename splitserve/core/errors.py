"""What the core raises for a stage it refuses: typed, naming the field at fault.

Pure, like the rest of the core: no gRPC status or HTTP code here. A service maps these once
(`splitserve.wire.service_error`) to `splitserve.errors`, whose classes carry the status and
the field to the client; nobody reads a message to find the field. Both are ValueErrors, so
code that only needs to know that the input was bad (the simulator, drivers that release what
they reserved) still catches ValueError.

Configuration checked at start-up (a scheduler's limits, a policy's options) is not request
input: it raises plain ValueError, which the commands report before anything serves.
"""

from __future__ import annotations


class InvalidInput(ValueError):
    """A stage's input out of range: `param` names the request field, the message its limit."""

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


class StageKeyTaken(ValueError):
    """The engine holds a stage under this (request_id, stage_index) already: an earlier attempt
    not ended yet (a retry that overtook it), so retriable once that attempt is gone."""
