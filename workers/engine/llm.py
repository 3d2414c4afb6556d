"""Offline batch API: `LLM(model_dir).generate(prompts, SamplingParams)`."""

from __future__ import annotations

from dataclasses import dataclass, fields

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    """One finished request: its output tokens, text and why it stopped."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


class LLM:
    """Runs the engine to completion over a list of prompts (strings or token-id lists)."""

    def __init__(self, model: str, **engine_options):
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise TypeError(f"unknown engine options {unknown}; known: {sorted(known - {'model'})}")
        self.engine = Engine(EngineConfig(model=model, **engine_options))
        self._counter = 0

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        per_prompt = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, per_prompt):
            request_id = f"llm-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, prompt, p)
            ids.append(request_id)
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        texts: dict[str, list[str]] = {i: [] for i in ids}
        reasons: dict[str, str] = {}
        prompt_ids = {i: list(self.engine.scheduler.sequences[i].token_ids) for i in ids}
        while self.engine.has_unfinished():
            for ev in self.engine.step():
                tokens[ev.request_id].extend(ev.token_ids)
                texts[ev.request_id].append(ev.text)
                if ev.finish_reason:
                    reasons[ev.request_id] = ev.finish_reason
        return [
            CompletionOutput(i, prompt_ids[i], tokens[i], "".join(texts[i]), reasons[i]) for i in ids
        ]
