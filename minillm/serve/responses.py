"""RequestOutputs as OpenAI response bodies: whole responses, and the chunks of a stream (one per engine step that
advanced the request, with what that step added to each of its n completions)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from minillm.engine.outputs import CompletionOutput, Logprob, RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# --------------------------------------------------------------------------- logprobs in OpenAI's two shapes

def _top(entry: dict[int, Logprob], token: int, n: int) -> tuple[Logprob, list[Logprob]]:
    ranked = sorted(entry.values(), key=lambda lp: lp.rank)[:n]
    return entry[token], ranked


def chat_logprobs(c: CompletionOutput, start: int, n: int) -> dict | None:
    """{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]} for the output tokens from `start` on."""
    if c.logprobs is None:
        return None
    items = []
    for token, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        chosen, ranked = _top(entry, token, n)
        items.append({**_chat_item(chosen), "top_logprobs": [_chat_item(lp) for lp in ranked]})
    return {"content": items}


def _chat_item(lp: Logprob) -> dict:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


def completion_logprobs(c: CompletionOutput, start: int, n: int, offset: int) -> dict | None:
    """The legacy shape: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""
    if c.logprobs is None:
        return None
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        chosen, ranked = _top(entry, token, n)
        text = chosen.decoded_token or ""
        out["tokens"].append(text)
        out["token_logprobs"].append(chosen.logprob)
        top: dict[str, float] = {}
        for lp in ranked:                               # most likely first: a text two tokens share keeps the higher
            top.setdefault(lp.decoded_token or "", lp.logprob)
        out["top_logprobs"].append(top if n else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


# --------------------------------------------------------------------------- whole responses

def chat_response(out: RequestOutput, model: str, top_logprobs: int) -> dict:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, 0, top_logprobs), "finish_reason": c.finish_reason or "stop"}
               for c in out.outputs]
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage([out])}


def completion_response(outs: list[RequestOutput], model: str, logprobs: int | None, n: int) -> dict:
    choices = [{"index": i * n + c.index, "text": c.text,
                "logprobs": completion_logprobs(c, 0, logprobs or 0, 0) if logprobs is not None else None,
                "finish_reason": c.finish_reason or "stop"}
               for i, o in enumerate(outs) for c in o.outputs]
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(outs)}


# --------------------------------------------------------------------------- streams

@dataclass
class Deltas:
    """What each completion of one request has already streamed (text, tokens), to send only what is new."""
    text: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def new(self, out: RequestOutput) -> list[tuple[CompletionOutput, str, int]]:
        """(completion, its new text, index of its first new token) for each completion this step advanced."""
        changed = []
        for c in out.outputs:
            if c.index in self.finished:
                continue
            sent = self.text.get(c.index, "")
            text = c.text[len(sent):] if c.text.startswith(sent) else ""
            start = self.tokens.get(c.index, 0)
            if text or len(c.token_ids) > start or c.finish_reason is not None:
                changed.append((c, text, start))
                self.text[c.index] = sent + text
                self.tokens[c.index] = len(c.token_ids)
                if c.finish_reason is not None:
                    self.finished.add(c.index)
        return changed


def chunk(kind: str, rid: str, created: int, model: str, choices: list[dict], usage_: dict | None = None,
          with_usage: bool = False) -> dict:
    """One streamed event: `kind` is "chat.completion.chunk" or "text_completion"; with stream_options.include_usage
    every chunk carries "usage" (null until the last, which has no choices)."""
    out = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
    if with_usage:
        out["usage"] = usage_
    return out


def chat_delta_choices(out: RequestOutput, deltas: Deltas, top_logprobs: int) -> list[dict]:
    return [{"index": c.index, "delta": {"content": text},
             "logprobs": chat_logprobs(c, start, top_logprobs), "finish_reason": c.finish_reason}
            for c, text, start in deltas.new(out)]


def completion_delta_choices(out: RequestOutput, deltas: Deltas, base: int, n: int,
                             logprobs: int | None) -> list[dict]:
    return [{"index": base * n + c.index, "text": text,
             "logprobs": (completion_logprobs(c, start, logprobs or 0, len(deltas.text[c.index]) - len(text))
                          if logprobs is not None else None),
             "finish_reason": c.finish_reason}
            for c, text, start in deltas.new(out)]
