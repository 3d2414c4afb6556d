"""What the engine-level tests share: running one stage of an `Engine` to its end."""

from __future__ import annotations


def drain(engine, key) -> tuple[list[int], str | None]:
    """Step `engine` until nothing is left; the tokens stage `key` produced and its last finish reason."""
    tokens, reason = [], None
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.key == key:
                tokens += ev.token_ids
                reason = ev.finish_reason or reason
    return tokens, reason
