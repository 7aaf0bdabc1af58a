"""The OpenAI-compatible server end to end: the real uvicorn server on a loopback port over a tiny
target, driven by the real ``openai`` client (and raw httpx for malformed requests)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import diffdraft
from diffdraft.serve.app import create_app
from diffdraft.serve.scheduler import Scheduler

from diffdraft_testing.checkpoints import save_tiny_drafter
from diffdraft_testing.serving import LiveServer, make_chat_checkpoint, serving

MODEL = "tiny-test-model"
METHOD = "ddtree+pld"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world, the quick"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_chat_checkpoint(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def drafter_dir(checkpoint, tmp_path_factory):
    return save_tiny_drafter(checkpoint, tmp_path_factory.mktemp("drafter"))


def load(checkpoint, drafter_dir):
    return diffdraft.load(checkpoint, drafter=drafter_dir, method=METHOD, budget=8)


@pytest.fixture(scope="module")
def reference(checkpoint, drafter_dir):
    """A generator of its own, for the expected outputs (the served one belongs to the scheduler)."""
    return load(checkpoint, drafter_dir)


@pytest.fixture(scope="module")
def server(checkpoint, drafter_dir):
    with serving(load(checkpoint, drafter_dir), MODEL, max_batch_size=4, max_queue=64) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, path: str, body) -> httpx.Response:
    """POST ``body``, waiting up to a minute for the answer: httpx's default 5 s ran out on a busy
    2-core machine while a request queued behind another's 100 tokens."""
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(
        server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60.0
    )


def test_greedy_chat_completion_is_the_generators_text(client, reference):
    expected = reference.generate(messages=CHAT, max_new_tokens=24)
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    choice = reply.choices[0]
    assert choice.message.content == expected.text
    assert choice.message.role == "assistant"
    assert choice.finish_reason == ("length" if expected.stats.stop_reason == "max_new_tokens" else "stop")
    assert reply.object == "chat.completion" and reply.model == MODEL
    prompt_tokens = len(expected.prompt_token_ids)
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == prompt_tokens + len(expected.token_ids)
    stats = reply.model_extra["diffdraft"]  # the openai client keeps the non-standard field
    assert stats["method"] == METHOD and stats["rounds"] == expected.stats.rounds >= 1
    assert stats["tau"] == pytest.approx(expected.stats.tau)


def test_greedy_completion_is_the_generators_text(client, reference):
    expected = reference.generate("hello world", max_new_tokens=20, ignore_eos=True)
    reply = client.completions.create(
        model=MODEL, prompt="hello world", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 20
    by_ids = client.completions.create(
        model=MODEL,
        prompt=expected.prompt_token_ids,
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert by_ids.choices[0].text == expected.text


def test_max_completion_tokens_and_an_omitted_model_are_honoured(server, reference):
    expected = reference.generate(messages=CHAT, max_new_tokens=5, ignore_eos=True)
    body = {
        "messages": CHAT,
        "max_completion_tokens": 5,
        "max_tokens": 50,
        "temperature": 0,
        "ignore_eos": True,
    }
    reply = post(server, "/v1/chat/completions", body)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == expected.text
    assert reply.json()["usage"]["completion_tokens"] == 5


def test_a_stop_string_ends_the_text_before_it_with_finish_reason_stop(client, reference):
    full = reference.generate(messages=CHAT, max_new_tokens=24, ignore_eos=True)
    stop = full.text[4:6]
    assert len(stop) == 2
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stop=stop, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].message.content == full.text[: full.text.find(stop)]
    assert reply.choices[0].finish_reason == "stop"


def endpoint_call(client, endpoint: str, **options):
    """(create, its options) of one endpoint, without end tokens: chat gets CHAT, completions a prompt."""
    options.update(model=MODEL, extra_body={"ignore_eos": True})
    if endpoint == "chat":
        return client.chat.completions.create, {**options, "messages": CHAT}
    return client.completions.create, {**options, "prompt": "the quick brown fox"}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_chunks_join_to_the_non_streamed_text(client, endpoint):
    create, options = endpoint_call(client, endpoint, max_tokens=30, temperature=0)
    whole = create(**options)
    chunks = list(create(**options, stream=True, stream_options={"include_usage": True}))
    *content, finish, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 30
    assert usage.usage.total_tokens == whole.usage.total_tokens
    assert finish.choices[0].finish_reason == "length"
    assert finish.model_extra["diffdraft"] == whole.model_extra["diffdraft"]  # greedy: the same rounds
    assert all(c.choices[0].finish_reason is None for c in content)
    assert all("diffdraft" not in c.model_extra for c in [*content, usage])
    if endpoint == "chat":
        assert content[0].choices[0].delta.role == "assistant"
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    else:
        assert all(c.object == "text_completion" for c in chunks)
        assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert len({c.id for c in chunks}) == 1


def test_a_stream_ends_with_done_and_has_no_usage_unless_asked(server):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    assert all("usage" not in json.loads(event) for event in events[:-1])


def test_seeded_sampling_is_the_generators_sample(client, reference):
    options = dict(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    expected = reference.generate(messages=CHAT, **options)
    replies = [
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=16,
            temperature=0.9,
            top_p=0.95,
            seed=1234,
            extra_body={"ignore_eos": True},
        )
        for _ in range(2)
    ]
    assert [r.choices[0].message.content for r in replies] == [expected.text] * 2


def test_n_greedy_choices_are_all_the_generators_text(client, reference):
    expected = reference.generate(messages=CHAT, max_new_tokens=12)
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [expected.text] * 3
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)  # the prompt counts once
    assert reply.usage.completion_tokens == 3 * len(expected.token_ids)
    assert all(c.model_extra["diffdraft"] == reply.model_extra["diffdraft"] for c in reply.choices)


