"""Edges of the HTTP server as a user of an OpenAI-compatible client meets them, against a live
uvicorn server on 127.0.0.1 (test_serve's, with test_serve_edges' worker hold): the metrics of a
request are counted before its answer goes out (a client that scrapes /metrics right after its
completion sees it); error objects shaped as OpenAI's (an unknown model is type
invalid_request_error with code model_not_found, a full queue carries code rate_limit_exceeded);
a model id with a slash (``org/name``, as the SDK percent-encodes it) is retrievable; OpenAI's
temperature range (0 to 2) and finite numbers only; a body that is not a JSON object, not JSON
by its Content-Type, or not UTF-8 is a 400 that says so; a body over ``max_body_bytes`` is a
413 answered before it is read; chat messages without content are refused (not rendered as the
text "None"); a TinyLoop error about one field names it as the body's field (``param``); a
request without max_tokens is not refused for the default the server chose when the prompt leaves
less room; text with lone surrogates is a 400 naming its field; stream shapes and whole
characters in deltas."""

from __future__ import annotations

import json
import socket
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")

import tinyloop as tl  # noqa: E402
from tinyloop.runtime.config import GenerateStats  # noqa: E402
from tinyloop.serve import ServeConfig  # noqa: E402
from tinyloop.serve.worker import Job  # noqa: E402

from test_serve import Live as PlainLive, expected  # noqa: E402
from test_serve_edges import Live  # noqa: E402  (test_serve's live server with hold() and wait_finished())
from test_serve_openai_client import CONVO, TEMPLATE  # noqa: E402

#: A model id as Hugging Face names them (the SDK sends it percent-encoded in /v1/models/{model}).
NAME = "tinyloop/demo-7m"
MAX_SEQ = 64


@pytest.fixture(scope="module")
def srv():
    s = Live(ServeConfig(backend="cpu", model_name=NAME, max_seq_len=MAX_SEQ, queue_size=1))
    tok = s.model.tokenizer
    before, tok.chat_template = tok.chat_template, TEMPLATE
    yield s
    tok.chat_template = before
    s.close()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def post(srv, body, path="/v1/completions", **kw):
    return httpx.post(srv.url + path, json={"model": NAME, **body}, timeout=60, **kw)


def raw(srv, content, content_type="application/json", path="/v1/completions"):
    headers = {} if content_type is None else {"content-type": content_type}
    return httpx.post(srv.url + path, content=content, headers=headers, timeout=60)


def error_of(r, status=400):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def samples(srv):
    """{(name, sorted labels): value} of /metrics, parsed as Prometheus text."""
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in parser.text_string_to_metric_families(text) for s in fam.samples}


