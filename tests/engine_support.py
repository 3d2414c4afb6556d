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


def single_thread_generate(model_dir, prompts, params):
    """`LLM(model_dir).generate(prompts, params)` on one torch thread, the process's thread count
    restored after. For references computed while other processes are busy: on a 2-core machine
    two threads beside one busy process took 30x longer (a parallel region waits for its
    descheduled thread)."""
    import torch

    from workers.engine import LLM

    threads = torch.get_num_threads()
    try:
        return LLM(str(model_dir), num_threads=1).generate(prompts, params)
    finally:
        torch.set_num_threads(threads)
