"""Text <-> token ids, chat templates and streaming detokenization, on top of HF `tokenizers`.

A GGUF file has no tokenizer.json: it stores the vocabulary, merges and special token ids as
metadata under llama.cpp's names (`tokenizer.ggml.*`). `Tokenizer.from_gguf` rebuilds the same
tokenizer from those; `Tokenizer.from_dir` reads a Hugging Face directory.
"""
from __future__ import annotations

import json
import re
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from minillm.loading.errors import ModelLoadError

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end a turn in common chat formats: generation stops on them as on EOS.
STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|eom_id|>",
               "<end_of_turn>", "<|end|>")

# Pre-tokenizer regexes by `tokenizer.ggml.pre`: the split the vocabulary's merges were learned on.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
           "gpt-4o": _GPT4O_SPLIT, "llama4": _GPT4O_SPLIT}
# Llama 3's tokenizer.json (and llama.cpp) look a whole pre-token up before merging it.
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe"}
# GPT-2's split after cutting out every digit on its own (SmolLM's tokenizer.json; llama.cpp's "\p{N}" rule).
_DIGIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_PRES = {"default", "gpt-2", "gpt2", None}


class Tokenizer:
    def __init__(self, tok: HFTokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 add_bos_token: bool, chat_template: str | None, vocab_size: int | None = None,
                 extra_stop_ids: Iterable[int] = ()) -> None:
        self._tok = tok
        self.vocab_size = vocab_size or tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.add_bos_token = bool(add_bos_token) and bos_token_id is not None
        self.chat_template = chat_template
        named = (tok.token_to_id(t) for t in STOP_TOKENS)
        self.stop_token_ids: set[int] = {i for i in (eos_token_id, *extra_stop_ids, *named) if i is not None}
        self.special_token_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        # SentencePiece's <0xNN> byte-fallback tokens: their decoding depends on the bytes that follow
        self.byte_token_ids = frozenset(i for t, i in tok.get_vocab().items() if _BYTE_TOKEN.fullmatch(t))
        self._template = None  # compiled lazily: most uses never render a chat
        self._token_bytes: list[bytes | None] | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> Tokenizer:
        kind = metadata.get("tokenizer.ggml.model")
        tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
        if not tokens:
            raise ModelLoadError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
        types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        if kind == "gpt2":
            tok = _byte_level_bpe(tokens, types, metadata.get("tokenizer.ggml.merges") or [],
                                  metadata.get("tokenizer.ggml.pre"))
        elif kind == "llama" and metadata.get("tokenizer.ggml.scores"):
            tok = _sentencepiece_bpe(tokens, types, metadata["tokenizer.ggml.scores"],
                                     metadata.get("tokenizer.ggml.unknown_token_id"),
                                     metadata.get("tokenizer.ggml.add_space_prefix", True))
        else:
            raise ModelLoadError(f"unsupported GGUF tokenizer type {kind!r} (minillm reads 'gpt2' byte-level BPE "
                                 "and 'llama' SentencePiece with scores). Use a Hugging Face directory with "
                                 "tokenizer.json instead.")
        key = lambda name: metadata.get(f"tokenizer.ggml.{name}")  # noqa: E731
        named_ids = [key(n) for n in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")]
        _add_special_tokens(tok, tokens, types, named_ids)
        # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise.
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
        return cls(tok, bos_token_id=key("bos_token_id"), eos_token_id=key("eos_token_id"), add_bos_token=add_bos,
                   chat_template=metadata.get("tokenizer.chat_template"), vocab_size=len(tokens),
                   extra_stop_ids=[i for i in (key("eot_token_id"), key("eom_token_id")) if i is not None])

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        try:
            tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"cannot read {path / 'tokenizer.json'}: {e}") from e
        cfg = _read_json(path / "tokenizer_config.json")
        model_cfg = _read_json(path / "config.json")
        bos_id = _token_id(tok, cfg.get("bos_token"), model_cfg.get("bos_token_id"))
        eos_id = _token_id(tok, cfg.get("eos_token"), model_cfg.get("eos_token_id"))
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # not stated: does tokenizer.json's post-processor add it?
            with_specials, without = tok.encode("a").ids, tok.encode("a", add_special_tokens=False).ids
            add_bos = bos_id is not None and with_specials[:1] == [bos_id] and without[:1] != [bos_id]
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")  # may list several
        return cls(tok, bos_token_id=bos_id, eos_token_id=eos_id, add_bos_token=add_bos,
                   chat_template=_chat_template(path, cfg),
                   extra_stop_ids=gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # BOS is ours to add (not tokenizer.json's post-processor), so GGUF and HF behave the same.
        if not isinstance(text, str):
            raise TypeError(f"encode() takes text (str), got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:    # lone surrogates: how Python carries bytes that were not UTF-8
            piece = text[e.start:e.end]
            try:
                what = f"the bytes {piece.encode('utf-8', 'surrogateescape')!r}"
            except UnicodeEncodeError:     # a surrogate no byte maps to (e.g. "\ud800" from JSON or an escape)
                what = f"the surrogate code point(s) {piece[:4]!r}"
            raise ValueError(f"the text is not valid UTF-8 (it holds {what}): pass UTF-8 text, e.g. "
                             "convert it with iconv first") from None
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self) -> list[bytes | None]:
        """Each id's exact bytes in the text (byte-level spellings undone, SentencePiece's ▁ and <0xNN> read as a
        space and a byte); None for special tokens and unused ids. What a byte automaton walks (structured output)."""
        if self._token_bytes is None:
            unspell = {c: b for b, c in _bytes_to_unicode().items()}
            out: list[bytes | None] = [None] * self.vocab_size
            for token, i in self.get_vocab().items():
                if i >= self.vocab_size or i in self.special_token_ids:
                    continue
                if _BYTE_TOKEN.fullmatch(token):
                    out[i] = bytes([int(token[3:5], 16)])
                elif set(token) <= _BYTE_ALPHABET:
                    out[i] = bytes(unspell[c] for c in token)
                else:
                    out[i] = token.replace("\u2581", " ").encode("utf-8")
            self._token_bytes = out
        return self._token_bytes

    def get_vocab(self) -> dict[str, int]:
        """token string -> id, added tokens included (two tokenizers agree on ids iff these are equal)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def save(self, path: str | Path) -> None:
        """Write the vocabulary, merges and pre-tokenizer as a Hugging Face tokenizer.json."""
        self._tok.save(str(path))

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) to the prompt text the model was trained on."""
        if not self.chat_template:
            raise ValueError("this model has no chat template: pass raw text instead of chat messages "
                             "(or use a model whose GGUF/tokenizer_config.json has one)")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas.

    One token can hold part of a UTF-8 character, so a delta is only emitted once it no longer ends in
    U+FFFD. Decoding stays cheap by re-decoding only a short window (the tokens since the previous
    emission plus the new ones); the window's own text is subtracted, so the deltas add up to
    `tokenizer.decode(all ids)` (as in vLLM / text-generation-inference).

    SentencePiece byte tokens are held back too: HF's ByteFallback decoder turns a whole run of them
    into U+FFFDs if the run is not valid UTF-8, which can rewrite text that was already valid.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start: decoding ids[_prefix:_read] gives _prefix_text, already emitted
        self._read = 0
        self._prefix_text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd") or self._ends_in_byte_run():
            return ""  # nothing yet, or an incomplete character: wait for the next token
        return self._emit(new_text)

    def finish(self) -> str:
        """Flush text held back at the end (an incomplete character decodes to U+FFFD)."""
        return self._emit(self._decode(self.ids[self._prefix:])) if self._read < len(self.ids) else ""

    def _emit(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text):]
        # Advance the window only past tokens that produce text on their own: a window starting with
        # skipped special tokens would let the decoder's "strip the first space" rule hit real text.
        tail = self._decode(self.ids[self._read:])
        if tail:
            self._prefix, self._prefix_text = self._read, tail
        else:
            self._prefix_text = new_text
        self._read = len(self.ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _ends_in_byte_run(self) -> bool:
        """Is the last token the decoder sees a byte token? (It skips unknown ids and, if asked, specials.)"""
        tok = self.tokenizer
        if not tok.byte_token_ids:
            return False
        for i in reversed(self.ids):
            skipped = self.skip_special_tokens and i in tok.special_token_ids
            if not skipped and tok.id_to_token(i) is not None:
                return i in tok.byte_token_ids
        return False


# ---------------------------------------------------------------------- GGUF tokenizer builders

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: byte-level vocabularies are spelled with it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


_BYTE_ALPHABET = set(_bytes_to_unicode().values())
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str | None) -> HFTokenizer:
    # Some files spell a few tokens as raw text instead of the byte alphabet; respell those, except
    # control/user-defined ones, which are matched whole in the text and must keep their spelling.
    spell = _bytes_to_unicode()
    vocab = {}
    for i, (token, ttype) in enumerate(zip(tokens, types)):
        if not set(token) <= _BYTE_ALPHABET and ttype not in (CONTROL, USER_DEFINED):
            token = "".join(spell[b] for b in token.encode("utf-8"))
        vocab[token] = i
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=pre in _IGNORE_MERGES))
    tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    if pre in _DIGIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in _GPT2_PRES:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}: using GPT-2's split; tokens may differ "
                      "slightly from the reference tokenizer", stacklevel=3)
    return byte_level