# =============================================================================== metrics
def test_a_request_is_counted_before_its_answer(srv, monkeypatch):
    """The worker handed the "done" event to the client before it counted the request: a client
    that scraped /metrics right after its completion could see its tokens, prompt tokens and
    stop reason not counted yet (about 2 in 5 in-process; the counting is slowed down here so the
    order shows every time)."""
    import time
    inner = srv.worker.on_finish

    def slow(job):
        time.sleep(0.25)
        inner(job)
    monkeypatch.setattr(srv.worker, "on_finish", slow)
    gen, prompt = ("tinyloop_generated_tokens_total", ()), ("tinyloop_prompt_tokens_total", ())
    stops = ("tinyloop_stop_reasons_total", (("reason", "MAX_TOKENS"),))
    for i in range(4):
        before = samples(srv)
        body = {"prompt": "def ", "max_tokens": 2 + i, "temperature": 0}
        if i % 2:
            streamed = {"model": NAME, **body, "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json=streamed) as r:
                lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            usage = json.loads(lines[-2])["usage"]
        else:
            usage = post(srv, body).json()["usage"]
        after = samples(srv)
        assert after[gen] - before.get(gen, 0) == usage["completion_tokens"] == body["max_tokens"], i
        assert after[prompt] - before.get(prompt, 0) == usage["prompt_tokens"], i
        assert after[stops] - before.get(stops, 0) == 1, i


# =============================================================================== error objects
def test_an_unknown_model_is_openais_model_not_found(srv, client):
    """OpenAI answers an unknown model with type invalid_request_error and code model_not_found;
    the server had type model_not_found and code null (a client testing e.code missed it)."""
    for r in (post(srv, {"model": "gpt-9", "prompt": "x"}),
              post(srv, {"model": "gpt-9", "messages": CONVO}, "/v1/chat/completions"),
              post(srv, {"model": "gpt-9", "messages": CONVO, "stream": True}, "/v1/chat/completions"),
              httpx.get(srv.url + "/v1/models/gpt-9", timeout=10)):
        err = error_of(r, 404)
        assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "model_not_found", "model"), err
        assert "gpt-9" in err["message"] and NAME in err["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    assert e.value.code == "model_not_found" and e.value.type == "invalid_request_error"


def test_a_full_queue_is_a_429_with_openais_code(srv):
    release = threading.Event()

    def held():
        release.wait(60)
        yield from ()
    release_running, _ = srv.hold()
    try:
        waiting = Job(tokens=held(), stats=GenerateStats(), sink=lambda ev: None)
        srv.worker.submit([waiting])                      # queue_size 1: the queue is full now
        r = post(srv, {"prompt": "x", "max_tokens": 1})
        err = error_of(r, 429)
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error", err
        assert "queue" in err["message"] and int(r.headers["Retry-After"]) >= 0
    finally:
        release.set()
        release_running.set()
    srv.wait_finished(waiting)


def test_a_model_id_with_a_slash_is_retrievable(srv, client):
    """The SDK sends models.retrieve("org/name") as /v1/models/org%2Fname, which the ASGI server
    decodes to two path segments: the single-segment route answered a plain 404 "Not Found"."""
    m = client.models.retrieve(NAME)
    assert m.id == NAME and m.object == "model"
    assert [x.id for x in client.models.list().data] == [NAME]
    r = client.completions.create(model=NAME, prompt="def ", max_tokens=2, temperature=0)
    assert r.model == NAME and r.usage.completion_tokens == 2
    for other in ("tinyloop/other", "a/b/c"):
        err = error_of(httpx.get(srv.url + "/v1/models/" + other, timeout=10), 404)
        assert err["code"] == "model_not_found" and other in err["message"], err


# =============================================================================== request bodies
def test_temperature_is_openais_range_and_numbers_are_finite(srv):
    """OpenAI's temperature is 0 to 2; the server took up to 100 (a 200 where OpenAI says 400).
    NaN and Infinity (which Python's JSON reader accepts) were refused as 'less than or equal to
    100' or not at all (timeout)."""
    r = post(srv, {"prompt": "def ", "max_tokens": 2, "temperature": 2, "seed": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    for t in (2.01, 3, 100):
        err = error_of(post(srv, {"prompt": "x", "max_tokens": 1, "temperature": t}))
        assert err["param"] == "temperature" and "2" in err["message"], err
    for field in ("temperature", "top_p", "timeout", "repetition_penalty"):
        for token in ("NaN", "Infinity", "-Infinity"):
            body = '{"model": "%s", "prompt": "x", "max_tokens": 1, "%s": %s}' % (NAME, field, token)
            err = error_of(raw(srv, body))
            assert err["param"] == field and "finite" in err["message"], (field, token, err)


def test_a_body_that_is_not_a_json_object_says_what_is_expected(srv):
    """A JSON body sent as text/plain (or with no Content-Type) was refused as 'body: Input should
    be a valid dictionary or object to extract fields from'; a non-UTF-8 body as 'There was an
    error parsing the body'. Each now says what the server takes."""
    body = json.dumps({"model": NAME, "prompt": "x", "max_tokens": 1})
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        err = error_of(raw(srv, body, ctype))
        assert "application/json" in err["message"] and ctype in err["message"], err
    err = error_of(raw(srv, body, None))
    assert "Content-Type" in err["message"] and "application/json" in err["message"], err
    err = error_of(raw(srv, b"[1, 2]"))
    assert "JSON object" in err["message"] and "list" in err["message"], err
    err = error_of(raw(srv, b"null"))
    assert "JSON object" in err["message"], err
    for content in (b'{"model": "x", "prompt": "\xff\xfe"}', b"\xff\xfe"):
        err = error_of(raw(srv, content))
        assert "UTF-8" in err["message"], err
    for path in ("/v1/completions", "/v1/chat/completions"):
        err = error_of(raw(srv, b"{not json", path=path))
        assert "not valid JSON" in err["message"], err
    # the same body as application/json (with a charset) is served
    assert raw(srv, body, "application/json; charset=utf-8").status_code == 200


def test_a_body_over_max_body_bytes_is_a_413_before_it_is_read():
    """A 10 MB prompt was read whole, then encoded on the event loop (about 11 s on the demo's
    tokenizer, every other stream stalled) before its 400; any size was taken. Now a body over
    max_body_bytes is a 413 with an OpenAI error object, from its Content-Length before the body
    is read (or, chunked, as it passes the limit), counted in the metrics."""
    with pytest.raises(tl.ConfigError, match="max_body_bytes"):
        ServeConfig(max_body_bytes=0)
    assert ServeConfig().max_body_bytes == 4 << 20          # docs/SERVING.md: 4 MiB
    s = PlainLive(ServeConfig(backend="cpu", max_seq_len=MAX_SEQ, max_body_bytes=4096))
    try:
        small = {"model": "demo", "prompt": "def ", "max_tokens": 1}
        assert s.post(small).status_code == 200
        big = {**small, "prompt": "x " * 4096}
        err = error_of(s.post(big), 413)
        assert "max_body_bytes" in err["message"] and "4096" in err["message"], err

        def chunks():
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i:i + 1000]
        err = error_of(httpx.post(s.url + "/v1/completions", content=chunks(), timeout=30,
                                  headers={"content-type": "application/json"}), 413)
        assert "max_body_bytes" in err["message"], err
        # a client that announces a gigabyte is answered from the header, without sending a byte of it
        port = int(s.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000000000\r\n\r\n")
            head = sock.recv(4096).decode("latin-1")
        assert head.startswith("HTTP/1.1 413"), head
        assert s.metric("tinyloop_requests_total", '{code="413",route="/v1/completions"}') == 3
        assert s.post(small).status_code == 200
    finally:
        s.close()


# =============================================================================== chat messages
@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None},
                                     {"role": "system", "content": None}, {"role": "tool", "tool_call_id": "c1"},
                                     {"role": "assistant"}])
