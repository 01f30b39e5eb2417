"""JSON Schema -> one regex of minillm's subset, whose every full match is JSON that validates against the schema.

The regex describes the JSON *text*: strings with JSON escapes, numbers in JSON's grammar, objects with their
properties in schema order (optional ones may be left out, no others appear: additionalProperties other than
false next to properties is refused), arrays with their length bounds.
Whitespace between tokens is one regex (`whitespace`, default "[ ]?": at most one space). A regex cannot nest
without bound, so the free-form parts ({} / true, "type": "object" without properties, json_object mode) allow
values nested MAX_FREE_DEPTH deep. Keywords that constrain values in ways we do not compile (minimum,
multipleOf, uniqueItems, ...) raise an error naming them rather than being ignored: an output that does not
validate would be silently wrong.
"""
from __future__ import annotations

import json
from typing import Any

from minillm.structured.regex import escape

MAX_FREE_DEPTH = 2

STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
INTEGER = r"-?(?:0|[1-9]\d*)"
NUMBER = INTEGER + r"(?:\.\d+)?(?:[eE][+-]?\d+)?"
_DAY31, _DAY30 = r"(?:0[1-9]|[12]\d|3[01])", r"(?:0[1-9]|[12]\d|30)"
# every date these spell exists (years 0001-9999; February stops at 28: a leap day needs arithmetic on the year)
YEAR = r"(?:\d{3}[1-9]|\d\d[1-9]\d|\d[1-9]\d\d|[1-9]\d{3})"
DATE = (YEAR + r"-(?:(?:0[13578]|1[02])-" + _DAY31 + r"|(?:0[469]|11)-" + _DAY30 + r"|02-(?:0[1-9]|1\d|2[0-8]))")
TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,6})?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
FORMATS = {
    "date": DATE,
    "time": TIME,
    "date-time": DATE + "T" + TIME,
    "email": r"[a-zA-Z0-9_+-]+(?:\.[a-zA-Z0-9_+-]+)*@[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)*\.[a-zA-Z]{2,}",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": r"(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
}

ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
               "readOnly", "writeOnly"}
KNOWN = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": set(), "number": set(), "boolean": set(), "null": set(),
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
}
COMBINATORS = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions"}


class SchemaError(ValueError):
    pass


def json_object_regex(whitespace: str = "[ ]?") -> str:
    """Any JSON object (values nested up to MAX_FREE_DEPTH deep)."""
    return _Compiler({}, whitespace)._free_object(MAX_FREE_DEPTH)


def schema_to_regex(schema: Any, whitespace: str = "[ ]?") -> str:
    if not isinstance(schema, (dict, bool)):
        raise SchemaError(f"a JSON Schema is an object (or true/false), got {type(schema).__name__}")
    return _Compiler(schema, whitespace).value(schema, "#")


