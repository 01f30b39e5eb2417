"""A parser for the regex subset structured outputs need: literals and escapes, classes and negated classes, `.`,
\\d \\w \\s and their negations, groups, alternation, ? * + {m} {m,} {m,n}. Anchors are implied (the whole output
must match, like `re.fullmatch`), so a leading ^ and a trailing $ are accepted and ignored.

Classes follow Python's `re.ASCII` meanings (\\d = [0-9], \\w = [A-Za-z0-9_], \\s = [ \\t\\n\\r\\f\\v]) — the ECMA-262
reading JSON Schema's `pattern` uses for \\d and \\w; `.` is any character but a newline. Characters are Unicode code
points; surrogates (which UTF-8 cannot encode) are never matched.
The AST: Chars(ranges) | Concat(parts) | Alt(options) | Repeat(node, min, max or None)."""
from __future__ import annotations

import re
from dataclasses import dataclass

MAX_CODEPOINT = 0x10FFFF
MAX_REPEAT = 1000           # {m,n} bounds above this are refused (they expand to that many copies)


class RegexError(ValueError):
    """A pattern outside the supported subset, or malformed; names the construct and where it is."""

    def __init__(self, pattern: str, pos: int, what: str) -> None:
        super().__init__(f"regex {pattern!r} at position {pos}: {what}")
        self.pattern, self.pos = pattern, pos


@dataclass(frozen=True)
class Chars:
    ranges: tuple[tuple[int, int], ...]        # sorted, disjoint, inclusive code point ranges


@dataclass(frozen=True)
class Concat:
    parts: tuple


@dataclass(frozen=True)
class Alt:
    options: tuple


@dataclass(frozen=True)
class Repeat:
    node: object
    min: int
    max: int | None


