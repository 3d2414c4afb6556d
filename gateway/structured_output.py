"""Structured output's request fields, checked and turned into one `StructuredOutput`.

Three ways to ask, as vLLM takes them (at most one per request):

- OpenAI's `response_format`: {"type": "text"} (free output), {"type": "json_object"} (JSON
  mode: any JSON object) or {"type": "json_schema", "json_schema": {"name": ..., "schema":
  {...}, "strict": ...}};
- vLLM's `structured_outputs`: {"json": schema} | {"regex": str} | {"choice": [str, ...]} |
  {"grammar": EBNF} | {"json_object": true}, with `disable_any_whitespace`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (and
  `guided_decoding_backend`, which may only name xgrammar).

Pure: the shape and size checks only. The gateway never imports the grammar engine (it needs
torch); whether a schema, regex or grammar compiles is the worker's answer, an INVALID_ARGUMENT
naming the same field. Every error here names the field, and the limit it broke.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from splitserve.core.errors import InvalidInput
from splitserve.core.structured import (CHOICE, GRAMMAR, JSON, JSON_OBJECT, MAX_STRUCTURED_BYTES, REGEX,
                                        StructuredOutput)
from splitserve.errors import InvalidArgument

MAX_SCHEMA_DEPTH = 128  # nesting of a JSON schema's objects and arrays
GUIDED_FIELDS = {"guided_json": JSON, "guided_regex": REGEX, "guided_choice": CHOICE, "guided_grammar": GRAMMAR}
STRUCTURED_OUTPUTS_KINDS = {"json": JSON, "regex": REGEX, "choice": CHOICE, "grammar": GRAMMAR,
                            "json_object": JSON_OBJECT}
# structured_outputs' options that change nothing here: xgrammar has no fallback backend, and
# its JSON schemas already refuse properties the schema does not name (vLLM's xgrammar backend
# ignores both the same way).
STRUCTURED_OUTPUTS_NOOPS = ("disable_fallback", "disable_additional_properties")
BACKENDS = (None, "auto", "xgrammar")
# The body fields this module reads (validation's NOT_IMPLEMENTED no longer refuses them).
FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS, "guided_decoding_backend")


def structured_output(fields: Mapping[str, Any]) -> StructuredOutput | None:
    """The request's constraint from its body `fields` (absent ones: None), or None for free output."""
    found: list[StructuredOutput] = []
    response_format = fields.get("response_format")
    if response_format is not None:
        constraint = _response_format(response_format)
        if constraint is not None:
            found.append(constraint)
    if fields.get("structured_outputs") is not None:
        found.append(_structured_outputs(fields["structured_outputs"]))
    for name, kind in GUIDED_FIELDS.items():
        if fields.get(name) is not None:
            found.append(_of_kind(kind, fields[name], name))
    backend = fields.get("guided_decoding_backend")
    if backend not in BACKENDS:
        raise InvalidArgument(f"guided_decoding_backend: only xgrammar is available (or auto), got {backend!r}",
                              param="guided_decoding_backend")
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise InvalidArgument(f"{found[1].param}: only one structured output constraint per request, got {names}",
                              param=found[1].param)
    return checked(found[0]) if found else None


def checked(constraint: StructuredOutput) -> StructuredOutput:
    """`constraint` when its shape and size are ones a worker compiles; else InvalidArgument naming its field."""
    try:
        constraint.validate()
    except InvalidInput as err:
        raise InvalidArgument(err.message, param=err.param) from None
    return constraint