def test_a_message_without_content_is_a_400(srv, message):
    """A user (system, tool, plain assistant) message with no content was rendered by the chat
    template as the text "None" (a 200 answering a conversation the client never wrote); OpenAI
    requires content unless an assistant message carries tool_calls or function_call."""
    err = error_of(post(srv, {"messages": CONVO + [message], "max_tokens": 1}, "/v1/chat/completions"))
    assert err["param"] == "messages.1.content" and message["role"] in err["message"], err


def test_an_assistant_tool_call_without_content_is_served(srv):
    convo = CONVO + [{"role": "assistant", "content": None,
                      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    r = post(srv, {"messages": convo, "max_tokens": 2, "temperature": 0}, "/v1/chat/completions")
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


# =============================================================================== errors name the field
@pytest.mark.parametrize("extra, param", [
    ({"loops": 99}, "loops"),
    ({"repetition_penalty": 1e9}, "repetition_penalty"),
    ({"decoder": "warp"}, "decoder"),
    ({"cache_mode": "int3"}, "cache_mode"),
    ({"early_exit_kv": "x"}, "early_exit_kv"),
    ({"stop_token_ids": [[-1]]}, "stop_token_ids"),
    ({"stop_token_ids": [[10 ** 6]]}, "stop_token_ids"),
    ({"prompt": [1, 10 ** 6]}, "prompt"),
])
def test_a_tinyloop_error_names_the_bodys_field(srv, extra, param):
    """tinyloop's own validation errors came back with param null, and the stop_token_ids ones
    named GenerateConfig's stop_sequences, a field the body does not have."""
    err = error_of(post(srv, {"prompt": "x", "max_tokens": 1, **extra}))
    assert err["param"] == param, err
    assert err["message"].startswith(param) and "stop_sequences" not in err["message"], err


# =============================================================================== max_tokens and the context
def test_the_default_max_tokens_fits_what_the_prompt_leaves(srv):
    """A request that does not set max_tokens was refused when the prompt left fewer than
    max_tokens_default (16) positions ("max_tokens (16) ... exceeds max_seq_len", a value the
    client never sent); it gets what is left, as OpenAI's chat defaults to the context left. An
    explicit max_tokens that does not fit, and a prompt that leaves no room, are 400s naming
    the field the client sent."""
    ids = (srv.model.tokenizer.encode("x = 1\n") * MAX_SEQ)[:MAX_SEQ - 5]
    r = post(srv, {"prompt": ids, "temperature": 0})
    assert r.status_code == 200, r.text
    c, usage = r.json()["choices"][0], r.json()["usage"]
    assert usage["completion_tokens"] <= 5 and usage["prompt_tokens"] == MAX_SEQ - 5
    assert c["text"] == expected(srv.model, ids, 5)
    if c["tinyloop"]["stop_reason"] == "MAX_TOKENS":
        assert usage["completion_tokens"] == 5 and c["finish_reason"] == "length"
    err = error_of(post(srv, {"prompt": ids, "max_tokens": 6}))
    assert err["param"] == "max_tokens" and str(MAX_SEQ) in err["message"], err
    err = error_of(post(srv, {"prompt": ids + ids[:5]}))
    assert err["param"] == "prompt" and str(MAX_SEQ) in err["message"], err
    # chat: the conversation leaves less than 16 positions; max_completion_tokens is named as sent
    tok = srv.model.tokenizer
    base = len(tl.apply_chat_template(srv.model, [{"role": "user", "content": ""}]))
    long = [{"role": "user", "content": tok.decode(ids[:MAX_SEQ - 8 - base])}]
    n = len(tl.apply_chat_template(srv.model, long))
    assert MAX_SEQ - 16 < n < MAX_SEQ, n
    r = post(srv, {"messages": long, "temperature": 0}, "/v1/chat/completions")
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= MAX_SEQ - n, r.text
    err = error_of(post(srv, {"messages": long, "max_completion_tokens": MAX_SEQ}, "/v1/chat/completions"))
    assert err["param"] == "max_completion_tokens", err


# =============================================================================== text
def test_lone_surrogates_are_a_400_naming_the_field(srv):
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"); a prompt or message holding one came
    back as the tokenizer's "encode failed: TextInputSequence must be str" with no field, and a
    stop string holding one could never match (silently ignored)."""
    cases = [('{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 1}' % NAME, "/v1/completions", "prompt"),
             ('{"model": "%s", "prompt": ["ok", "\\udc00"], "max_tokens": 1}' % NAME, "/v1/completions", "prompt"),
             ('{"model": "%s", "prompt": "ab", "max_tokens": 1, "stop": ["\\ud83d"]}' % NAME, "/v1/completions",
              "stop"),
             ('{"model": "%s", "messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 1}' % NAME,
              "/v1/chat/completions", "messages.0.content"),
             ('{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}], '
              '"max_tokens": 1}' % NAME, "/v1/chat/completions", "messages.0.content.0")]
    for body, path, param in cases:
        err = error_of(raw(srv, body, path=path))
        assert err["param"] == param and "surrogate" in err["message"], (body, err)
    # a surrogate pair is a character like any other
    r = raw(srv, '{"model": "%s", "prompt": "\\ud83d\\ude00 = ", "max_tokens": 1}' % NAME)
    assert r.status_code == 200, r.text


def test_stream_deltas_are_whole_characters_and_add_up(srv):
    """Multi-byte characters (emoji, CJK, accents) in prompt and output: every streamed delta is
    whole characters (a partial UTF-8 sequence is held back, never sent as U+FFFD unless the model
    itself wrote invalid UTF-8), the deltas add up to the non-streamed text, usage is the real
    token counts."""
    for prompt in ("😀 = 'é'  # ünï ", "日本語 = ", "s = '🎉"):
        whole = post(srv, {"prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        deltas = [e["choices"][0]["text"] for e in events if e["choices"]]
        text = whole["choices"][0]["text"]
        assert "".join(deltas) == text and text == expected(srv.model, prompt, 12)
        if "\ufffd" not in text:
            assert all(d.encode("utf-8").decode("utf-8") == d for d in deltas)
        assert events[-1]["usage"] == whole["usage"]
        assert whole["usage"]["prompt_tokens"] == len(tl.runtime.engine.encode_text(srv.model, prompt))


def test_several_prompts_stream_one_finish_each_and_one_usage(srv):
    """A completions stream of several prompts: each choice index streams its text then exactly
    one finish_reason, the usage chunk (choices []) sums every prompt, [DONE] ends it; the
    ``user`` field (OpenAI's end-user id, metadata) changes nothing."""
    prompts = ["def ", "import ", "class "]
    body = {"prompt": prompts, "max_tokens": 3, "temperature": 0, "user": "someone"}
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      json={"model": NAME, **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(x) for x in lines[:-1]]
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 9
    assert all(e["usage"] is None for e in events[:-1] if "usage" in e)
    for i, p in enumerate(prompts):
        mine = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == i]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
        assert "".join(c["text"] for c in mine) == expected(srv.model, p, 3)
    plain = post(srv, {**body, "user": None}).json()
    assert [c["text"] for c in plain["choices"]] == [expected(srv.model, p, 3) for p in prompts]
