"""Per-request sampling parameters and their validation."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from splitserve.core.errors import InvalidInput
from splitserve.core.structured import StructuredOutput


_MASK64 = (1 << 64) - 1

# Temperatures below this sample greedily: one so small is argmax in effect, and near float32's
# smallest numbers the logits / temperature overflow to inf and the softmax to NaN (vLLM's
# samplers use the same 1e-5 threshold).
GREEDY_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's and vLLM's range)
MAX_LOGPROBS = 20  # top logprobs per token: vLLM's default max_logprobs (and OpenAI's top_logprobs limit)


def mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): a well-spread 63-bit number (the sampler's per-token
    generator seed; the emulated engines' token ids)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def request_seed(request_id: str) -> int:
    """The sampling seed of a request that brings none, in [0, 2^63): fixed once per request
    (by the coordinator) so that every worker a split, disaggregated or migrated request runs
    on samples the same tokens; derived from the request id, so a record tells it."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") >> 1


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log probabilities under the model's raw distribution: its own and
    the `top` most likely tokens' (id, logprob), most likely first (vLLM's sample logprobs)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class SamplingParams:
    """How to sample one request's output; `seed=None` lets the engine draw one."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Diffusion models only (dLLM-Serve / LLaDA): denoising steps over max_tokens (default:
    # one per token), block length (default: 32 when it divides max_tokens, else max_tokens),
    # remasking strategy, KV retention ratio (1: dense), classifier-free guidance (0: none).
    steps: int | None = None
    block_length: int | None = None
    remasking: str = "low_confidence"
    retention_ratio: float = 1.0
    cfg_scale: float = 0.0
    # vLLM's penalties and filters (workers.engine.sampler applies them, in vLLM's order).
    # Penalties see the request's whole history, so every stage of a split request applies
    # them alike: repetition over prompt and output, presence/frequency over the output only.
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from each token the output holds
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0: divides a seen token's positive logit, multiplies a negative one
    min_p: float = 0.0  # in [0, 1]: keeps tokens whose probability is >= min_p x the top token's
    min_tokens: int = 0  # EOS and stop_token_ids are masked until the output holds this many tokens
    # None: no logprobs; N in [0, MAX_LOGPROBS]: each output token's logprob and the top N's, of
    # the raw distribution (before penalties, temperature and filters, as vLLM's raw_logprobs).
    logprobs: int | None = None
    # None: no prompt logprobs; N in [0, MAX_LOGPROBS]: each prompt token's logprob (from the
    # position before it) and the top N's there (vLLM's prompt_logprobs). Such a stage computes
    # every prompt position it covers: no prefix-cache hits (BlockManager.cached_prefix_blocks).
    prompt_logprobs: int | None = None
    # None: free output; else what the output must match (a JSON schema, regex, choice or
    # grammar: splitserve.core.structured). Every stage of the request masks its logits with it
    # from the output so far, so a split request samples what an unsplit one does.
    structured_output: StructuredOutput | None = None

    @property
    def penalised(self) -> bool:
        """Whether any of the presence, frequency or repetition penalties changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0, or one so small that it is argmax in effect."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidInput (a ValueError) naming the offending field and its limit."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidInput(f"max_tokens must be an integer > 0, got {self.max_tokens!r}", param="max_tokens")
        if self.temperature < 0:
            raise InvalidInput(f"temperature must be >= 0, got {self.temperature}", param="temperature")
        if self.top_k < 0:
            raise InvalidInput(f"top_k must be >= 0 (0 disables it), got {self.top_k}", param="top_k")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidInput(f"seed must be in [0, 2**63), got {self.seed}", param="seed")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise InvalidInput("stop strings must be non-empty", param="stop")
        # vLLM's SamplingParams ranges (NaN fails every comparison, so it is refused too).
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidInput(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}", param=name)
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise InvalidInput(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}",
                               param="repetition_penalty")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidInput(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidInput(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got "
                               f"{self.min_tokens!r}", param="min_tokens")
        if self.logprobs is not None and not (isinstance(self.logprobs, int)
                                              and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidInput(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (top tokens per output token), "
                               f"got {self.logprobs!r}", param="logprobs")
        if self.prompt_logprobs is not None and not (isinstance(self.prompt_logprobs, int)
                                                     and 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise InvalidInput(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] (top tokens per prompt "
                               f"token), got {self.prompt_logprobs!r}", param="prompt_logprobs")
        if self.structured_output is not None:
            self.structured_output.validate()
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidInput(f"stop_token_ids must be in [0, {vocab_size}), got {bad}", param="stop_token_ids")