def _response_format(value: Any) -> StructuredOutput | None:
    param = "response_format"
    if not isinstance(value, dict):
        raise InvalidArgument(f"{param} must be an object such as {{\"type\": \"json_object\"}}", param=param)
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(JSON_OBJECT, param=param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidArgument(f"{param}.json_schema must be an object with name and schema", param=param)
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{param}.json_schema.name must be a non-empty string", param=param)
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidArgument(f"{param}.json_schema.strict must be a boolean, got {strict!r}", param=param)
        # vLLM's JsonSchemaResponseFormat takes the schema as `schema` (alias of its json_schema field).
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise InvalidArgument(f"{param}.json_schema.schema is required (the JSON Schema the output must follow)",
                                  param=param)
        return StructuredOutput(JSON, schema_text(schema, f"{param}.json_schema.schema", param), param=param)
    if kind == "structural_tag":
        raise InvalidArgument(f"{param}: type 'structural_tag' is not supported by this server", param=param)
    raise InvalidArgument(f"{param}.type must be one of text, json_object, json_schema, got {kind!r}", param=param)


def _structured_outputs(value: Any) -> StructuredOutput:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidArgument(f"{param} must be an object such as {{\"json\": {{...}}}} or {{\"choice\": [...]}}",
                              param=param)
    asked = [key for key in STRUCTURED_OUTPUTS_KINDS if value.get(key) not in (None, False)]
    for key, option in value.items():
        if key in STRUCTURED_OUTPUTS_KINDS or option is None:
            continue
        if key == "disable_any_whitespace" or key in STRUCTURED_OUTPUTS_NOOPS:
            if not isinstance(option, bool):
                raise InvalidArgument(f"{param}.{key} must be a boolean, got {option!r}", param=param)
            continue
        if key == "structural_tag":
            raise InvalidArgument(f"{param}.structural_tag is not supported by this server", param=param)
        if key == "whitespace_pattern":
            raise InvalidArgument(f"{param}.whitespace_pattern is not supported by this server (xgrammar)",
                                  param=param)
        raise InvalidArgument(f"{param}: unknown option {key!r} (known: {', '.join(STRUCTURED_OUTPUTS_KINDS)}, "
                              "disable_any_whitespace)", param=param)
    if len(asked) != 1:
        raise InvalidArgument(f"{param} must set exactly one of {', '.join(STRUCTURED_OUTPUTS_KINDS)}, got "
                              f"{', '.join(asked) or 'none'}", param=param)
    key = asked[0]
    compact = bool(value.get("disable_any_whitespace"))
    if key == "json_object":
        if value[key] is not True:
            raise InvalidArgument(f"{param}.json_object must be true, got {value[key]!r}", param=param)
        return StructuredOutput(JSON_OBJECT, any_whitespace=not compact, param=param)
    constraint = _of_kind(STRUCTURED_OUTPUTS_KINDS[key], value[key], param, f"{param}.{key}")
    return StructuredOutput(constraint.kind, constraint.spec, constraint.choices, not compact, param)


def _of_kind(kind: str, value: Any, param: str, path: str | None = None) -> StructuredOutput:
    path = path or param
    if kind == JSON:
        return StructuredOutput(JSON, schema_text(value, path, param), param=param)
    if kind == CHOICE:
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidArgument(f"{path} must be a list of strings", param=param)
        if not value:
            raise InvalidArgument(f"{path} is empty: give at least one choice", param=param)
        return StructuredOutput(CHOICE, choices=tuple(value), param=param)
    if not isinstance(value, str) or not value:
        what = "regular expression" if kind == REGEX else "grammar (EBNF)"
        raise InvalidArgument(f"{path} must be a non-empty string (a {what})", param=param)
    return StructuredOutput(kind, value, param=param)


def schema_text(schema: Any, path: str, param: str) -> str:
    """The JSON Schema as compact JSON text (key order kept: it is the output's order)."""
    if isinstance(schema, str):
        if len(schema.encode()) > MAX_STRUCTURED_BYTES:
            raise InvalidArgument(f"{path} is {len(schema.encode())} bytes; at most {MAX_STRUCTURED_BYTES} are "
                                  "accepted", param=param)
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as err:
            raise InvalidArgument(f"{path} is not valid JSON: {err}", param=param) from None
    if not isinstance(schema, dict):
        raise InvalidArgument(f"{path} must be a JSON Schema object, got {type(schema).__name__}", param=param)
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidArgument(f"{path} nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are accepted",
                              param=param)
    if "type" in schema and not isinstance(schema["type"], (str, list)):
        raise InvalidArgument(f"{path}.type must be a string or a list of strings, got {schema['type']!r}",
                              param=param)
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _depth(value: Any) -> int:
    """Nesting depth of dicts and lists, without recursion (a deep value must not exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            items = item.values()
        elif isinstance(item, list):
            items = item
        else:
            continue
        deepest = max(deepest, level)
        if level <= MAX_SCHEMA_DEPTH:  # deeper than the limit is refused whatever lies below
            stack.extend((child, level + 1) for child in items)
    return deepest