def test_n_seeded_choices_are_the_samples_of_consecutive_seeds(client, reference):
    options = dict(max_new_tokens=10, temperature=1.0, ignore_eos=True)
    expected = [
        reference.generate(prompt="the quick brown fox", seed=77 + i, **options).text for i in range(3)
    ]
    assert len(set(expected)) > 1, "the seeds should give different samples"
    reply = client.completions.create(
        model=MODEL,
        prompt="the quick brown fox",
        max_tokens=10,
        temperature=1.0,
        seed=77,
        n=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in reply.choices] == expected
    assert [c.index for c in reply.choices] == [0, 1, 2]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_n_streamed_choices_each_join_to_their_text(client, reference, endpoint):
    create, options = endpoint_call(client, endpoint, max_tokens=10, temperature=1.0, seed=5, n=2)
    whole = create(**options)
    chunks = list(create(**options, stream=True, stream_options={"include_usage": True}))
    *choice_chunks, usage = chunks
    assert usage.choices == [] and usage.usage == whole.usage
    for index, choice in enumerate(whole.choices):
        mine = [c for c in choice_chunks if c.choices[0].index == index]
        *content, finish = mine
        assert finish.choices[0].finish_reason == "length"
        assert finish.model_extra["diffdraft"] == choice.model_extra["diffdraft"]
        if endpoint == "chat":
            text = "".join(c.choices[0].delta.content or "" for c in content)
            assert content[0].choices[0].delta.role == "assistant" and text == choice.message.content
        else:
            assert "".join(c.choices[0].text for c in content) == choice.text
    assert len(choice_chunks) == sum(1 for c in choice_chunks if c.choices[0].index in (0, 1))


