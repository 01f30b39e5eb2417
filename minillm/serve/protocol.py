"""The OpenAI request bodies minillm serves, as pydantic models, and their translation to SamplingParams.

Field names and meanings follow OpenAI's API; vLLM's extra sampling fields (top_k, min_p, repetition_penalty,
ignore_eos, stop_token_ids, structured_outputs, ...) are accepted where vLLM accepts them. Unknown fields are
ignored (as vLLM does); fields minillm knows but cannot honour (tools, logit_bias, echo, suffix, best_of > n) are
refused with a 400 that names them, so nothing runs with a setting silently dropped. Omitted sampling settings take
the model's recommended ones (its generation config), then SamplingParams' defaults.
"""
from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from minillm.sampling.params import SamplingParams
from minillm.structured.params import StructuredOutputsParams


class RequestError(ValueError):
    """A request minillm refuses: `status` (400, 404, 429, ...), the OpenAI error `type`, and the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.headers = message, param, status, kind, headers


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    json_schema: dict | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    """What chat and completions share."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    structured_outputs: dict | None = None
    best_of: int | None = None
    logit_bias: dict | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list | None = None
    tool_choice: Any = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------- refusing what cannot be honoured

def refuse_unsupported(req: _Sampling) -> None:
    if req.logit_bias:
        raise RequestError("logit_bias is not supported by minillm: drop it", "logit_bias")
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError("best_of other than n is not supported: minillm returns every sample (use n)", "best_of")
    if isinstance(req, ChatCompletionRequest) and (req.tools or req.tool_choice not in (None, "none")):
        raise RequestError("tools / tool calling is not supported by minillm: describe the call's JSON with "
                           "response_format json_schema instead", "tools")
    if isinstance(req, CompletionRequest) and req.echo:
        raise RequestError("echo is not supported by minillm: the response holds the completion only", "echo")
    if isinstance(req, CompletionRequest) and req.suffix:
        raise RequestError("suffix (fill-in-the-middle) is not supported by minillm", "suffix")


# --------------------------------------------------------------------------- to SamplingParams

_PARAM_RE = re.compile(r"invalid (?:SamplingParams|StructuredOutputsParams): (\w+)")


def sampling_params(req: _Sampling, prompt_len: int, max_model_len: int, defaults: dict[str, Any]) -> SamplingParams:
    """The request's SamplingParams: what it says, else the model's recommended settings, else SamplingParams'
    defaults. max_tokens left out means: as long as the context allows (as vLLM does)."""
    refuse_unsupported(req)
    max_tokens = req.max_completion_tokens if isinstance(req, ChatCompletionRequest) and \
        req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = max(1, max_model_len - prompt_len)
    chosen = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
              if getattr(req, k) is not None}
    logprobs = (req.top_logprobs or 0 if req.logprobs else None) if isinstance(req, ChatCompletionRequest) \
        else req.logprobs
    try:
        return SamplingParams(**{**defaults, **chosen}, max_tokens=max_tokens, n=req.n, seed=req.seed,
                              stop=req.stop or [], stop_token_ids=req.stop_token_ids or [],
                              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                              ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
                              logprobs=logprobs, structured_outputs=structured(req))
    except ValueError as e:
        m = _PARAM_RE.match(str(e))
        param = m.group(1) if m else None
        if isinstance(req, ChatCompletionRequest) and param == "logprobs":
            param = "top_logprobs"
        raise RequestError(str(e), param) from None


def structured(req: _Sampling) -> StructuredOutputsParams | None:
    """response_format (OpenAI) or structured_outputs (vLLM's extra) as StructuredOutputsParams; the schema is
    compiled when the request is added, so a bad one fails there with a 400."""
    fmt = req.response_format if isinstance(req, ChatCompletionRequest) else None
    if req.structured_outputs is not None and fmt is not None and fmt.type != "text":
        raise RequestError("give response_format or structured_outputs, not both", "structured_outputs")
    try:
        if req.structured_outputs is not None:
            return StructuredOutputsParams(**req.structured_outputs)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None:
            raise RequestError("response_format of type json_schema needs json_schema: {name, schema}",
                               "response_format")
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)
    except TypeError as e:                              # an unknown key in structured_outputs
        raise RequestError(f"structured_outputs: {e}", "structured_outputs") from None
    except ValueError as e:
        raise RequestError(str(e), "structured_outputs" if req.structured_outputs is not None
                           else "response_format") from None