class _Compiler:
    def __init__(self, root: Any, whitespace: str) -> None:
        self.root, self.ws = root, f"(?:{whitespace})"
        self.resolving: list[str] = []

    # -------------------------------------------------------------------- dispatch
    def value(self, s: Any, path: str) -> str:
        if s is True or s == {}:
            return self._free_value(MAX_FREE_DEPTH)
        if s is False:
            raise SchemaError(f"the schema at {path} is false: no value matches it")
        if not isinstance(s, dict):
            raise SchemaError(f"the schema at {path} must be an object, got {type(s).__name__}")
        self._check_keywords(s, path)
        if "$ref" in s:
            return self._ref(s["$ref"], path)
        if "allOf" in s:
            parts = s["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise SchemaError(f"allOf at {path}: only a single-schema allOf is supported (intersecting "
                                  "languages is not): merge the schemas by hand")
            return self.value(parts[0], f"{path}/allOf/0")
        for key in ("anyOf", "oneOf"):
            if key in s:
                opts = s[key]
                if not isinstance(opts, list) or not opts:
                    raise SchemaError(f"{key} at {path} must be a non-empty list of schemas")
                return self._alt([self.value(o, f"{path}/{key}/{i}") for i, o in enumerate(opts)])
        if "const" in s:
            return self._literal(s["const"], path)
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise SchemaError(f"enum at {path} must be a non-empty list")
            return self._alt([self._literal(v, path) for v in s["enum"]])
        types = s.get("type")
        if types is None:
            types = self._implied_type(s, path)
        if isinstance(types, list):
            if not types:
                raise SchemaError(f"type at {path} is an empty list")
            return self._alt([self._typed(t, s, path) for t in types])
        return self._typed(types, s, path)

    def _check_keywords(self, s: dict, path: str) -> None:
        types = s.get("type")
        names = types if isinstance(types, list) else [types] if types else list(KNOWN)
        bad_types = [t for t in names if t not in KNOWN]
        if bad_types:
            raise SchemaError(f"unknown type {bad_types[0]!r} at {path}: use one of {', '.join(KNOWN)}")
        allowed = ANNOTATIONS | COMBINATORS | set().union(*(KNOWN[t] for t in names))
        unknown = sorted(set(s) - allowed)
        if unknown:
            raise SchemaError(f"unsupported JSON Schema keyword(s) {', '.join(unknown)} at {path}: minillm compiles "
                              "type, enum, const, properties, required, additionalProperties, items, minItems, "
                              "maxItems, minLength, maxLength, pattern, format, anyOf, oneOf, $ref/$defs; drop the "
                              "keyword or check the output yourself")

    def _implied_type(self, s: dict, path: str) -> str:
        if "properties" in s or "additionalProperties" in s or "required" in s:
            return "object"
        if "items" in s or "minItems" in s or "maxItems" in s:
            return "array"
        if {"minLength", "maxLength", "pattern", "format"} & set(s):
            return "string"
        return "any"

    def _typed(self, t: str, s: dict, path: str) -> str:
        if t == "any":
            return self._free_value(MAX_FREE_DEPTH)
        return getattr(self, "_" + t)(s, path)

    def _ref(self, ref: Any, path: str) -> str:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"$ref {ref!r} at {path}: only local references (#/$defs/name) are supported")
        if ref in self.resolving:
            raise SchemaError(f"$ref {ref!r} at {path} is recursive: a regex cannot nest without bound; unroll the "
                              "recursion to a fixed depth")
        node: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise SchemaError(f"$ref {ref!r} at {path} points nowhere in the schema")
            node = node[part]
        self.resolving.append(ref)
        try:
            return self.value(node, ref)
        finally:
            self.resolving.pop()

    # -------------------------------------------------------------------- scalars
    def _literal(self, v: Any, path: str) -> str:
        try:
            return escape(json.dumps(v, ensure_ascii=False, separators=(",", ":")))
        except (TypeError, ValueError):
            raise SchemaError(f"const/enum value {v!r} at {path} is not JSON") from None

    def _string(self, s: dict, path: str) -> str:
        lo, hi = self._bounds(s, "minLength", "maxLength", path)
        if "pattern" in s and "format" in s:
            raise SchemaError(f"pattern and format together at {path}: give one")
        if "pattern" in s:
            pat = s["pattern"]
            if not isinstance(pat, str):
                raise SchemaError(f"pattern at {path} must be a string")
            if lo or hi is not None:
                raise SchemaError(f"pattern with minLength/maxLength at {path} is not supported: put the length in "
                                  "the pattern")
            if pat.startswith("^"):
                pat = pat[1:]
            if pat.endswith("$") and not pat.endswith("\\$"):
                pat = pat[:-1]
            return f'"(?:{pat})"'
        if "format" in s:
            if lo or hi is not None:
                raise SchemaError(f"format with minLength/maxLength at {path} is not supported: use a pattern "
                                  "that bounds the length")
            fmt = s["format"]
            if fmt not in FORMATS:
                raise SchemaError(f"string format {fmt!r} at {path} is not supported: use one of "
                                  f"{', '.join(FORMATS)}, or a pattern")
            return f'"(?:{FORMATS[fmt]})"'
        return f'"{STRING_CHAR}{self._count(lo, hi)}"'

    def _integer(self, s: dict, path: str) -> str:
        return INTEGER

    def _number(self, s: dict, path: str) -> str:
        return NUMBER

    def _boolean(self, s: dict, path: str) -> str:
        return "(?:true|false)"

    def _null(self, s: dict, path: str) -> str:
        return "null"

    # -------------------------------------------------------------------- containers
    def _object(self, s: dict, path: str) -> str:
        props = s.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"properties at {path} must be an object")
        required = s.get("required", [])
        if not isinstance(required, list) or any(not isinstance(r, str) for r in required):
            raise SchemaError(f"required at {path} must be a list of property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaError(f"required property {missing[0]!r} at {path} has no schema in properties: add it "
                              "to properties")
        ws = self.ws
        extra = s.get("additionalProperties", True)
        if not isinstance(extra, (bool, dict)):
            raise SchemaError(f"additionalProperties at {path} must be true, false or a schema")
        if not props:
            if extra is False:                                        # no properties at all: the empty object
                return rf"\{{{ws}\}}"
            if extra is True or not extra:
                return self._free_object(MAX_FREE_DEPTH)
            member = f'"{STRING_CHAR}*"{ws}:{ws}{self.value(extra, f"{path}/additionalProperties")}'
            return self._seq(r"\{", r"\}", member, 0, None)        # every value validates against the schema
        if "additionalProperties" in s and extra is not False:
            raise SchemaError(f"additionalProperties {json.dumps(extra)[:60]} next to properties at {path} is not "
                              "supported: minillm's outputs hold only the listed properties (and every such output "
                              "validates); drop additionalProperties or set it to false")
        items = [f'{self._literal(k, path)}{ws}:{ws}{self.value(v, f"{path}/properties/{k}")}'
                 for k, v in props.items()]
        req = [k in required for k in props]
        n = len(items)
        # tail[i]: the properties from i on, each after a comma, optional ones may be skipped
        tail = [""] * (n + 1)
        for i in range(n - 1, -1, -1):
            one = f"{ws},{ws}{items[i]}"
            tail[i] = (one if req[i] else f"(?:{one})?") + tail[i + 1]
        # the first property present: any one not preceded by a required one
        firsts = []
        for i in range(n):
            firsts.append(items[i] + tail[i + 1])
            if req[i]:
                break
        body = self._alt(firsts)
        if not any(req):
            body = f"(?:{body})?"
        return rf"\{{{ws}{body}{ws}\}}"

    def _array(self, s: dict, path: str) -> str:
        lo, hi = self._bounds(s, "minItems", "maxItems", path)
        items = s.get("items", True)
        if isinstance(items, list):
            raise SchemaError(f"items at {path} is a list (tuple validation): use prefixItems-free schemas; not "
                              "supported")
        item = self.value(items, f"{path}/items")
        return self._seq(r"\[", r"\]", item, lo, hi)

    def _seq(self, open_: str, close: str, item: str, lo: int, hi: int | None) -> str:
        ws = self.ws
        if hi == 0:
            return f"{open_}{ws}{close}"
        more = f"(?:{ws},{ws}{item}){self._count(max(lo - 1, 0), None if hi is None else hi - 1)}"
        body = f"{item}{more}"
        if lo == 0:
            body = f"(?:{body})?"
        return f"{open_}{ws}{body}{ws}{close}"

    # -------------------------------------------------------------------- free-form values
    def _free_value(self, depth: int) -> str:
        scalars = [f'"{STRING_CHAR}*"', NUMBER, "true", "false", "null"]
        if depth > 0:
            scalars += [self._free_object(depth), self._free_array(depth)]
        return self._alt(scalars)

    def _free_object(self, depth: int) -> str:
        member = f'"{STRING_CHAR}*"{self.ws}:{self.ws}{self._free_value(depth - 1)}'
        return self._seq(r"\{", r"\}", member, 0, None)

    def _free_array(self, depth: int) -> str:
        return self._seq(r"\[", r"\]", self._free_value(depth - 1), 0, None)

    # -------------------------------------------------------------------- helpers
    @staticmethod
    def _alt(options: list[str]) -> str:
        return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"

    @staticmethod
    def _count(lo: int, hi: int | None) -> str:
        if hi is None:
            return {0: "*", 1: "+"}.get(lo, f"{{{lo},}}")
        return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"

    @staticmethod
    def _bounds(s: dict, lo_key: str, hi_key: str, path: str) -> tuple[int, int | None]:
        lo, hi = s.get(lo_key, 0), s.get(hi_key)
        for k, v in ((lo_key, lo), (hi_key, hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise SchemaError(f"{k} at {path} must be a non-negative integer, got {v!r}")
        if hi is not None and hi < lo:
            raise SchemaError(f"{lo_key}={lo} > {hi_key}={hi} at {path}: no value matches")
        return lo, hi
