"""parse_body: every bad body is a 4xx OpenAI-style error naming the offending parameter."""

import json

import pytest

from dpd.router.errors import ApiError
from dpd.router.protocol import (
    MAX_BODY_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
    requested_max_tokens,
)

CMPL = {"model": "m", "prompt": "hello"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def enc(body) -> bytes:
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode()
    return json.dumps(body).encode()


def with_msg(**message) -> dict:
    return {**CHAT, "messages": [message]}


def raw_with(base: dict, key: str, literal: str) -> bytes:
    """``base`` plus ``key`` set to a JSON literal json.dumps would not write (NaN, Infinity)."""
    return (json.dumps(base)[:-1] + f', "{key}": {literal}}}').encode()


# (body, param): param is the parameter the error must name, None when no field is at fault.
BAD_COMPLETIONS = [
    (b"", None),
    (b"{", None),
    (b"{'model': 'm'}", None),
    (b'{"model": "m", "prompt": "x",}', None),
    (b"not json at all", None),
    (b"[1, 2]", None),
    (b'"a string"', None),
    (b"42", None),
    (b"null", None),
    (b"\xff\xfe\xfd", None),
    (b'{"model": "m", "prompt": "caf\xe9"}', None),  # latin-1, not UTF-8
    ({"prompt": "x"}, "model"),
    # Bounded before anything is forwarded (issue 16, finding 9).
    ({**CMPL, "stream": True, "stream_options": {"include_usage": True, "bogus": True}}, "stream_options.bogus"),
    ({**CMPL, "stream": True, "stream_options": {"x" * 5000: True}}, "stream_options." + "x" * 64 + "…"),
    ({**CMPL, "stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({**CMPL, "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({**CMPL, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({**CMPL, "logit_bias": {"not-an-id": 1}}, "logit_bias.not-an-id"),
    ({"model": "m"}, "prompt"),
    ({**CMPL, "model": 5}, "model"),
    ({**CMPL, "max_tokens": "16"}, "max_tokens"),
    ({**CMPL, "max_tokens": 16.0}, "max_tokens"),
    ({**CMPL, "max_tokens": True}, "max_tokens"),
    ({**CMPL, "max_tokens": 0}, "max_tokens"),
    ({**CMPL, "max_tokens": -1}, "max_tokens"),
    ({**CMPL, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),  # refused before a prefill is spent on it
    ({**CMPL, "stream": "true"}, "stream"),
    ({**CMPL, "stream": 1}, "stream"),
    ({**CMPL, "temperature": 3}, "temperature"),
    ({**CMPL, "temperature": -0.1}, "temperature"),
    ({**CMPL, "temperature": "0.7"}, "temperature"),
    ({**CMPL, "temperature": True}, "temperature"),
    (raw_with(CMPL, "temperature", "NaN"), "temperature"),
    (raw_with(CMPL, "temperature", "Infinity"), "temperature"),
    (raw_with(CMPL, "temperature", "-Infinity"), "temperature"),
    ({**CMPL, "top_p": 0}, "top_p"),
    ({**CMPL, "top_p": 1.5}, "top_p"),
    ({**CMPL, "top_k": -2}, "top_k"),
    ({**CMPL, "min_p": 2}, "min_p"),
    ({**CMPL, "presence_penalty": -3}, "presence_penalty"),
    ({**CMPL, "frequency_penalty": 2.5}, "frequency_penalty"),
    ({**CMPL, "repetition_penalty": 0}, "repetition_penalty"),
    ({**CMPL, "n": 2}, "n"),
    ({**CMPL, "n": 0}, "n"),
    ({**CMPL, "best_of": 2}, "best_of"),
    ({**CMPL, "frobnicate": 1}, "frobnicate"),
    ({**CMPL, "messages": []}, "messages"),
    ({**CMPL, "prompt": ""}, "prompt"),
    ({**CMPL, "prompt": []}, "prompt"),
    ({**CMPL, "prompt": None}, "prompt"),
    ({**CMPL, "prompt": ["a", "b"]}, "prompt"),
    ({**CMPL, "prompt": [1, "a"]}, "prompt"),
    ({**CMPL, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CMPL, "stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CMPL, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({**CMPL, "stop": 5}, "stop"),
    ({**CMPL, "stop": ["x"] * 17}, "stop"),
    ({**CMPL, "stop_token_ids": [1.5]}, "stop_token_ids[0]"),
    ({**CMPL, "logprobs": 21}, "logprobs"),
    ({**CMPL, "logprobs": True}, "logprobs"),
    ({**CMPL, "logit_bias": {"50256": 101}}, "logit_bias.50256"),
    ({**CMPL, "echo": "yes"}, "echo"),
    ({**CMPL, "suffix": "tail"}, "suffix"),
    ({**CMPL, "seed": 1.5}, "seed"),
    ({**CMPL, "min_tokens": -1}, "min_tokens"),
    ({**CMPL, "ignore_eos": "false"}, "ignore_eos"),
]

BAD_CHATS = [
    ({**CHAT, "max_completion_tokens": 2, "max_tokens": 50, "min_tokens": 3}, "min_tokens"),
    (b"", None),
    (b"{]", None),
    (b"[]", None),
    (b"true", None),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\xc3\x28"}]}', None),
    ({"messages": CHAT["messages"]}, "model"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "prompt": "hi"}, "messages"),  # the missing field is reported first
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": "hello"}, "messages"),
    ({**CHAT, "messages": [None]}, "messages[0]"),
    (with_msg(role="robot", content="x"), "messages[0].role"),
    (with_msg(role="tool", content="x"), "messages[0].role"),
    (with_msg(content="x"), "messages[0].role"),
    (with_msg(role="user"), "messages[0].content"),
    (with_msg(role="user", content=None), "messages[0].content"),
    (with_msg(role="user", content=[]), "messages[0].content"),
    (with_msg(role="user", content=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]), "messages[0].content"),
    (with_msg(role="user", content=[{"type": "text"}]), "messages[0].content"),
    (with_msg(role="user", content="x", name=7), "messages[0].name"),
    (with_msg(role="user", content="x", tool_calls=[]), "messages[0].tool_calls"),
    ({**CHAT, "messages": [CHAT["messages"][0], {"role": "user", "content": 3}]}, "messages[1].content"),
    ({**CHAT, "max_tokens": "16"}, "max_tokens"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "max_completion_tokens": -5}, "max_completion_tokens"),
    ({**CHAT, "stream": "true"}, "stream"),
    ({**CHAT, "temperature": 3}, "temperature"),
    (raw_with(CHAT, "temperature", "NaN"), "temperature"),
    (raw_with(CHAT, "top_p", "Infinity"), "top_p"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "best_of": 2}, "best_of"),
    ({**CHAT, "functions": []}, "functions"),
    ({**CHAT, "logprobs": 1}, "logprobs"),
    ({**CHAT, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CHAT, "stop": [None]}, "stop"),
]


def _check_bad(raw: bytes, kind, param):
    with pytest.raises(ApiError) as info:
        parse_body(raw, kind)
    error = info.value
    assert error.status == 400
    body = error.body()["error"]
    assert set(body) >= {"message", "type", "param"}
    assert body["type"] == "invalid_request_error"
    assert isinstance(body["message"], str) and body["message"]
    assert body["param"] == param
    if param is not None:
        assert param in body["message"]
    json.dumps(error.body())  # serialisable as the response body
    return error


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS, ids=lambda v: repr(v)[:60])
def test_bad_completion_bodies(body, param):
    _check_bad(enc(body), CompletionRequest, param)


@pytest.mark.parametrize("body, param", BAD_CHATS, ids=lambda v: repr(v)[:60])
def test_bad_chat_bodies(body, param):
    _check_bad(enc(body), ChatCompletionRequest, param)


@pytest.mark.parametrize(
    "raw, code",
    [
        (b"\xff\xfe\xfd", "invalid_encoding"),
        (b'{"model": "\xed\xa0\x80", "prompt": "x"}', "invalid_encoding"),  # a surrogate, UTF-8-encoded
        (b'{"model": "m", "prompt": "\\ud800"}', "invalid_encoding"),  # a lone surrogate escape
        (b'{"model": "m", "prompt": "x\\udfff"}', "invalid_encoding"),
        (b"{", "invalid_json"),
        (b"[]", "invalid_json"),
    ],
)
def test_body_level_errors_have_codes(raw, code):
    with pytest.raises(ApiError) as info:
        parse_body(raw, CompletionRequest)
    assert info.value.code == code


def test_a_surrogate_pair_escape_is_text():
    """What json.dumps writes for an emoji by default (ensure_ascii) parses: a pair, not a lone half."""
    _, parsed = parse_body(b'{"model": "m", "prompt": "hi \\ud83d\\ude00 and a literal \\\\ud800"}', CompletionRequest)
    assert parsed.prompt == "hi \U0001f600 and a literal \\ud800"


@pytest.mark.parametrize("kind", [CompletionRequest, ChatCompletionRequest])
def test_body_over_the_limit_is_413(kind):
    raw = json.dumps(CMPL if kind is CompletionRequest else CHAT).encode()
    raw += b" " * (MAX_BODY_BYTES + 1 - len(raw))
    assert len(raw) == MAX_BODY_BYTES + 1
    with pytest.raises(ApiError) as info:
        parse_body(raw, kind)
    assert info.value.status == 413
    assert info.value.body()["error"]["type"] == "invalid_request_error"
    # one byte less is within the limit and parses
    parse_body(raw[:-1], kind)


def test_a_longer_context_reads_a_larger_body():
    """A model whose context holds a prompt larger than 4 MiB of JSON gets the room for it (32
    bytes a token); a short context never less than 4 MiB."""
    from dpd.router.protocol import body_limit_bytes

    assert body_limit_bytes(2048) == body_limit_bytes(131_072) == MAX_BODY_BYTES
    limit = body_limit_bytes(1_048_576)
    assert limit == 32 * 1_048_576
    raw = json.dumps(CMPL).encode()
    raw += b" " * (limit - len(raw))
    parse_body(raw, CompletionRequest, limit)
    with pytest.raises(ApiError) as info:
        parse_body(raw + b" ", CompletionRequest, limit)
    assert info.value.status == 413 and str(limit) in info.value.message


@pytest.mark.parametrize("param", ["n", "best_of"])
def test_n_and_best_of_say_one_choice(param):
    with pytest.raises(ApiError, match="must be 1"):
        parse_body(enc({**CMPL, param: 3}), CompletionRequest)


@pytest.mark.parametrize("value", [True, 1.0])
@pytest.mark.parametrize("param", ["n", "best_of"])
def test_n_and_best_of_are_strict_integers(param, value):
    with pytest.raises(ApiError):
        parse_body(enc({**CMPL, param: value}), CompletionRequest)


def test_a_body_too_deep_to_re_encode_is_a_400(monkeypatch):
    """The lone-surrogate check re-encodes the body; nested just deep enough to load but not to
    dump, that is a 400 as well, never a 500."""
    import dpd.router.protocol as protocol

    def too_deep(*args, **kwargs):
        raise RecursionError

    monkeypatch.setattr(protocol.json, "dumps", too_deep)
    with pytest.raises(ApiError) as info:
        parse_body(b'{"model": "m", "prompt": "\\ud800"}', CompletionRequest)
    assert info.value.status == 400 and info.value.code == "invalid_json"


@pytest.mark.parametrize(
    "raw",
    [b"[" * 100_000, b'{"model": "m", "prompt": "x", "seed": ' + b"1" * 5000 + b"}"],
    ids=["deeply-nested", "huge-integer"],
)
def test_pathological_json_is_a_400(raw):
    with pytest.raises(ApiError) as info:
        parse_body(raw, CompletionRequest)
    assert info.value.status == 400


GOOD_COMPLETIONS = [
    CMPL,
    {**CMPL, "prompt": [1, 2, 3]},
    {**CMPL, "prompt": [0]},
    {**CMPL, "max_tokens": 1, "temperature": 0, "top_p": 1, "seed": 7},
    {**CMPL, "temperature": 2, "top_p": 0.01, "n": 1, "best_of": 1, "max_tokens": None},
    {**CMPL, "stream": True, "stream_options": {"include_usage": True}},
    {**CMPL, "stream": None},
    {**CMPL, "stop": "\n"},
    {**CMPL, "stop": ["a", "b"], "stop_token_ids": [2]},
    {**CMPL, "logprobs": 0, "echo": False},
    {**CMPL, "logprobs": 20},
    {**CMPL, "logit_bias": {"50256": -100}},
    {**CMPL, "top_k": -1, "min_p": 0.05, "repetition_penalty": 1.1},
    {**CMPL, "top_k": 40, "min_tokens": 4, "ignore_eos": True, "skip_special_tokens": False},
    {**CMPL, "include_stop_str_in_output": True, "presence_penalty": -2, "frequency_penalty": 2},
    {**CMPL, "user": "alice", "suffix": None},
]

GOOD_CHATS = [
    CHAT,
    with_msg(role="user", content=""),
    with_msg(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
    with_msg(role="developer", content="be brief", name="ops"),
    {
        **CHAT,
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": [{"type": "text", "text": "u2"}]},
        ],
    },
    {**CHAT, "max_completion_tokens": 8, "logprobs": True, "top_logprobs": 5},
    {**CHAT, "stream": True, "stream_options": {"include_usage": False}},
    {**CHAT, "top_k": 20, "min_tokens": 1, "ignore_eos": True, "repetition_penalty": 1.0},
    {**CHAT, "max_tokens": 4, "min_tokens": 4},
    {  # an earlier turn's reasoning sent back, in either of the engines' fields
        **CHAT,
        "messages": [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a", "reasoning": "r"},
            {"role": "assistant", "content": "b", "reasoning_content": "r2"},
            {"role": "user", "content": "u2"},
        ],
    },
]


@pytest.mark.parametrize("body, kind, says", [
    ({**CMPL, "temperature": "0.7"}, CompletionRequest, "Invalid value for 'temperature': Input should be a valid integer "
                                                        "or a valid number."),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     ChatCompletionRequest, "Input should be a valid string or at 'messages[0].content[0].type': Input should be 'text' "
                            "(dpd accepts text content parts only)."),
])
def test_a_field_of_several_forms_says_what_each_wanted(body, kind, says):
    with pytest.raises(ApiError) as info:
        parse_body(enc(body), kind)
    assert info.value.body()["error"]["message"].endswith(says)


@pytest.mark.parametrize("prompt, forwarded", [(["hello"], "hello"), ([[1, 2, 3]], [1, 2, 3])])
def test_a_list_of_one_prompt_is_that_prompt(prompt, forwarded):
    """LangChain's OpenAI LLM (and other SDK wrappers) send ``prompt`` as a list even for one."""
    raw_body, parsed = parse_body(enc({**CMPL, "prompt": prompt}), CompletionRequest)
    assert raw_body["prompt"] == parsed.prompt == forwarded


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]], ["a", [1]]])
def test_several_prompts_in_one_request_are_refused_by_name(prompt):
    error = _check_bad(enc({**CMPL, "prompt": prompt}), CompletionRequest, "prompt")
    assert "one prompt per request" in error.body()["error"]["message"]


