"""The HTTP server (tinyloop.serve) against a live uvicorn server on 127.0.0.1: the official
``openai`` client, streaming and not, gives tinyloop's own tokens; TinyLoop's knobs as extra body
fields; grammars as response_format (validated with jsonschema); stop strings; the bad-input table
(every one a 4xx naming the problem, never a 5xx); a full queue is a 429 with Retry-After; a client
that disconnects mid-stream stops its generation; deadlines; metrics; a bounded soak with random
disconnects (no 5xx, nothing lost, descriptors flat)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import re
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

import tinyloop as tl  # noqa: E402
from tinyloop.serve import ServeConfig, create_app, load_serve_config  # noqa: E402

PROMPT = "The loop"


class Live:
    """A uvicorn server on a free port, in a thread."""

    def __init__(self, cfg: ServeConfig):
        self.app = create_app(cfg)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            assert time.time() - t0 < 60, "server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.model = self.app.state.served.model

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.app.state.served.close()

    def post(self, body, **kw):
        return httpx.post(self.url + "/v1/completions", json=body, timeout=60, **kw)

    def metric(self, name, labels=""):
        text = httpx.get(self.url + "/metrics", timeout=10).text
        m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def live():
    s = Live(ServeConfig(backend="cpu", max_seq_len=320, queue_size=1, scaffolds=[PROMPT]))
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)


def expected(model, prompt, max_tokens, **kw):
    """tinyloop's own completion text (run between requests: the worker is idle then)."""
    lock_wait = time.time()
    while model._lock.locked():
        assert time.time() - lock_wait < 30
        time.sleep(0.01)
    return tl.generate_text(model, prompt, tl.GenerateConfig(max_tokens=max_tokens, **kw))


