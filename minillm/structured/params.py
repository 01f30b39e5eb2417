"""StructuredOutputsParams: which language the output must belong to (vLLM's names), checked on construction."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from minillm.structured import json_schema
from minillm.structured.regex import escape

# Between JSON tokens (after `{`, `[`, `:` and `,`, before `}` and `]`) the default allows at most one space:
# it admits both `{"a": 1, "b": 2}` and `{"a":1,"b":2}` while keeping the automaton small and the model from
# padding the output with whitespace forever. StructuredOutputsParams(whitespace_pattern=...) replaces it.
DEFAULT_WHITESPACE = r"[ ]?"


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None        # a JSON Schema (dict, or its JSON text)
    regex: str | None = None              # the whole output must match (re.fullmatch semantics)
    choice: list[str] | None = None       # the output is exactly one of these strings
    json_object: bool | None = None       # any JSON object
    whitespace_pattern: str | None = None  # JSON modes: the regex allowed between tokens (default DEFAULT_WHITESPACE)
    grammar: str | None = None            # vLLM's EBNF grammars: not supported (a clear error says so)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"invalid StructuredOutputsParams: {msg}")

        if self.grammar is not None:
            bad("grammar (EBNF) is not supported by minillm: express the language as a regex, a JSON Schema or a "
                "choice")
        given = [f.name for f in fields(self) if f.name in ("json", "regex", "choice", "json_object")
                 and getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            bad(f"give exactly one of json, regex, choice, json_object (got {given or 'none'})")
        if self.json is not None and not isinstance(self.json, (dict, str, bool)):
            bad(f"json must be a JSON Schema as a dict or a JSON string, got {type(self.json).__name__}")
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                bad(f"regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or any(not isinstance(c, str) or not c for c in self.choice):
                bad(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            bad(f"json_object must be True (or None), got {self.json_object!r}")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str):
                bad(f"whitespace_pattern must be a regex string, got {self.whitespace_pattern!r}")
            if self.regex is not None or self.choice is not None:
                bad("whitespace_pattern applies to json and json_object only")

    @property
    def whitespace(self) -> str:
        return DEFAULT_WHITESPACE if self.whitespace_pattern is None else self.whitespace_pattern

    def to_regex(self) -> str:
        """The one regex the output must fully match (JSON Schemas and choices are compiled to one)."""
        if self.regex is not None:
            return self.regex
        if self.choice is not None:
            return "|".join(escape(c) for c in self.choice)
        if self.json_object:
            return json_schema.json_object_regex(self.whitespace)
        schema: Any = self.json
        if isinstance(schema, str):
            import json
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"invalid StructuredOutputsParams: json is not valid JSON ({e}); pass the schema "
                                 "as a dict or as JSON text") from None
        return json_schema.schema_to_regex(schema, self.whitespace)

    def describe(self) -> str:
        for name in ("regex", "choice", "json", "json_object"):
            v = getattr(self, name)
            if v not in (None, False):
                return f"{name}={v!r:.80}"
        return "?"
