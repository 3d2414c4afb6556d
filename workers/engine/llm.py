"""Offline batch API: `LLM(model_dir).generate(prompts, SamplingParams)`."""

from __future__ import annotations

from dataclasses import dataclass, fields

from splitserve.core import SamplingParams, StageKey, StageSpec
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine


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
        config = EngineConfig(model=model, **engine_options)
        from workers.diffusion.engine import DiffusionEngine, is_diffusion_model

        # A LLaDA directory gets the diffusion engine (dLLM-Serve), any other the autoregressive one.
        self.engine = DiffusionEngine(config) if is_diffusion_model(model) else Engine(config)
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
        keys = []
        prompt_ids: dict[StageKey, list[int]] = {}
        for prompt, p in zip(prompts, per_prompt):
            key = StageKey(f"llm-{self._counter}")
            self._counter += 1
            ids = self.tokenize(prompt)
            if hasattr(self.engine, "add_request"):  # the diffusion engine
                self.engine.add_request(key, ids, p or SamplingParams())
            else:
                self.engine.add_stage(StageSpec(key, tuple(ids), p or SamplingParams()))
            keys.append(key)
            prompt_ids[key] = ids
        tokens: dict[StageKey, list[int]] = {k: [] for k in keys}
        texts: dict[StageKey, list[str]] = {k: [] for k in keys}
        reasons: dict[StageKey, str] = {}
        while self.engine.has_unfinished():
            for ev in self.engine.step():
                tokens[ev.key].extend(ev.token_ids)
                texts[ev.key].append(ev.text)
                if ev.finish_reason:
                    reasons[ev.key] = ev.finish_reason
        return [CompletionOutput(k.request_id, prompt_ids[k], tokens[k], "".join(texts[k]), reasons[k]) for k in keys]

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt given as text (with the model's tokenizer) or as ids."""
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ValueError("prompt is text but the model directory has no tokenizer; pass token ids")
            return self.engine.tokenizer.encode(prompt)
        return list(prompt)
