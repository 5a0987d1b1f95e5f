"""The request bodies the router accepts, validated before anything reaches a worker.

The models are strict (no string-to-number coercion) and closed (an unknown parameter is a
400, as OpenAI answers), so a mistake is reported by the router with the parameter's name
instead of surfacing later as a worker error. The raw JSON object — not a re-serialisation —
is what the router forwards, so fields pass to vLLM exactly as the client wrote them.

NOTE: ``n > 1`` and ``best_of > 1`` are rejected: the router relays one choice per request,
which keeps the P/D hops (one prefill, one decode) and the stream relay simple.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from dpd.router.errors import ApiError, bad_request

MAX_BODY_BYTES = 4 * 1024 * 1024  # at least; a longer context allows more (body_limit_bytes)
BODY_BYTES_PER_TOKEN = 32  # a token of text as JSON: a few characters, \uXXXX-escaped at worst, and markup


def body_limit_bytes(max_model_len: int) -> int:
    """The largest request body the router reads: what a prompt filling the model's context can
    need, and never below ``MAX_BODY_BYTES``."""
    return max(MAX_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)
_Model = TypeVar("_Model", bound=BaseModel)

Number = Annotated[StrictInt | float, Field(allow_inf_nan=False)]
Stop = StrictStr | Annotated[list[StrictStr], Field(max_length=16)] | None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


# Bounds on lists and maps a client sends through to the engine (the body cap bounds the rest).
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's own limit


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] | None = None
    stop: Stop = None
    stop_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0, le=2)] | None = None
    logit_bias: Annotated[
        dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[Number, Field(ge=-100, le=100)]],
        Field(max_length=MAX_LOGIT_BIAS),
    ] | None = None
    seed: StrictInt | None = None
    user: StrictStr | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None


class CompletionRequest(_Request):
    prompt: Annotated[StrictStr, Field(min_length=1)] | Annotated[list[StrictInt], Field(min_length=1)]
    echo: StrictBool | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=1)] | None = None
    suffix: None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer"]
    content: StrictStr | Annotated[list[TextPart], Field(min_length=1)]
    name: StrictStr | None = None
    # an earlier assistant turn's reasoning, sent back as the engine gave it (vLLM accepts both)
    reasoning: StrictStr | None = None
    reasoning_content: StrictStr | None = None


class ChatCompletionRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a prompt (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: StrictStr
    prompt: StrictStr
    add_special_tokens: StrictBool = True


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with messages: the chat template, as a chat request is counted."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: StrictStr
    messages: Annotated[list[Message], Field(min_length=1)]
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: StrictStr
    tokens: Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(max_length=1_000_000)]


def _param_of(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if part == "[key]":  # pydantic's marker of a bad mapping key: the key itself names it
            continue
        if isinstance(part, str) and len(part) > 64:  # a client's own key, echoed: bounded
            part = part[:64] + "…"
        if isinstance(part, int):
            out += f"[{part}]"
        elif (
            isinstance(part, str)
            and not part.startswith(("literal[", "list[", "constrained-", "function-"))
            and part not in {"str", "int", "float", "bool", "dict", "list", "none", "is-instance[TextPart]"}
        ):
            out += ("." if out else "") + part
    return out


def parse_body(raw: bytes, kind: type[_Request], max_bytes: int = MAX_BODY_BYTES) -> tuple[dict[str, Any], _Request]:
    """Decode and validate a request body; raise a 4xx ``ApiError`` naming what is wrong."""
    body = _load_object(raw, max_bytes)
    if kind is CompletionRequest:
        _unwrap_single_prompt(body)
    parsed = _validate(body, kind)
    if parsed.stream_options is not None and not parsed.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    max_tokens = requested_max_tokens(parsed)
    if parsed.min_tokens is not None and max_tokens is not None and parsed.min_tokens > max_tokens:
        # the engine refuses it too, but only at the decode hop, after a whole prefill
        raise bad_request(f"'min_tokens' ({parsed.min_tokens}) must not exceed the maximum number of tokens to generate "
                          f"({max_tokens}).", param="min_tokens")
    return body, parsed


def parse_tokenize(raw: bytes, max_bytes: int = MAX_BODY_BYTES) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A ``/tokenize`` body: with ``messages`` a chat, else a prompt."""
    body = _load_object(raw, max_bytes)
    if "messages" in body:
        return _validate(body, TokenizeChatRequest)
    return _validate(body, TokenizeCompletionRequest)