def normalize(ranges) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def negate(ranges) -> tuple[tuple[int, int], ...]:
    out, nxt = [], 0
    for lo, hi in normalize(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODEPOINT:
        out.append((nxt, MAX_CODEPOINT))
    return tuple(out)


DIGIT = ((0x30, 0x39),)
WORD = normalize([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE = normalize([(0x09, 0x0D), (0x20, 0x20)])
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE, "D": negate(DIGIT), "W": negate(WORD), "S": negate(SPACE)}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}
UNSUPPORTED_ESCAPES = {"b": "a word boundary \\b", "B": "a non-boundary \\B", "A": "the anchor \\A",
                       "Z": "the anchor \\Z", "z": "the anchor \\z", "G": "the anchor \\G", "p": "a Unicode property \\p",
                       "P": "a Unicode property \\P", "k": "a named backreference \\k"}
DOT = negate(((0x0A, 0x0A),))


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p, self.i = pattern, 0

    def error(self, what: str, pos: int | None = None) -> RegexError:
        return RegexError(self.p, self.i if pos is None else pos, what)

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        if self.i >= len(self.p):
            raise self.error("the pattern ends too early (an escape, class or group is not finished)")
        c = self.p[self.i]
        self.i += 1
        return c

    def parse(self):
        if self.p.startswith("^"):
            self.i = 1
        node = self.alternation()
        if self.i < len(self.p):
            if self.p[self.i] == ")":
                raise self.error("unbalanced ')': there is no group to close")
            raise self.error(f"unexpected {self.p[self.i]!r}")
        return node

    def alternation(self):
        options = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def sequence(self):
        parts = []
        while self.peek() not in (None, "|", ")"):
            if self.peek() == "$":
                if self.i == len(self.p) - 1 or self.p[self.i + 1] in "|)":
                    self.i += 1         # a trailing $ is implied by full matching
                    continue
                raise self.error("'$' inside the pattern: only a final $ is supported (anchors are implied)")
            if self.peek() == "^":
                raise self.error("'^' inside the pattern: only a leading ^ is supported (anchors are implied)")
            parts.append(self.quantified(self.atom()))
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def atom(self):
        start, c = self.i, self.take()
        if c == "(":
            return self.group(start)
        if c == "[":
            return Chars(self.char_class())
        if c == ".":
            return Chars(DOT)
        if c == "\\":
            return self.escape(in_class=False)
        if c in "*+?":
            raise self.error(f"{c!r} has nothing to repeat", start)
        if c == "{" and self._counted_at(start):
            raise self.error("'{' repetition has nothing to repeat", start)
        return Chars(((ord(c), ord(c)),))

    def group(self, start: int):
        if self.p.startswith("?", self.i):
            ahead = self.p[self.i:self.i + 4]
            if ahead.startswith("?:"):
                self.i += 2
            elif ahead.startswith("?P<"):
                end = self.p.find(">", self.i)
                if end < 0:
                    raise self.error("unterminated group name", start)
                self.i = end + 1
            elif ahead.startswith(("?=", "?!")):
                raise self.error("lookahead (?=...) / (?!...) is not supported: constrained decoding needs a "
                                 "regular language; rewrite the pattern without it", start)
            elif ahead.startswith(("?<=", "?<!")):
                raise self.error("lookbehind (?<=...) / (?<!...) is not supported: rewrite the pattern without it",
                                 start)
            elif ahead.startswith("?P="):
                raise self.error("a named backreference (?P=name) is not supported: backreferences are not "
                                 "regular", start)
            else:
                raise self.error(f"the group syntax ({ahead}...) (flags, conditionals, atomic groups) is not "
                                 "supported; use plain (...) or (?:...)", start)
        node = self.alternation()
        if self.peek() != ")":
            raise self.error("missing ')': a group is not closed", start)
        self.i += 1
        return node

    def _counted_at(self, pos: int) -> bool:
        j = pos + 1
        while j < len(self.p) and (self.p[j].isdigit() or self.p[j] == ","):
            j += 1
        body = self.p[pos + 1:j]
        return j < len(self.p) and self.p[j] == "}" and body != "" and body.count(",") <= 1

    def quantified(self, node):
        while True:
            c, start = self.peek(), self.i
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and self._counted_at(self.i):
                end = self.p.index("}", self.i)
                body = self.p[self.i + 1:end]
                self.i = end + 1
                lo_s, _, hi_s = body.partition(",")
                lo = int(lo_s) if lo_s else 0
                hi = lo if "," not in body else (int(hi_s) if hi_s else None)
                if hi is not None and hi < lo:
                    raise self.error(f"{{{body}}}: the maximum is smaller than the minimum", start)
                if max(lo, hi or 0) > MAX_REPEAT:
                    raise self.error(f"{{{body}}}: repetition counts above {MAX_REPEAT} are not supported", start)
            else:
                return node
            if self.peek() == "?":
                self.i += 1             # lazy: the same language, and full matching ignores match preference
            elif self.peek() == "+":
                raise self.error("possessive quantifiers (*+, ++, ?+) are not supported", self.i)
            if self.peek() in ("*", "+", "?"):
                raise self.error(f"multiple repeat {self.p[start:self.i + 1]!r}", start)
            node = Repeat(node, lo, hi)

    def escape(self, in_class: bool):
        start = self.i - 1
        c = self.take()
        if c in CLASS_ESCAPES:
            return Chars(CLASS_ESCAPES[c])
        if c in CHAR_ESCAPES:
            if c == "0" and self.peek() is not None and self.peek().isdigit():
                raise self.error("octal escapes are not supported", start)
            ch = CHAR_ESCAPES[c]
            return Chars(((ord(ch), ord(ch)),))
        if c in "xuU":
            n = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i:self.i + n]
            if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"\\{c} needs {n} hex digits", start)
            self.i += n
            cp = int(digits, 16)
            if cp > MAX_CODEPOINT:
                raise self.error(f"\\{c}{digits} is beyond the last Unicode code point", start)
            return Chars(((cp, cp),))
        if c.isdigit():
            raise self.error(f"a backreference \\{c} is not supported: backreferences are not regular", start)
        if c in UNSUPPORTED_ESCAPES and not (in_class and c == "b"):
            raise self.error(f"{UNSUPPORTED_ESCAPES[c]} is not supported (anchors are implied; no assertions)", start)
        if in_class and c == "b":
            return Chars(((8, 8),))
        if c.isalnum():
            raise self.error(f"unknown escape \\{c}", start)
        return Chars(((ord(c), ord(c)),))

    def char_class(self) -> tuple[tuple[int, int], ...]:
        start = self.i - 1
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.error("missing ']': a character class is not closed", start)
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_atom()
            if isinstance(lo, tuple):               # \d, \w, \s ... inside the class
                ranges.extend(lo)
                continue
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.class_atom()
                if isinstance(hi, tuple):
                    raise self.error("a range cannot end in a class escape like \\d", start)
                if hi < lo:
                    raise self.error(f"bad range {chr(lo)!r}-{chr(hi)!r}: the end comes before the start", start)
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        out = normalize(ranges)
        return negate(out) if negated else out

    def class_atom(self):
        """One class member: a code point, or the ranges of a class escape (\\d ...)."""
        c = self.take()
        if c == "[" and self.peek() == ":":
            raise self.error("POSIX classes like [:alpha:] are not supported; spell the ranges out", self.i - 1)
        if c != "\\":
            return ord(c)
        was_class = self.peek() in CLASS_ESCAPES
        node = self.escape(in_class=True)
        return node.ranges if was_class else node.ranges[0][0]


def parse(pattern: str):
    """The AST of `pattern`, or a RegexError naming what is unsupported or malformed."""
    if not isinstance(pattern, str):
        raise TypeError(f"a regex must be a str, got {type(pattern).__name__}")
    parser = _Parser(pattern)
    return parser.parse()


def escape(text: str) -> str:
    """`text` as a regex of our subset matching exactly it (re.escape also escapes characters we read literally,
    which our parser accepts too, but spaces and '#' it escapes are fine either way)."""
    return re.sub(r"[\\.^$|?*+()\[\]{}-]", lambda m: "\\" + m.group(0), text)