@pytest.mark.parametrize("body", GOOD_COMPLETIONS, ids=lambda v: repr(v)[:60])
def test_good_completion_bodies(body):
    raw_body, parsed = parse_body(enc(body), CompletionRequest)
    assert raw_body == body  # the client's object, exactly as written, is what gets forwarded
    assert isinstance(parsed, CompletionRequest)
    assert parsed.prompt == body["prompt"]


@pytest.mark.parametrize("body", GOOD_CHATS, ids=lambda v: repr(v)[:60])
def test_good_chat_bodies(body):
    raw_body, parsed = parse_body(enc(body), ChatCompletionRequest)
    assert raw_body == body
    assert isinstance(parsed, ChatCompletionRequest)
    assert [m.role for m in parsed.messages] == [m["role"] for m in body["messages"]]


def test_vllm_extras_are_parsed_values():
    _, parsed = parse_body(enc({**CMPL, "top_k": 5, "min_tokens": 2, "ignore_eos": True}), CompletionRequest)
    assert (parsed.top_k, parsed.min_tokens, parsed.ignore_eos) == (5, 2, True)


@pytest.mark.parametrize(
    "body, kind, expected",
    [
        (CMPL, CompletionRequest, None),
        ({**CMPL, "max_tokens": 32}, CompletionRequest, 32),
        (CHAT, ChatCompletionRequest, None),
        ({**CHAT, "max_tokens": 32}, ChatCompletionRequest, 32),
        ({**CHAT, "max_completion_tokens": 16}, ChatCompletionRequest, 16),
        ({**CHAT, "max_tokens": 32, "max_completion_tokens": 16}, ChatCompletionRequest, 16),
        ({**CHAT, "max_tokens": 32, "max_completion_tokens": None}, ChatCompletionRequest, 32),
    ],
)
def test_requested_max_tokens(body, kind, expected):
    _, parsed = parse_body(enc(body), kind)
    assert requested_max_tokens(parsed) == expected
