"""Structured output (guided decoding): what a request's output must match, as plain data.

A request asks for one of: a JSON Schema (`json`), any JSON object (`json_object`), a regular
expression (`regex`), one of a list of strings (`choice`) or an EBNF grammar (`grammar`,
xgrammar's dialect, as vLLM's xgrammar backend takes it). The gateway turns OpenAI's
`response_format`, vLLM's `structured_outputs` and its older `guided_*` fields into one
`StructuredOutput`; it travels in SamplingParams to every stage of the request, and the worker
(workers.engine.structured) compiles it for its tokenizer and masks the logits with it.

Pure: the checks here are the shape and size ones that need no grammar engine, shared by the
gateway (which must not import torch, hence not xgrammar) and the worker. Whether a schema,
regex or grammar compiles is the worker's answer (INVALID_ARGUMENT naming `param`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.core.errors import InvalidInput

JSON, JSON_OBJECT, REGEX, CHOICE, GRAMMAR = "json", "json_object", "regex", "choice", "grammar"
KINDS = (JSON, JSON_OBJECT, REGEX, CHOICE, GRAMMAR)
# What one request may ask the worker to compile: the schema, regex or grammar text, or the
# choices together (each compiled grammar is cached per worker, so its size is bounded).
MAX_STRUCTURED_BYTES = 64 * 1024
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutput:
    """One request's output constraint.

    `spec`: the JSON Schema as JSON text (json), the regex (regex) or the EBNF grammar
    (grammar); empty for json_object and choice, whose strings are `choices`. `any_whitespace`
    (json kinds): whether JSON may hold any whitespace between its tokens (vLLM's default)
    rather than the compact separators only (vLLM's disable_any_whitespace). `param` is the
    request field it came from, which an error names; it is not part of what is compiled."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    any_whitespace: bool = True
    param: str = field(default="response_format", compare=False)

    @property
    def cache_key(self) -> tuple:
        """What the compiled grammar depends on (a worker caches compiled grammars by it)."""
        return self.kind, self.spec, self.choices, self.any_whitespace

    @property
    def size_bytes(self) -> int:
        return len(self.spec.encode()) + sum(len(c.encode()) for c in self.choices)

    def validate(self) -> None:
        """Raise InvalidInput naming `param` for a shape or size a worker would not compile."""
        param = self.param
        if self.kind not in KINDS:
            raise InvalidInput(f"{param}: unknown structured output kind {self.kind!r} (one of {', '.join(KINDS)})",
                               param=param)
        if self.kind in (JSON, REGEX, GRAMMAR) and not self.spec:
            what = {JSON: "the JSON schema", REGEX: "the regex", GRAMMAR: "the grammar"}[self.kind]
            raise InvalidInput(f"{param}: {what} is empty", param=param)
        if self.kind in (JSON_OBJECT, CHOICE) and self.spec:
            raise InvalidInput(f"{param}: {self.kind} takes no schema, regex or grammar", param=param)
        if self.kind == CHOICE:
            if not self.choices:
                raise InvalidInput(f"{param}: the choice list is empty; give at least one string", param=param)
            if len(self.choices) > MAX_CHOICES:
                raise InvalidInput(f"{param}: at most {MAX_CHOICES} choices, got {len(self.choices)}", param=param)
            if any(not isinstance(c, str) or not c for c in self.choices):
                raise InvalidInput(f"{param}: every choice must be a non-empty string", param=param)
        elif self.choices:
            raise InvalidInput(f"{param}: only a choice constraint takes choices", param=param)
        if self.size_bytes > MAX_STRUCTURED_BYTES:
            raise InvalidInput(f"{param}: the constraint is {self.size_bytes} bytes; at most {MAX_STRUCTURED_BYTES} "
                               "(UTF-8) are accepted", param=param)


def choice_grammar(choices: tuple[str, ...] | list[str]) -> str:
    """An EBNF grammar (xgrammar's) whose language is exactly `choices`: one string literal
    each, with backslash, quote and control characters escaped (what vLLM's
    `choice_as_grammar` builds, made safe for newlines and tabs too)."""
    return "root ::= " + " | ".join(f'"{_ebnf_escape(c)}"' for c in choices)


_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _ebnf_escape(text: str) -> str:
    out = []
    for ch in text:
        if ch in _EBNF_ESCAPES:
            out.append(_EBNF_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)
