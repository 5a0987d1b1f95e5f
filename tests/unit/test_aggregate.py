"""StreamAggregator folds vLLM stream chunks into the non-streaming response."""

import pytest

from dpd.router.aggregate import StreamAggregator, has_finish, is_usage_only, num_content_tokens

HEAD = {"id": "cmpl-1", "created": 1700000000, "model": "smollm2-135m"}
USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def cmpl_chunk(text="", finish_reason=None, stop_reason=None, logprobs=None, **extra):
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if stop_reason is not None:
        choice["stop_reason"] = stop_reason
    return {**HEAD, "object": "text_completion", "choices": [choice], **extra}


def chat_chunk(delta, finish_reason=None, stop_reason=None, logprobs=None):
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if stop_reason is not None:
        choice["stop_reason"] = stop_reason
    return {**HEAD, "object": "chat.completion.chunk", "choices": [choice]}


def usage_chunk(obj="text_completion"):
    return {**HEAD, "object": obj, "choices": [], "usage": USAGE}


def fold(is_chat, chunks):
    agg = StreamAggregator(is_chat)
    for chunk in chunks:
        agg.add(chunk)
    return agg


def lp(tokens, offsets):
    """vLLM completion logprobs for one chunk."""
    return {
        "text_offset": offsets,
        "token_logprobs": [-0.5] * len(tokens),
        "tokens": tokens,
        "top_logprobs": [{t: -0.5} for t in tokens],
    }


COMPLETION_CASES = [
    pytest.param(
        [cmpl_chunk("Hel"), cmpl_chunk("lo"), cmpl_chunk(" world", finish_reason="length"), usage_chunk()],
        {"text": "Hello world", "logprobs": None, "finish_reason": "length", "stop_reason": None},
        USAGE,
        id="text-then-usage",
    ),
    pytest.param(
        [cmpl_chunk("a"), cmpl_chunk(""), cmpl_chunk("b"), cmpl_chunk("", finish_reason="stop", stop_reason="\n")],
        {"text": "ab", "logprobs": None, "finish_reason": "stop", "stop_reason": "\n"},
        None,
        id="empty-finish-chunk-no-usage",
    ),
    pytest.param(
        [cmpl_chunk("", finish_reason="stop", stop_reason=2)],
        {"text": "", "logprobs": None, "finish_reason": "stop", "stop_reason": 2},
        None,
        id="eos-first",
    ),
    pytest.param(
        [
            cmpl_chunk("Hi", logprobs=lp(["Hi"], [0])),
            cmpl_chunk(" there", logprobs=lp([" there"], [2])),
            cmpl_chunk("!", finish_reason="length", logprobs=lp(["!"], [8])),
            usage_chunk(),
        ],
        {
            "text": "Hi there!",
            "logprobs": {
                "text_offset": [0, 2, 8],
                "token_logprobs": [-0.5, -0.5, -0.5],
                "tokens": ["Hi", " there", "!"],
                "top_logprobs": [{"Hi": -0.5}, {" there": -0.5}, {"!": -0.5}],
            },
            "finish_reason": "length",
            "stop_reason": None,
        },
        USAGE,
        id="logprobs-lists-concatenate",
    ),
    pytest.param(
        [cmpl_chunk("x", usage={**USAGE, "completion_tokens": 1}), cmpl_chunk("y", finish_reason="length", usage=USAGE)],
        {"text": "xy", "logprobs": None, "finish_reason": "length", "stop_reason": None},
        USAGE,
        id="continuous-usage-last-wins",
    ),
]


@pytest.mark.parametrize("chunks, choice, usage", COMPLETION_CASES)
def test_completion_fold(chunks, choice, usage):
    assert fold(False, chunks).result() == {
        **HEAD,
        "object": "text_completion",
        "choices": [{"index": 0, **choice}],
        "usage": usage,
    }


ROLE = chat_chunk({"role": "assistant", "content": ""})


def chat_lp(*tokens):
    return {"content": [{"token": t, "logprob": -1.0, "bytes": list(t.encode()), "top_logprobs": []} for t in tokens]}