# =============================================================================== the openai client
def test_openai_client_greedy_equals_tinyloop(live, client):
    r = client.completions.create(model="demo", prompt=PROMPT + " is", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].text == expected(live.model, PROMPT + " is", 12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(live.model.tokenizer.encode(PROMPT + " is"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert [m.id for m in client.models.list().data] == ["demo"]


def test_openai_client_streaming(live, client):
    whole = client.completions.create(model="demo", prompt="def ", max_tokens=20, temperature=0).choices[0].text
    chunks = list(client.completions.create(model="demo", prompt="def ", max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


def test_tinyloop_knobs_as_extra_body(live, client):
    for extra, cfg in [({"loops": 2}, dict(loops=2)),
                       ({"loops": 3, "decoder": "speculative", "options": {"draft_loops": 1, "verify_loops": 3}},
                        dict(loops=3)),
                       ({"cache_mode": "int8", "loops": 2}, dict(cache_mode="int8", loops=2)),
                       ({"repetition_penalty": 1.3}, dict(repetition_penalty=1.3))]:
        r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=10, temperature=0, extra_body=extra)
        assert r.choices[0].text == expected(live.model, PROMPT, 10, **cfg), extra
    r = client.completions.create(model="demo", prompt="x", max_tokens=8, temperature=0.8, seed=7,
                                  extra_body={"top_k": 20})
    assert r.choices[0].text == expected(live.model, "x", 8, temperature=0.8, sample_seed=7, top_k=20)
    again = client.completions.create(model="demo", prompt="x", max_tokens=8, temperature=0.8, seed=7,
                                      extra_body={"top_k": 20})
    assert again.choices[0].text == r.choices[0].text


def test_token_prompts_and_several_prompts(live):
    ids = live.model.tokenizer.encode("value = ")
    r = live.post({"model": "demo", "prompt": [ids, ids[:2]], "max_tokens": 6, "temperature": 0}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["choices"][0]["text"] == expected(live.model, "value = ", 6)
    assert r["choices"][1]["text"] == expected(live.model, ids[:2], 6)
    r = live.post({"model": "demo", "prompt": ["value = ", "def "], "max_tokens": 6, "temperature": 0}).json()
    assert [c["text"] for c in r["choices"]] == [expected(live.model, p, 6) for p in ("value = ", "def ")]
    assert r["usage"]["completion_tokens"] == 12
    e = live.post({"model": "demo", "prompt": "ab", "max_tokens": 3, "temperature": 0, "echo": True}).json()
    assert e["choices"][0]["text"].startswith("ab")
    texts = ["ab  c", "\tdef  "]                 # echoed exactly as sent, not re-decoded
    e = live.post({"model": "demo", "prompt": texts, "max_tokens": 2, "temperature": 0, "echo": True}).json()
    assert [c["text"][:len(t)] for c, t in zip(e["choices"], texts)] == texts


def test_response_format_json_schema_validates(live, client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    r = client.completions.create(model="demo", prompt="person = ", max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "p", "schema": schema}}})
    c = r.choices[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.text), schema)
    r = live.post({"model": "demo", "prompt": "n = ", "max_tokens": 12, "temperature": 0,
                   "response_format": {"type": "regex", "regex": "[0-9]{1,4}"}}).json()
    assert re.fullmatch("[0-9]{1,4}", r["choices"][0]["text"])


def test_stop_strings(live, client):
    full = expected(live.model, "def ", 30)
    stop = full[5:8]
    assert stop and full.find(stop) >= 0
    r = client.completions.create(model="demo", prompt="def ", max_tokens=30, temperature=0, stop=[stop, "\x00"])
    assert r.choices[0].text == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="demo", prompt="def ", max_tokens=30, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == full[:full.find(stop)]


# =============================================================================== bad input
BAD = [
    ({"model": "demo", "prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ({"model": "demo", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": "demo", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "demo", "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": "demo", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "demo", "prompt": 5}, "prompt"),
    ({"model": "demo", "prompt": ""}, "prompt"),
    ({"model": "demo", "prompt": []}, "prompt"),
    ({"model": "demo", "prompt": [1, -3]}, "outside the vocabulary"),
    ({"model": "demo", "prompt": [10 ** 9]}, "outside the vocabulary"),
    ({"model": "demo", "prompt": "x " * 400}, "max_seq_len"),
    ({"model": "demo", "prompt": "x", "max_tokens": 10 ** 6}, "max_seq_len"),
    ({"model": "demo", "prompt": "x", "loops": 0}, "loops"),
    ({"model": "demo", "prompt": "x", "loops": 99}, "loops"),
    ({"model": "demo", "prompt": "x", "n": 2}, "n must be 1"),
    ({"model": "demo", "prompt": "x", "logprobs": 2}, "logprobs"),
    ({"model": "demo", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"model": "demo", "prompt": "x", "temperature": 0, "seed": 3}, "sampling knob"),
    ({"model": "demo", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ({"model": "demo", "prompt": "x", "decoder": "warp"}, "warp"),
    ({"model": "demo", "prompt": "x", "cache_mode": "int3"}, "int3"),
    ({"model": "demo", "prompt": "x", "early_exit_patience": 2, "early_exit_criterion": "bogus"}, "bogus"),
    ({"model": "demo", "prompt": "x", "early_exit_patience": 2, "early_exit_min_L": 9}, "early_exit_min_L"),
    ({"model": "demo", "prompt": "x", "temperature": 0, "beam_size": 2, "response_format": {"type": "json_object"}},
     "beam"),
    ({"model": "demo", "prompt": "x", "response_format": {"type": "regex", "regex": "("}}, "regex"),
    ({"model": "demo", "prompt": "x", "response_format": {"type": "yaml"}}, "response_format"),
    ({"model": "demo", "prompt": "x", "options": {"bogus": 1}}, "bogus"),
    ({"model": "demo", "prompt": "x", "unknown_field": 1}, "unknown_field"),
    ({"prompt": "x"}, "model"),
    ({"model": "demo", "prompt": "x", "timeout": 0}, "timeout"),
]


@pytest.mark.parametrize("body, needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_400_naming_the_problem(live, body, needle):
    r = live.post(body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle.lower() in (err["message"] + " " + str(err["param"])).lower(), err


def test_malformed_bodies_and_unknown_model(live):
    for content in (b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"):
        r = httpx.post(live.url + "/v1/completions", content=content, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json(), (content, r.text)
    r = live.post({"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert httpx.get(live.url + "/health").json()["status"] == "ok"
    assert "TinyLoop playground" in httpx.get(live.url + "/").text


# =============================================================================== serving semantics
def _stream_lines(live, body, n_lines=None):
    """Open a streaming request; read n_lines data lines (all when None) and close the connection."""
    got = []
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
        status = r.status_code
        if status != 200:
            r.read()
            return status, r.headers, [r.text]
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append(line[6:])
                if n_lines is not None and len(got) >= n_lines:
                    break
    return status, {}, got


def _wait_for(cond, what, limit=30.0):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < limit, what
        time.sleep(0.01)


def test_full_queue_is_a_429_with_retry_after(live):
    """The worker is held by a job that waits on an event (no race with decode speed): a streamed
    request waits in the queue (queue_size 1), a third is a 429; released, the streamed one ends."""
    from tinyloop.runtime.config import GenerateStats
    from tinyloop.serve.worker import Job
    worker = live.app.state.served.worker
    release, events = threading.Event(), []

    def held():
        release.wait(60)
        yield from ()

    long = {"model": "demo", "prompt": "x", "max_tokens": 8, "temperature": 0, "stream": True}
    with cf.ThreadPoolExecutor(2) as ex:
        try:
            worker.submit([Job(tokens=held(), stats=GenerateStats(), sink=events.append)])
            _wait_for(lambda: worker.running == 1 and worker.queue.qsize() == 0, "the held job did not start")
            second = ex.submit(_stream_lines, live, long)
            _wait_for(lambda: worker.queue.qsize() == 1, "the streamed request was not queued")
            r = live.post({"model": "demo", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 0
            assert r.json()["error"]["type"] == "rate_limit_error"
        finally:
            release.set()
        status, _, lines = second.result()
        assert status == 200 and lines[-1] == "[DONE]"
    assert events[-1][0] == "done"


def test_disconnect_stops_generation(live):
    before = live.metric("tinyloop_stop_reasons_total", '{reason="CALLBACK_ABORT"}')
    tokens0 = live.metric("tinyloop_generated_tokens_total")
    status, _, lines = _stream_lines(live, {"model": "demo", "prompt": "x", "max_tokens": 280, "temperature": 0,
                                            "stream": True}, n_lines=3)
    assert status == 200 and len(lines) == 3
    t0 = time.time()
    while live.metric("tinyloop_stop_reasons_total", '{reason="CALLBACK_ABORT"}') == before:
        assert time.time() - t0 < 30, "the aborted request did not end"
        time.sleep(0.05)
    assert live.metric("tinyloop_generated_tokens_total") - tokens0 < 100     # far fewer than 280


def test_deadline_ends_a_request_with_what_it_has(live):
    r = live.post({"model": "demo", "prompt": "x", "max_tokens": 280, "temperature": 0, "timeout": 0.15}).json()
    c = r["choices"][0]
    assert c["tinyloop"]["stop_reason"] == "DEADLINE" and c["finish_reason"] == "length"
    assert 0 < c["tinyloop"]["completion_tokens"] < 280


def test_metrics(live):
    text = httpx.get(live.url + "/metrics").text
    for name in ("tinyloop_requests_total", "tinyloop_generated_tokens_total", "tinyloop_queue_depth",
                 "tinyloop_time_to_first_token_seconds_bucket", "tinyloop_token_latency_seconds_bucket",
                 "tinyloop_stop_reasons_total", "tinyloop_prefix_pool_hits_total"):
        assert name in text, name
    assert live.metric("tinyloop_prefix_pool_hits_total") >= 1       # PROMPT is a scaffold
    # every response is counted by route and code: answers, refusals, validation failures
    ok = live.metric("tinyloop_requests_total", '{code="200",route="/v1/completions"}')
    bad = live.metric("tinyloop_requests_total", '{code="400",route="/v1/completions"}')
    live.post({"model": "demo", "prompt": "x", "max_tokens": "8"})
    live.post({"model": "demo", "prompt": "x", "max_tokens": 1})
    assert live.metric("tinyloop_requests_total", '{code="400",route="/v1/completions"}') == bad + 1
    assert live.metric("tinyloop_requests_total", '{code="200",route="/v1/completions"}') == ok + 1
    httpx.get(live.url + "/no/such/path")
    assert live.metric("tinyloop_requests_total", '{code="404",route="other"}') >= 1


def test_bounded_soak_with_random_disconnects():
    """120 requests, 8 concurrent clients that retry on 429, a third of the streams dropped after a
    few lines: every request is served (never a 5xx, none lost), every completed stream ends with
    [DONE], the server is idle and healthy afterwards, and its open descriptors are back where they
    were."""
    s = Live(ServeConfig(backend="cpu", max_seq_len=128, queue_size=6))
    try:
        def fds():
            return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
        rng = random.Random(3)

        def once(job):
            stream, drop, n, prompt = job
            body = {"model": "demo", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream}
            if stream:
                status, _, lines = _stream_lines(s, body, n_lines=2 if drop else None)
                return status, (status != 200 or drop or lines[-1] == "[DONE]")
            r = s.post(body)
            return r.status_code, r.status_code != 200 or len(r.json()["choices"]) == 1

        def one(job):              # a client that honours 429 by retrying shortly after
            for _ in range(200):
                status, ok = once(job)
                if status != 429:
                    return status, ok
                time.sleep(0.05)
            return 429, False
        jobs = [(rng.random() < 0.5, rng.random() < 0.33, rng.randint(1, 24), rng.choice(["a", "The", "x = "]))
                for _ in range(120)]
        _stream_lines(s, {"model": "demo", "prompt": "a", "max_tokens": 2, "stream": True})   # warm
        base = fds()
        with cf.ThreadPoolExecutor(8) as ex:
            results = list(ex.map(one, jobs))
        assert {st for st, _ in results} == {200}, results
        assert all(ok for _, ok in results), results
        t0 = time.time()
        while httpx.get(s.url + "/health").json()["queue_depth"]:
            assert time.time() - t0 < 60
            time.sleep(0.05)
        time.sleep(0.2)
        assert fds() <= base + 8
        r = s.post({"model": "demo", "prompt": "a", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200
    finally:
        s.close()


# =============================================================================== config
def test_text_prompts_start_with_the_models_bos(tmp_path):
    """On a model with a BOS id a text prompt starts with it (as the Python API's and OpenAI-
    compatible servers' do) and counts it in usage; token-id prompts are used as given; a scaffold
    registered as text and a prompt that starts with it still share the prefix."""
    from conftest import write_tiny
    path = tmp_path / "bos.tinyloop"
    write_tiny(path, seed=4, vocab_size=300, bos_id=299)
    s = Live(ServeConfig(model=str(path), backend="cpu", max_seq_len=64, scaffolds=["def "]))
    try:
        enc = s.model.tokenizer.encode
        r = s.post({"model": "bos", "prompt": "def f(x):", "max_tokens": 5, "temperature": 0}).json()
        assert r["choices"][0]["text"] == expected(s.model, "def f(x):", 5)
        assert r["usage"]["prompt_tokens"] == 1 + len(enc("def f(x):"))
        assert r["choices"][0]["tinyloop"]["reused_tokens"] == 1 + len(enc("def "))     # BOS + the scaffold
        ids = enc("def f(x):")
        r = s.post({"model": "bos", "prompt": ids, "max_tokens": 5, "temperature": 0}).json()
        assert r["choices"][0]["text"] == expected(s.model, ids, 5) and r["usage"]["prompt_tokens"] == len(ids)
    finally:
        s.close()


CHAT = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_live(tmp_path_factory):
    """A server over a model whose embedded tokenizer carries a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from conftest import TINY, random_weights
    from tinyloop.model.arch import ModelConfig, TensorQuant
    from tinyloop.model.format import write_model
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=290, special_tokens=["<|begin|>", "<|end|>", "<|user|>", "<|assistant|>",
                                                             "<|system|>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the loop runs again and again, then it exits early"] * 20, tr)
    cfg = ModelConfig(**{**TINY, "vocab_size": 300, "bos_id": tok.token_to_id("<|begin|>"),
                         "eos_id": tok.token_to_id("<|end|>")})
    path = tmp_path_factory.mktemp("chat") / "chat.tinyloop"
    write_model(str(path), cfg, random_weights(cfg, 3), default_quant=TensorQuant("f16", 0),
                tokenizer={"type": "hf", "json": tok.to_str(), "chat_template": CHAT})
    s = Live(ServeConfig(model=str(path), backend="cpu", max_seq_len=96))
    yield s
    s.close()


def test_chat_completions_with_the_openai_client(chat_live):
    """POST /v1/chat/completions renders the messages with the model's chat template: the reply is
    tinyloop's completion of apply_chat_template's ids, streamed or not (a chat.completion, then
    chat.completion.chunk deltas: the role first, the text, the finish reason, usage on request)."""
    client = openai.OpenAI(base_url=chat_live.url + "/v1", api_key="none", max_retries=0)
    m = chat_live.model
    convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the loop runs?"}]
    ids = tl.apply_chat_template(m, convo)
    want = expected(m, ids, 10)
    r = client.chat.completions.create(model="chat", messages=convo, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model="chat", messages=convo, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.prompt_tokens == len(ids) and all(c.object == "chat.completion.chunk" for c in chunks)
    r = client.chat.completions.create(model="chat", messages=convo, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3


@pytest.mark.parametrize("body, needle", [
    ({"messages": []}, "messages"), ({"messages": [{"content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n must be 1"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 2}, "not both"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt")])
def test_chat_bad_requests_are_400s(chat_live, body, needle):
    r = httpx.post(chat_live.url + "/v1/chat/completions", json={"model": "chat", **body}, timeout=30)
    assert r.status_code == 400 and needle in r.text


def test_chat_without_a_template_is_a_400(live, client):
    """The demo model has no chat template: a 400 that says so (nothing is queued)."""
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_create_app_argument_errors():
    with pytest.raises(tl.ConfigError, match="ServeConfig"):
        create_app({"port": 1})
    with pytest.raises(tl.InvalidInputError, match="model must be a Model"):
        create_app(ServeConfig(backend="cpu"), model="demo")


def test_serve_config_errors(tmp_path):
    with pytest.raises(tl.ConfigError, match="port"):
        ServeConfig(port=70000)
    with pytest.raises(tl.ConfigError, match="queue_size"):
        ServeConfig(queue_size=0)
    with pytest.raises(tl.ConfigError, match="scaffolds"):
        ServeConfig(scaffolds="abc")
    with pytest.raises(tl.ConfigError, match="deadline_s"):
        ServeConfig(deadline_s=-1)
    with pytest.raises(tl.ConfigError, match="port"):
        ServeConfig(port="8000")
    with pytest.raises(tl.ConfigError, match="deadline_s"):
        ServeConfig(deadline_s="soon")
    with pytest.raises(tl.ConfigError, match="unknown field"):
        ServeConfig(prot=1)
    p = tmp_path / "serve.yaml"
    p.write_text("port: 8001\nbogus: 1\n")
    with pytest.raises(tl.ConfigError, match="bogus"):
        load_serve_config(str(p))
    p.write_text("port: 8001\nscaffolds: [{text: 'You are', loops: 2}]\nqueue_size: 3\n")
    cfg = load_serve_config(str(p))
    assert cfg.port == 8001 and cfg.scaffolds[0].loops == 2 and cfg.queue_size == 3
    from tinyloop.cli.main import main
    p.write_text("port: [1]\n")
    assert main(["serve", "--config", str(p)]) == 2