def _sentencepiece_bpe(tokens: list[str], types: list[int], scores: list[float], unk_id: int | None,
                       add_space_prefix: bool) -> HFTokenizer:
    """SentencePiece BPE as HF does it: merges ranked by the merged piece's score, byte fallback."""
    vocab = {token: i for i, token in enumerate(tokens)}
    mergeable = {t: s for t, s, ty in zip(tokens, scores, types) if ty not in (UNKNOWN, CONTROL, UNUSED, BYTE)}
    unk = tokens[unk_id] if unk_id is not None else None
    tok = HFTokenizer(models.BPE(vocab, _merges_from_scores(vocab, mergeable), unk_token=unk,
                                 fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every way to build a piece from two vocabulary pieces, best (highest-scoring result) first.

    Same order as transformers' `generate_merges`: ties go to the longer left piece."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tok: HFTokenizer, tokens: list[str], types: list[int], special_ids: list[int | None]) -> None:
    """Control tokens (and bos/eos/unk/pad) become special; user-defined ones plain added tokens.

    Either way they are matched whole in the input instead of being cut up by BPE."""
    special = {i for i, t in enumerate(types) if t == CONTROL} | {
        i for i in special_ids if i is not None and 0 <= i < len(tokens)}
    user = [i for i, t in enumerate(types) if t == USER_DEFINED and i not in special]
    # Only tokens the model's vocabulary holds under that spelling: anything else would get a new id.
    in_vocab = lambda i: tok.token_to_id(tokens[i]) == i  # noqa: E731
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)
                            if in_vocab(i)])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user if in_vocab(i)])


# ---------------------------------------------------------------------- Hugging Face directories

def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def _token_id(tok: HFTokenizer, token: Any, fallback_id: Any) -> int | None:
    """tokenizer_config.json names tokens as a string or {"content": ...}; config.json gives an id."""
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and tok.token_to_id(token) is not None:
        return tok.token_to_id(token)
    if isinstance(fallback_id, list):  # config.json may list several EOS ids: the first is the main one
        fallback_id = fallback_id[0] if fallback_id else None
    return fallback_id


def _chat_template(path: Path, cfg: dict[str, Any]) -> str | None:
    file = path / "chat_template.jinja"  # newer transformers save the template on its own
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


# ---------------------------------------------------------------------- chat templates

def _compile_template(source: str):
    """Compile like transformers does, so prompts match what the model saw in training."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # templates come from downloaded files

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        # jinja's own tojson escapes <, > and & for HTML, which would change the prompt
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the model's chat template is not valid Jinja: {e}") from e