CHAT_CASES = [
    pytest.param(
        [
            ROLE, chat_chunk({"content": "Hel"}), chat_chunk({"content": "lo"}), chat_chunk({}, finish_reason="stop"),
            usage_chunk("chat.completion.chunk"),
        ],
        {"role": "assistant", "content": "Hello"},
        None,
        "stop",
        USAGE,
        id="role-content-finish-usage",
    ),
    pytest.param(
        [ROLE, chat_chunk({"content": "ok"}, finish_reason="length")],
        {"role": "assistant", "content": "ok"},
        None,
        "length",
        None,
        id="content-with-finish",
    ),
    pytest.param(
        [ROLE, chat_chunk({"content": None}), chat_chunk({"content": "A"}), chat_chunk({"content": ""}, finish_reason="stop")],
        {"role": "assistant", "content": "A"},
        None,
        "stop",
        None,
        id="null-and-empty-deltas",
    ),
    pytest.param(
        [
            ROLE,
            chat_chunk({"reasoning_content": "think "}),
            chat_chunk({"reasoning_content": "hard"}),
            chat_chunk({"content": "42"}, finish_reason="stop"),
        ],
        {"role": "assistant", "content": "42", "reasoning": "think hard", "reasoning_content": "think hard"},
        None,
        "stop",
        None,
        id="reasoning-content (earlier engines)",
    ),
    pytest.param(
        [
            ROLE,
            chat_chunk({"reasoning": "think "}),  # vLLM 0.32's field
            chat_chunk({"reasoning": "hard"}),
            chat_chunk({"content": "42"}, finish_reason="stop"),
        ],
        {"role": "assistant", "content": "42", "reasoning": "think hard", "reasoning_content": "think hard"},
        None,
        "stop",
        None,
        id="reasoning",
    ),
    pytest.param(
        [
            ROLE,
            chat_chunk({"content": "Hi"}, logprobs=chat_lp("Hi")),
            chat_chunk({"content": "!"}, logprobs=chat_lp("!")),
            chat_chunk({}, finish_reason="stop"),
            usage_chunk("chat.completion.chunk"),
        ],
        {"role": "assistant", "content": "Hi!"},
        {"content": chat_lp("Hi", "!")["content"]},
        "stop",
        USAGE,
        id="logprobs",
    ),
]


@pytest.mark.parametrize("chunks, message, logprobs, finish_reason, usage", CHAT_CASES)
def test_chat_fold(chunks, message, logprobs, finish_reason, usage):
    agg = fold(True, chunks)
    assert agg.usage == usage
    assert agg.result() == {
        **HEAD,
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": None}
        ],
        "usage": usage,
    }


def test_head_is_taken_from_the_first_chunk():
    first = {**cmpl_chunk("a"), "id": "first", "model": "m1", "created": 1}
    later = {**cmpl_chunk("b", finish_reason="stop"), "id": "later", "model": "m2", "created": 2}
    result = fold(False, [first, later]).result()
    assert (result["id"], result["model"], result["created"]) == ("first", "m1", 1)
    assert result["choices"][0]["text"] == "ab"


@pytest.mark.parametrize("is_chat, obj", [(False, "text_completion"), (True, "chat.completion")])
def test_the_same_chunks_fold_by_kind(is_chat, obj):
    # a completions aggregator reads "text"; a chat aggregator reads "delta"
    chunk = {**HEAD, "choices": [{"index": 0, "text": "T", "delta": {"content": "D"}, "finish_reason": "stop"}]}
    result = fold(is_chat, [chunk]).result()
    assert result["object"] == obj
    choice = result["choices"][0]
    assert (choice["message"]["content"] if is_chat else choice["text"]) == ("D" if is_chat else "T")


@pytest.mark.parametrize(
    "chunk, expected",
    [
        (usage_chunk(), True),
        ({"choices": [], "usage": USAGE}, True),
        ({"usage": USAGE}, True),
        ({"choices": None, "usage": USAGE}, True),
        (cmpl_chunk("a"), False),
        (cmpl_chunk("a", usage=USAGE), False),
        (cmpl_chunk("", finish_reason="stop", usage=USAGE), False),
        ({"choices": [], "usage": None}, False),
        ({"choices": [], "usage": {}}, False),
        ({"choices": []}, False),
        ({}, False),
    ],
)
def test_is_usage_only(chunk, expected):
    assert is_usage_only(chunk) is expected


@pytest.mark.parametrize(
    "chunk, expected",
    [
        (cmpl_chunk("a"), 1),
        (cmpl_chunk(" "), 1),
        (cmpl_chunk("a", finish_reason="length"), 1),
        (cmpl_chunk(""), 0),
        (chat_chunk({"content": "a"}), 1),
        (chat_chunk({"reasoning_content": "hmm"}), 1),
        (chat_chunk({"reasoning": "hmm"}), 1),
        (chat_chunk({"role": "assistant", "content": ""}), 0),
        (chat_chunk({"content": None}), 0),
        (chat_chunk({}), 0),
        ({**HEAD, "choices": [{"index": 0, "delta": None}]}, 0),
        (usage_chunk(), 0),
        ({}, 0),
        ({**HEAD, "choices": [{"index": 0, "text": ""}, {"index": 1, "text": "b"}]}, 1),
    ],
)
def test_num_content_tokens(chunk, expected):
    from dpd.router.aggregate import carries_token

    assert num_content_tokens(chunk) == expected
    # the shadow times its first token by each choice, as the router counts them
    assert any(carries_token(c) for c in chunk.get("choices") or ()) == bool(expected)


@pytest.mark.parametrize(
    "chunk",
    [cmpl_chunk("", finish_reason="stop"), chat_chunk({}, finish_reason="stop")],
    ids=["completion", "chat"],
)
def test_finish_only_chunk_carries_no_content_but_a_finish(chunk):
    # The router's timer treats a leading finish-only chunk (EOS first) as the first token.
    assert num_content_tokens(chunk) == 0
    assert has_finish(chunk)
