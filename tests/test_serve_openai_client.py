"""The HTTP server as a user of the official ``openai`` SDK meets it (test_serve's live uvicorn
server, reused): every response and stream chunk validates against the SDK's own pydantic types
(``model_validate``, not the SDK's lenient ``construct``: no None where the SDK requires a value);
chat completions streamed and not (role first, deltas, one finish reason, the usage chunk);
the SDK's structured-output helpers (``chat.completions.parse`` / ``.stream`` with a pydantic
model, json_schema and json_object response formats); max_tokens / stop / seed; the request
shapes the API reference allows and the SDK sends (``n`` / ``stream`` / ``echo`` as null, text
content parts, an earlier reply appended back with ``model_dump()``, stream_options'
include_obfuscation); ``models.list`` / ``models.retrieve``; errors as the SDK's exception classes
with the OpenAI error body (``e.body``, ``e.status_code``, ``e.param``); no retry on a 4xx, a
retry honouring Retry-After on a 429; an error mid-stream raised by the SDK as an APIError.

test_serve.py covers the tokens themselves (greedy output equals tinyloop's), TinyLoop's knobs,
completions stop strings and the raw bad-input table; this file does not repeat them."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from openai.types import Completion, Model  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from tinyloop.errors import BackendError  # noqa: E402
from tinyloop.runtime.config import GenerateStats  # noqa: E402
from tinyloop.serve.worker import Job  # noqa: E402

from test_serve import live  # noqa: E402,F401  (the module's live server: the demo model, queue_size 1)
from test_serve_edges import _failing_after  # noqa: E402

#: A plain chat template for the demo model (which has none), set on the live server's tokenizer.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
CONVO = [{"role": "user", "content": "write a function"}]
#: A conversation after which the demo model closes its constrained JSON within the token budget
#: greedily (the grammar allows free whitespace, which a code model likes to run on in).
JSON_CONVO = [{"role": "user", "content": "give the person as JSON"}]


@pytest.fixture(scope="module")
def client(live):  # noqa: F811
    """The SDK as a user builds it (no retries here: the retry tests make their own)."""
    tok = live.model.tokenizer
    before, tok.chat_template = tok.chat_template, TEMPLATE
    yield openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    tok.chat_template = before


def strict(obj):
    """`obj` (what the SDK built leniently from the server's JSON) validates against its own SDK
    type, strictly: every required field present and of its declared type."""
    return type(obj).model_validate(obj.to_dict())


# =============================================================================== models
def test_models_list_and_retrieve(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    for m in models.data:
        Model.model_validate(m.to_dict())
    m = client.models.retrieve("demo")
    assert strict(m).id == "demo" and m.object == "model" and isinstance(m.created, int) and m.owned_by
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert e.value.status_code == 404 and e.value.body["param"] == "model" and "gpt-9" in e.value.body["message"]


def test_an_unknown_route_answers_an_openai_error_object(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.get("/no/such/route", cast_to=object)
    assert set(e.value.body) >= {"message", "type", "param", "code"}, e.value.body


# =============================================================================== completions
def test_completion_parses_strictly(client):
    r = strict(client.completions.create(model="demo", prompt="def ", max_tokens=5, temperature=0))
    assert isinstance(r, Completion) and r.id.startswith("cmpl-") and r.model == "demo"
    assert r.choices[0].finish_reason == "length" and r.choices[0].index == 0 and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 5
    # max_tokens 0: no text, still a finish reason the SDK accepts
    z = strict(client.completions.create(model="demo", prompt="def ", max_tokens=0))
    assert z.choices[0].text == "" and z.choices[0].finish_reason == "length" and z.usage.completion_tokens == 0


def _completion_chunks(stream):
    """The chunks of a streamed completion, each validated (a text completion chunk's finish_reason
    is null until the last one, as OpenAI streams it, though CompletionChoice types it non-null)."""
    out = []
    for c in stream:
        d = c.to_dict()
        for ch in d["choices"]:
            assert ch["finish_reason"] in (None, "stop", "length")
            ch["finish_reason"] = ch["finish_reason"] or "length"
        Completion.model_validate(d)
        out.append(c)
    return out


def test_completion_stream_chunks(client):
    whole = client.completions.create(model="demo", prompt="def ", max_tokens=6, temperature=0)
    chunks = _completion_chunks(client.completions.create(model="demo", prompt="def ", max_tokens=6,
                                                           temperature=0, stream=True))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks)            # no usage chunk unless asked for
    # include_usage, and stream_options' include_obfuscation (an SDK field; nothing is obfuscated here)
    chunks = _completion_chunks(client.completions.create(
        model="demo", prompt="def ", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_nullable_fields_sent_as_null(client):
    """The API reference types n, stream, echo as "or null" (a client may send them explicitly
    as null): null is the default, not a 400."""
    r = client.completions.create(model="demo", prompt="def ", max_tokens=3, temperature=0, n=None,
                                  stream=None, echo=None)
    assert strict(r).choices[0].finish_reason == "length"
    r = client.chat.completions.create(model="demo", messages=CONVO, max_tokens=3, temperature=0, n=None,
                                       stream=None)
    assert strict(r).choices[0].message.role == "assistant"


# =============================================================================== chat completions
def test_chat_completion_and_its_stream_parse_strictly(client):
    r = strict(client.chat.completions.create(model="demo", messages=CONVO, max_tokens=8, temperature=0))
    assert isinstance(r, ChatCompletion) and r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str) and c.finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8

    chunks = [strict(x) for x in client.chat.completions.create(
        model="demo", messages=CONVO, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})]
    assert all(isinstance(x, ChatCompletionChunk) and x.object == "chat.completion.chunk" for x in chunks)
    assert len({x.id for x in chunks}) == 1 and len({x.created for x in chunks}) == 1
    body, usage = chunks[:-1], chunks[-1]
    assert body[0].choices[0].delta.role == "assistant"
    assert all(x.choices[0].delta.role is None for x in body[1:])
    assert "".join(x.choices[0].delta.content or "" for x in body) == c.message.content
    assert [x.choices[0].finish_reason for x in body] == [None] * (len(body) - 1) + ["length"]
    assert usage.choices == [] and usage.usage.model_dump() == r.usage.model_dump()
    assert all(x.usage is None for x in body)


def test_chat_max_tokens_stop_and_seed(client):
    full = client.chat.completions.create(model="demo", messages=CONVO, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    r = client.chat.completions.create(model="demo", messages=CONVO, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and text.startswith(r.choices[0].message.content)
    stop = text.strip()[2:5]
    assert stop and text.find(stop) > 0
    r = client.chat.completions.create(model="demo", messages=CONVO, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].message.content == text[:text.find(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="demo", messages=CONVO, max_tokens=24, temperature=0,
                                                 stop=stop, stream=True))
    assert "".join(x.choices[0].delta.content or "" for x in chunks) == text[:text.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    a, b = (client.chat.completions.create(model="demo", messages=CONVO, max_tokens=8, temperature=0.9, seed=11)
            for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content


def test_message_shapes_the_sdk_sends(client):
    """Text content parts (joined by newlines), and the previous reply appended back to the
    conversation, as the object or as its model_dump() (refusal, audio, function_call,
    annotations all null), render like the plain string messages."""
    want = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "a\nb"}],
                                          max_tokens=4, temperature=0).choices[0].message.content
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": parts}], max_tokens=4,
                                       temperature=0)
    assert r.choices[0].message.content == want
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert "text" in e.value.body["message"] and e.value.body["param"].startswith("messages")

    first = client.chat.completions.create(model="demo", messages=CONVO, max_tokens=4, temperature=0).choices[0]
    plain = CONVO + [{"role": "assistant", "content": first.message.content}, {"role": "user", "content": "more"}]
    want = client.chat.completions.create(model="demo", messages=plain, max_tokens=4, temperature=0)
    for reply in (first.message, first.message.model_dump()):
        r = client.chat.completions.create(model="demo", messages=CONVO + [reply, {"role": "user", "content": "more"}],
                                           max_tokens=4, temperature=0)
        assert r.choices[0].message.content == want.choices[0].message.content
        assert r.usage.prompt_tokens == want.usage.prompt_tokens


# =============================================================================== structured outputs
class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=99)


def test_parse_helper_with_a_pydantic_model(client):
    """chat.completions.parse sends the model's strict json_schema; the reply's content parses
    into it (message.parsed) and validates with jsonschema."""
    r = client.chat.completions.parse(model="demo", messages=JSON_CONVO, max_tokens=60, temperature=0,
                                      response_format=Person)
    c = r.choices[0]
    assert c.finish_reason == "stop" and isinstance(c.message.parsed, Person)
    jsonschema.validate(json.loads(c.message.content), Person.model_json_schema())
    # the streaming helper accumulates the chunks into the same parsed completion
    with client.chat.completions.stream(model="demo", messages=JSON_CONVO, max_tokens=60, temperature=0,
                                        response_format=Person) as s:
        deltas = [ev.delta for ev in s if ev.type == "content.delta"]
        final = s.get_final_completion()
    assert "".join(deltas) == c.message.content and final.choices[0].message.parsed == c.message.parsed
    assert final.choices[0].finish_reason == "stop"


def test_response_format_json_schema_and_json_object(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 2}},
              "required": ["ok", "tags"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "flags", "strict": True, "schema": schema}}
    r = client.chat.completions.create(model="demo", messages=JSON_CONVO, max_tokens=60, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # json_object: a JSON object (not any JSON value), streamed and not
    for temperature in (0, 1.0):
        r = client.chat.completions.create(model="demo", messages=CONVO, max_tokens=80, temperature=temperature,
                                           seed=None if temperature == 0 else 5,
                                           response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
        assert r.choices[0].message.content.lstrip().startswith("{"), r.choices[0].message.content
    r = client.completions.create(model="demo", prompt="x = ", max_tokens=40, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.lstrip().startswith("{"), r.choices[0].text


# =============================================================================== errors
@pytest.mark.parametrize("kw, param", [
    (dict(n=2), "n"), (dict(logprobs=True), "logprobs"), (dict(logprobs=True, top_logprobs=2), "logprobs"),
    (dict(max_tokens=-1), "max_tokens"), (dict(temperature="hot"), "temperature"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
])
def test_bad_arguments_raise_bad_request_with_the_error_body(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": "demo", "messages": CONVO, "max_tokens": 2, **kw})
    err = e.value
    assert err.status_code == 400 and set(err.body) == {"message", "type", "param", "code"}
    assert err.param == param and err.body["param"] == param and err.message and err.body["message"]
    assert err.response.headers["content-type"].startswith("application/json")


def test_unknown_model_is_not_found(client):
    for call in (lambda: client.completions.create(model="gpt-9", prompt="x", max_tokens=2),
                 lambda: client.chat.completions.create(model="gpt-9", messages=CONVO, max_tokens=2),
                 lambda: client.chat.completions.create(model="gpt-9", messages=CONVO, max_tokens=2, stream=True)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.status_code == 404 and e.value.param == "model" and "gpt-9" in e.value.message


def test_a_4xx_is_not_retried(live, client):  # noqa: F811
    """A client with retries enabled sends a 400 / 404 request once (the SDK retries only 408,
    409, 429 and 5xx)."""
    retrying = client.with_options(max_retries=3)
    chat = retrying.chat.completions
    for route, call, code in [
            ("/v1/completions", lambda: retrying.completions.create(model="demo", prompt="x", n=2), "400"),
            ("/v1/chat/completions", lambda: chat.create(model="demo", messages=CONVO, n=2), "400"),
            ("/v1/chat/completions", lambda: chat.create(model="nope", messages=CONVO), "404")]:
        labels = f'{{code="{code}",route="{route}"}}'
        before = live.metric("tinyloop_requests_total", labels)
        with pytest.raises(openai.APIStatusError):
            call()
        assert live.metric("tinyloop_requests_total", labels) == before + 1, route


def test_a_429_is_retried_after_retry_after(live, client):  # noqa: F811
    """A full queue is a 429 with Retry-After: the SDK (max_retries 2) waits and retries, and
    the retry is served once the queue has room."""
    worker = live.app.state.served.worker
    release = threading.Event()

    def held():
        release.wait(60)
        yield from ()
    labels = '{code="429",route="/v1/chat/completions"}'
    before = live.metric("tinyloop_requests_total", labels)
    worker.submit([Job(tokens=held(), stats=GenerateStats(), sink=lambda ev: None)])      # running
    t0 = time.time()
    while not (worker.running == 1 and worker.queue.qsize() == 0):
        assert time.time() - t0 < 30
        time.sleep(0.01)
    worker.submit([Job(tokens=held(), stats=GenerateStats(), sink=lambda ev: None)])      # the queue is full

    def release_after_the_429():
        t0 = time.time()
        while live.metric("tinyloop_requests_total", labels) == before and time.time() - t0 < 30:
            time.sleep(0.02)
        release.set()
    releaser = threading.Thread(target=release_after_the_429)
    releaser.start()
    try:
        raw = client.with_options(max_retries=2).chat.completions.with_raw_response.create(
            model="demo", messages=CONVO, max_tokens=2, temperature=0)
    finally:
        release.set()
        releaser.join()
    assert raw.retries_taken >= 1 and raw.parse().usage.completion_tokens == 2
    assert live.metric("tinyloop_requests_total", labels) == before + raw.retries_taken


def test_an_error_mid_stream_raises_an_api_error(client, monkeypatch):
    """A failure while decoding a stream (after the 200 and the first chunks) is an error event
    the SDK raises as openai.APIError with the server's message and body."""
    from tinyloop.serve import app as app_mod
    monkeypatch.setattr(app_mod, "_token_iter", _failing_after(2, BackendError("boom: the device failed")))
    got = []
    with pytest.raises(openai.APIError) as e:
        for chunk in client.chat.completions.create(model="demo", messages=CONVO, max_tokens=8, temperature=0,
                                                    stream=True):
            got.append(chunk)
    assert "boom" in e.value.message and e.value.body["message"].startswith("boom")
    assert got and got[0].choices[0].delta.role == "assistant"