def test_chat_log_probabilities_are_the_generators(client, reference):
    expected = reference.generate(messages=CHAT, max_new_tokens=12, logprobs=2)
    options = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    reply = client.chat.completions.create(**options)
    content = reply.choices[0].logprobs.content
    assert len(content) == len(expected.token_ids)
    for entry, token in zip(content, expected.logprobs, strict=True):
        assert entry.token == reference.tokenizer.decode([token.token_id])
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob == pytest.approx(token.logprob, abs=1e-4)
        assert [t.token for t in entry.top_logprobs] == [
            reference.tokenizer.decode([i]) for i, _ in token.top
        ]
    streamed = client.chat.completions.create(**options, stream=True)
    pieces = [
        e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in pieces] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_log_probabilities_are_the_legacy_parallel_lists(client, reference):
    expected = reference.generate(
        prompt="the quick brown fox", max_new_tokens=10, ignore_eos=True, logprobs=3
    )
    options = dict(
        model=MODEL,
        prompt="the quick brown fox",
        max_tokens=10,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    logprobs = client.completions.create(**options).choices[0].logprobs
    texts = [reference.tokenizer.decode([t]) for t in expected.token_ids]
    assert logprobs.tokens == texts
    assert logprobs.token_logprobs == pytest.approx([t.logprob for t in expected.logprobs], abs=1e-4)
    assert logprobs.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    streamed = [c.choices[0].logprobs for c in client.completions.create(**options, stream=True) if c.choices]
    streamed = [s for s in streamed if s is not None]
    assert [t for s in streamed for t in s.tokens] == logprobs.tokens
    assert [o for s in streamed for o in s.text_offset] == logprobs.text_offset


def test_fields_other_clients_send_are_accepted_and_ignored(server, reference):
    expected = reference.generate(messages=CHAT, max_new_tokens=8)
    body = {
        "model": MODEL,
        "messages": [{"role": "developer", "content": "be brief"}, {**CHAT[1], "name": "alice"}],
        "max_tokens": 8,
        "temperature": 0,
        "user": "someone",
        "logprobs": False,
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "stream": False,
        "parallel_tool_calls": True,
        "some_future_field": {"nested": [1, 2]},
    }
    reply = post(server, "/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == expected.text  # developer -> system
    parts = {
        **body,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hello world, "}, {"type": "text", "text": "the quick"}],
            }
        ],
    }
    joined = post(server, "/v1/chat/completions", parts)
    assert joined.status_code == 200
    plain = reference.generate(messages=[CHAT[1]], max_new_tokens=8)
    assert joined.json()["choices"][0]["message"]["content"] == plain.text


TOO_LONG = "hello world " * 200

