"""schemathesis against the served `/openapi.json`: positive and negative requests to every served operation
(`/v1/responses` and streams included), on the sequential path behind an API key and on the continuous-batching
path with the flag. No answer is a 5xx, every answer conforms to the published schema (status, content type, body), no body the
schema accepts is refused as malformed (422), generation is reached on each endpoint, and a good request still
answers afterwards.

Bounded (fixed seed, a few examples per operation and mode) to stay near a minute in `make test`; docs/serving.md
has the long run and its command. schemathesis talks to the app in this process (its ASGI transport).
"""

import collections
import json

import pytest


schemathesis = pytest.importorskip("schemathesis", reason="the tests extra is not installed")
from hypothesis import HealthCheck, Phase, given, seed, settings, strategies  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from tests.helpers import save_tiny_checkpoint  # noqa: E402
from tests.serving.servers import RunningServer  # noqa: E402


KEY = "fuzz-key"
EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 15}
STREAMED = 6
SEED = 31
GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
CACHE = {"cb_block_size": 16, "cb_num_blocks": 32, "cb_max_batch_tokens": 64}
FLAG = {"use_flash_attention": True}
# The model's positions: a request without max_tokens gets the rest of them (about 40 tokens here, 100 at 128,
# which took 30 s of the sequential run for answers the schema checks the same way).
CONTEXT = 64


# The schema's "json-object" strings (a tool call's arguments, generation_config as text): JSON objects.
JSON_OBJECTS = strategies.dictionaries(strategies.just("max_new_tokens"), strategies.integers(1, 8)).map(json.dumps)
schemathesis.openapi.format("json-object", JSON_OBJECTS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama_fuzzed"), max_position_embeddings=CONTEXT)


def fuzz(server: RunningServer, headers: dict[str, str]) -> collections.Counter:
    """Every operation of the schema in both modes; (path, mode, status, streamed) of each answer, counted."""
    app = server.serve.server.config.app
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=headers)
    schema.config.checks.positive_data_acceptance.expected_statuses = ["2xx", "400", "401", "404"]
    refusals = schema.config.checks.negative_data_rejection  # and a body above the server's limit is refused: 413
    refusals.expected_statuses = [*refusals.expected_statuses, "413"]
    outcomes: collections.Counter = collections.Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode, examples in EXAMPLES.items():
            if mode == GenerationMode.NEGATIVE and not len(operation.body):
                continue  # nothing to break in a GET without parameters
            explore(operation, mode, examples, headers, outcomes)
        if operation.path in GENERATION:  # and positive requests that stream, whatever `stream` was drawn
            explore(operation, GenerationMode.POSITIVE, STREAMED, headers, outcomes, stream=True)
    return outcomes


def streaming(case):
    if isinstance(case.body, dict):
        case.body["stream"] = True
    return case


def explore(
    operation, mode: GenerationMode, examples: int, headers: dict, outcomes: collections.Counter, stream: bool = False
) -> None:
    strategy = operation.as_strategy(generation_mode=mode)

    @seed(SEED)
    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        derandomize=True,
        phases=[Phase.generate],  # no shrinking: a failure is reported as found, in bounded time
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy.map(streaming) if stream else strategy)
    def run(case) -> None:
        response = case.call_and_validate(headers=headers)
        streamed = response.headers.get("content-type", [""])[0].startswith("text/event-stream")
        outcomes[(operation.path, mode.value, response.status_code, streamed)] += 1

    run()


@pytest.mark.parametrize("path", ["sequential", "cb"])
def test_fuzzed_requests_get_no_5xx_and_answers_conform_to_the_schema(path, checkpoint):
    # continuous batching with the flag: its engine steps run the fused path over the paged cache
    options = {"api_key": KEY} if path == "sequential" else {"continuous_batching": True, "flags": FLAG, **CACHE}
    server = RunningServer(checkpoint, **options)
    headers = {"Authorization": f"Bearer {KEY}"} if path == "sequential" else {}
    try:
        outcomes = fuzz(server, headers)
        assert not [outcome for outcome in outcomes if outcome[2] >= 500], outcomes
        for endpoint in GENERATION:
            answered = {streamed for (where, _, status, streamed) in outcomes if where == endpoint and status == 200}
            assert answered == {False, True}, (endpoint, outcomes)  # generated, whole and streamed
            assert any(where == endpoint and mode == "negative" for where, mode, _, _ in outcomes)
        status, answer, _ = server.post(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2},
            headers=headers,
        )
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
        server.wait_in_flight(0)  # none left hanging
    finally:
        server.stop()