def parse_detokenize(raw: bytes, max_bytes: int = MAX_BODY_BYTES) -> DetokenizeRequest:
    return _validate(_load_object(raw, max_bytes), DetokenizeRequest)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _load_object(raw: bytes, max_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    if len(raw) > max_bytes:
        raise ApiError(413, f"Request body is larger than {max_bytes} bytes.", code="body_too_large")
    try:
        text = raw.decode("utf-8")  # strict: json.loads(bytes) would let UTF-8-encoded surrogates through
        body = json.loads(text)
    except UnicodeDecodeError:
        raise bad_request("Request body is not valid UTF-8.", code="invalid_encoding") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc.msg} at position {exc.pos}.", code="invalid_json") from None
    except (RecursionError, ValueError) as exc:  # nesting too deep, integers too long
        raise bad_request(f"Request body is not acceptable JSON: {exc.__class__.__name__}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.", code="invalid_json")
    if _SURROGATE_ESCAPE.search(text):  # "\ud83d\ude00" is a valid pair; a lone "\ud800" is no text
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("Request body holds an unpaired UTF-16 surrogate escape (\\uD800–\\uDFFF).",
                              code="invalid_encoding") from None
        except RecursionError:  # nested just deep enough for loads, not for dumps
            raise bad_request("Request body is not acceptable JSON: RecursionError.", code="invalid_json") from None
    return body


def _validate(body: dict[str, Any], kind: type[_Model]) -> _Model:
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param_of(err["loc"])
        if err["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {param}", param=param) from None
        if err["type"] == "missing":
            raise bad_request(f"Missing required parameter: '{param}'.", param=param) from None
        if param in ("n", "best_of"):
            raise bad_request(f"'{param}' must be 1: dpd serves one choice per request.", param=param) from None
        raise bad_request(f"Invalid value for '{param}': {_alternatives(exc.errors(), param)}.", param=param) from None


def _alternatives(errors: list[Any], param: str) -> str:
    """What each accepted form of ``param`` wanted (a field may be a number or an integer, a
    string or a list of parts): pydantic reports one error per form, the first alone misleads
    ("should be a valid integer" for a temperature given as a string)."""
    parts: list[str] = []
    for err in errors:
        where = _param_of(err["loc"])
        if where == param:
            part = err["msg"]
        elif where.startswith((param + ".", param + "[")) and not any(p.startswith("at '") for p in parts):
            part = f"at '{where}': {err['msg']}"  # the first problem inside it (the rest follow from it)
            if err["type"] == "literal_error" and where.endswith(".type"):
                part += " (dpd accepts text content parts only)"
        else:
            continue
        if parts and part.startswith("Input should be "):
            part = part[len("Input should be "):]
        if part not in parts:
            parts.append(part)
    return " or ".join(parts)


def _unwrap_single_prompt(body: dict[str, Any]) -> None:
    """``prompt`` as a list of one prompt (a string, or a list of token ids) — what OpenAI SDK
    wrappers such as LangChain's send — is that prompt; several in one request (a batch, which
    the API answers with a choice each) are refused by name."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, (str, list)) for p in prompt):
        return  # a string, token ids, or something _validate names
    if len(prompt) > 1:
        raise bad_request(f"'prompt' holds {len(prompt)} prompts: dpd serves one prompt per request (send each "
                          "on its own).", param="prompt")
    body["prompt"] = prompt[0]


def requested_max_tokens(parsed: _Request) -> int | None:
    if isinstance(parsed, ChatCompletionRequest) and parsed.max_completion_tokens is not None:
        return parsed.max_completion_tokens
    return parsed.max_tokens
