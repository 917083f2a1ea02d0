"""Schemathesis over the server's OpenAPI schema (in-process, through ASGI): requests generated
from the schema of every route never get a 5xx, every status code is one the schema documents, and
every response matches its documented schema and content type."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

from tinyloop.serve import ServeConfig, create_app  # noqa: E402


@pytest.fixture(scope="module")
def api_schema():
    app = create_app(ServeConfig(backend="cpu", max_seq_len=128, queue_size=64, max_tokens_default=4))
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    app.state.served.close()


def operations(schema):
    return [r.ok() for r in schema.get_all_operations()]


def test_every_route_is_in_the_schema(api_schema):
    paths = {(op.method.upper(), op.path) for op in operations(api_schema)}
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics"),
            ("GET", "/")} <= paths


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/"])
def test_no_5xx_and_responses_match_the_schema(api_schema, route):
    op = next(o for o in operations(api_schema) if o.path == route)
    named = []

    @given(case=op.as_strategy())
    @settings(max_examples=60 if route.endswith("completions") else 5, deadline=None,
              suppress_health_check=list(HealthCheck), database=None)
    def run(case):
        # half the generated completions name the served model, so they get past the 404
        if route.endswith("completions") and isinstance(case.body, dict) and len(named) % 2 == 0:
            case.body["model"] = "demo"
        named.append(1)
        # a schema-valid body may still be one this model cannot serve (a prompt longer than
        # max_seq_len, loops past max_loops): a documented 400, not a failure
        case.call_and_validate(excluded_checks=[positive_data_acceptance])
    run()


LONG = " ".join(str(i) for i in range(300))         # ~590 demo tokens, max_seq_len is 128


@pytest.mark.parametrize("body", [
    {"prompt": "Once", "max_tokens": 3, "stream": True},
    {"prompt": ["a", "b"], "max_tokens": 2, "stream": True, "echo": True,
     "stream_options": {"include_usage": True}},
    {"prompt": LONG, "max_tokens": 2, "stream": True},           # past max_seq_len: a 400 before any event
])
def test_streamed_events_match_the_schema(api_schema, body):
    """Every server-sent event of a streamed completion (chunks, the usage chunk, [DONE]) matches
    the documented event schema; random generation reaches stream=true only now and then."""
    op = next(o for o in operations(api_schema) if o.path == "/v1/completions")
    case = op.Case(body={"model": "demo", **body}, media_type="application/json")
    response = case.call_and_validate(excluded_checks=[positive_data_acceptance])
    if body["prompt"] == LONG:
        assert response.status_code == 400
    else:
        assert response.status_code == 200
        assert response.text.endswith("data: [DONE]\n\n") and response.text.count("data: ") >= 3