BAD_REQUESTS = [
    ("/v1/chat/completions", '{"model": "x", "messages": [', 400, None, "not valid JSON"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "temperature": -1},
        400,
        "temperature",
        "greater than or equal to 0",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "ten"}, 400, "max_tokens", "valid integer"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "0.5"}, 400, "temperature", "valid number"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, 400, "top_p", "greater than 0"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 0},
        400,
        "max_tokens",
        "greater than or equal to 1",
    ),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1 item"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "valid array"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "hi"}]},
        400,
        "messages[0].role",
        "robot",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content", "Field required"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 65}, 400, "n", "n is at most 64"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2, "seed": 2**64 - 1}, 400, "seed", "below 2**64"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": 7}, 400, "stop", "valid string"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        "less than or equal to 20",
    ),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs", "greater than or equal to 0"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "presence_penalty": 0.5},
        400,
        "presence_penalty",
        "not supported",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4o"}, 404, "model", "`gpt-4o` does not exist"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": TOO_LONG}]},
        400,
        None,
        "context holds 128",
    ),
    ("/v1/chat/completions", [1, 2], 400, None, "JSON object"),
    ("/v1/completions", {"prompt": TOO_LONG}, 400, None, "context holds 128"),
    ("/v1/completions", {"prompt": ""}, 400, None, "non-empty string"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ("/v1/completions", {"prompt": [10**6]}, 400, None, "prompt_token_ids"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo", "not supported"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "Field required"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, None, "stop strings must be non-empty"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "message"), BAD_REQUESTS)
def test_bad_requests_get_an_openai_error_body(server, path, body, status, param, message):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"]
    assert error["param"] == param
    assert error["code"] == status
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_the_openai_client_raises_its_own_errors_for_them(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="presence_penalty is not supported"):
        client.chat.completions.create(model=MODEL, messages=CHAT, presence_penalty=1.0)


def test_unknown_routes_and_methods_get_an_openai_error_body(server):
    missing = httpx.get(server.url + "/v1/engines")
    assert missing.status_code == 404 and "/v1/chat/completions" in missing.json()["error"]["message"]
    wrong_method = httpx.get(server.url + "/v1/chat/completions")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == 405


def test_concurrent_clients_each_get_exactly_their_own_text(server, client, reference):
    """8 requests (half streamed, different prompts and lengths) over a batch of 4, malformed
    requests in between: every client gets what the generator gives for its request alone."""
    requests = [
        {"messages": [{"role": "user", "content": f"{word} and the fox"}], "max_tokens": 6 + 5 * i}
        for i, word in enumerate(
            ["hello", "world", "quick", "brown", "the", "fox", "hello world", "quick fox"]
        )
    ]
    expected = [
        reference.generate(messages=r["messages"], max_new_tokens=r["max_tokens"], ignore_eos=True).text
        for r in requests
    ]

    def run(index: int) -> str:
        r = requests[index]
        options = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True}, **r)
        if index % 2:
            stream = client.chat.completions.create(**options, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return client.chat.completions.create(**options).choices[0].message.content

    def bad(index: int) -> int:
        body = BAD_REQUESTS[index % 3][1]
        return post(server, "/v1/chat/completions", body).status_code

    with ThreadPoolExecutor(max_workers=12) as pool:
        good = [pool.submit(run, i) for i in range(len(requests))]
        malformed = [pool.submit(bad, i) for i in range(6)]
        texts = [f.result() for f in good]
        statuses = [f.result() for f in malformed]
    assert texts == expected
    assert statuses == [400] * 6
    assert server.scheduler.running == server.scheduler.queue_depth == 0


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 128
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_routes_answer_a_retry_while_the_model_loads_and_raise_nothing():
    """Before the scheduler is ready every route but /health answers 503 with Retry-After; the
    refusal is an answer, not an error raised through the app (the server logged a traceback for
    each such request, every poll of a client waiting for the model)."""
    from starlette.testclient import TestClient

    app = create_app(None, MODEL)
    with TestClient(app, raise_server_exceptions=True) as test_client:
        for path in ("/v1/models", "/metrics"):
            response = test_client.get(path)
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert "still starting" in response.json()["error"]["message"]
        assert test_client.get("/health").json()["status"] == "loading"


def metric_samples(server) -> dict:
    response = httpx.get(server.url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_metrics_count_requests_tokens_and_acceptance(server, client):
    before = metric_samples(server)
    chat_ok = ("diffdraft_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))
    chat_bad = ("diffdraft_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "400")))
    done = ("diffdraft_completion_tokens_total", ())
    rounds = ("diffdraft_acceptance_length_count", ())
    taus = ("diffdraft_request_tau_count", ())
    client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert post(server, "/v1/chat/completions", {"messages": []}).status_code == 400
    after = metric_samples(server)
    assert after[chat_ok] - before.get(chat_ok, 0) == 2
    assert after[chat_bad] - before.get(chat_bad, 0) == 1
    assert after[done] - before[done] == 12
    assert after[taus] - before[taus] == 2
    assert after[rounds] - before[rounds] >= 2
    assert after[("diffdraft_queue_depth", ())] == 0 and after[("diffdraft_running_requests", ())] == 0
    assert ("diffdraft_time_to_first_token_seconds_count", ()) in after


class SlowTarget:
    """Makes every round take at least ``seconds``, so a request is still running when a test acts."""

    def __init__(self, generator, seconds: float) -> None:
        target = generator.engine.target
        verify_batch = target.verify_batch

        def slow(*args, **kwargs):
            time.sleep(seconds)
            return verify_batch(*args, **kwargs)

        target.verify_batch = slow


@pytest.fixture
def slow_server(checkpoint):
    """One request at a time, one more waiting, 20 ms a round: a long request stays in the batch."""
    generator = diffdraft.load(checkpoint, method="pld")
    SlowTarget(generator, 0.02)
    with serving(generator, MODEL, max_batch_size=1, max_queue=1) as live:
        live.handles = []
        submit = live.scheduler.submit
        live.scheduler.submit = lambda request: live.handles.append(submit(request)) or live.handles[-1]
        yield live


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


LONG = {"model": MODEL, "prompt": "hello", "max_tokens": 100, "temperature": 0, "ignore_eos": True}


def test_a_streaming_client_that_disconnects_frees_its_batch_slot(slow_server):
    with httpx.stream("POST", slow_server.url + "/v1/completions", json={**LONG, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk read, then the connection closes
    handle = slow_server.handles[0]
    wait_for(handle.cancelled.is_set)
    wait_for(lambda: slow_server.scheduler.running == 0)
    assert len(handle.prepared.generated) < 100  # stopped early: its slot was freed, not run to the end
    samples = metric_samples(slow_server)
    assert samples[("diffdraft_requests_total", (("endpoint", "/v1/completions"), ("status", "499")))] == 1
    reply = post(slow_server, "/v1/completions", {**LONG, "max_tokens": 3})
    assert reply.status_code == 200  # the freed slot serves the next request


def test_a_non_streaming_client_that_gives_up_frees_its_batch_slot(slow_server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.url + "/v1/completions", json=LONG, timeout=0.3)
    handle = slow_server.handles[0]
    wait_for(handle.cancelled.is_set)
    wait_for(lambda: slow_server.scheduler.running == 0)
    assert len(handle.prepared.generated) < 100


def test_a_full_queue_answers_429_and_the_others_finish(slow_server):
    results = {}
    running = threading.Thread(
        target=lambda: results.update(first=post(slow_server, "/v1/completions", LONG))
    )
    running.start()
    wait_for(lambda: slow_server.scheduler.running == 1)
    waiting = threading.Thread(
        target=lambda: results.update(second=post(slow_server, "/v1/completions", LONG))
    )
    waiting.start()
    wait_for(lambda: slow_server.scheduler.queue_depth == 1)
    refused = post(slow_server, "/v1/completions", LONG)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert "retry later" in refused.json()["error"]["message"]
    running.join(30)
    waiting.join(30)
    assert results["first"].status_code == results["second"].status_code == 200


def test_the_server_and_scheduler_shut_down_cleanly(checkpoint):
    generator = diffdraft.load(checkpoint, method="ar")
    before = set(threading.enumerate())
    scheduler = Scheduler(generator, max_batch_size=2).start()
    live = LiveServer(create_app(scheduler, MODEL)).__enter__()
    started = set(threading.enumerate()) - before
    assert post(live, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    live.stop()
    scheduler.close()
    assert started and not any(thread.is_alive() for thread in started)
    with pytest.raises(httpx.ConnectError):
        httpx.get(live.url + "/health")


def test_requests_in_flight_when_the_scheduler_closes_end_with_503(slow_server):
    results = {}
    waiting = threading.Thread(
        target=lambda: results.update(plain=post(slow_server, "/v1/completions", LONG))
    )
    with httpx.stream("POST", slow_server.url + "/v1/completions", json={**LONG, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        waiting.start()
        wait_for(lambda: slow_server.scheduler.queue_depth == 1)
        slow_server.scheduler.close()
        events = [line.removeprefix("data: ") for line in lines if line]
    waiting.join(30)
    error = json.loads(events[-2])["error"]
    assert events[-1] == "[DONE]" and error["code"] == 503 and "shut down" in error["message"]
    assert results["plain"].status_code == 503 and results["plain"].json()["error"]["code"] == 503
    refused = post(slow_server, "/v1/completions", LONG)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert httpx.get(slow_server.url + "/health").status_code == 503


def test_a_failing_round_is_a_500_error_body_and_the_server_goes_on(checkpoint):
    generator = diffdraft.load(checkpoint, method="pld")
    target = generator.engine.target
    verify_batch, failures = target.verify_batch, [RuntimeError("out of memory (simulated)")]

    def fail_once(*args, **kwargs):
        if failures:
            raise failures.pop()
        return verify_batch(*args, **kwargs)

    target.verify_batch = fail_once
    with serving(generator, MODEL) as live:
        failed = post(live, "/v1/completions", {"prompt": "hello", "max_tokens": 5})
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["type"] == "internal_server_error" and "out of memory (simulated)" in error["message"]
        assert "Traceback" not in failed.text
        assert post(live, "/v1/completions", {"prompt": "hello", "max_tokens": 5}).status_code == 200


def test_an_api_key_guards_the_v1_routes_and_leaves_health_and_metrics_open(checkpoint):
    with serving(diffdraft.load(checkpoint, method="pld"), MODEL, api_key="sesame") as live:
        wrong = openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError, match="missing or wrong API key"):
            wrong.models.list()
        bare = post(live, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
        assert bare.status_code == 401 and bare.json()["error"]["type"] == "authentication_error"
        right = openai.OpenAI(base_url=live.url + "/v1", api_key="sesame", max_retries=0, timeout=60)
        completion = right.completions.create(model=MODEL, prompt="hello", max_tokens=2)
        assert completion.usage.completion_tokens == 2
        assert httpx.get(live.url + "/health").status_code == 200
        assert httpx.get(live.url + "/metrics").status_code == 200
