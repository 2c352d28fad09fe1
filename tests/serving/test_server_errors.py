"""The token server's 4xx/5xx answers, its concurrency bound and time-out (real HTTP, real tiny model)."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.serving.common import tiny_rollout
from verl_trainer.serving import ServerConfig, TokenServer


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    return tiny_rollout(tmp_path_factory.mktemp("errors") / "policy", max_new_tokens=4)


@pytest.fixture(scope="module")
def server(rollout):
    with TokenServer(rollout.generate_token_ids, rollout.config, rollout.tokenizer, rollout.eos_token_ids,
                     ServerConfig(max_n=4)) as running:
        yield running


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("path", "body", "status", "names"), [
    ("/chat/completions", {}, 400, "messages"),
    ("/chat/completions", {"messages": []}, 400, "messages"),
    ("/chat/completions", {"messages": [{"content": "no role"}]}, 400, "role"),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text"),
    ("/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "gpt-4"),
    ("/chat/completions", {**CHAT, "stop": ["\n"]}, 400, "stop"),
    ("/chat/completions", {**CHAT, "stream": True}, 400, "stream"),
    ("/chat/completions", {**CHAT, "n": 5}, 400, "max_n=4"),
    ("/chat/completions", {**CHAT, "n": 2, "trajectory_id": "x"}, 400, "n=1"),
    ("/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/chat/completions", {**CHAT, "top_p": 1.5}, 400, "top_p"),
    ("/completions", {"prompt": [5, 999999]}, 400, "vocabulary"),
    ("/completions", {"prompt": ""}, 400, "empty"),
    ("/completions", {"prompt": [[5, 6], [7]]}, 400, "prompt"),
])
def test_bad_requests_are_named(server, path, body, status, names):
    answer = _post(server, path, body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert names in error["message"] or names == error["param"], error


def test_models_and_a_valid_request(server):
    assert httpx.get(server.url + "/models").json()["data"][0]["id"] == "policy"
    answer = _post(server, "/completions", {"prompt": [5, 6, 7], "n": 2, "max_tokens": 3, "seed": 7}).json()
    assert [len(c["token_ids"]) <= 3 for c in answer["choices"]] == [True, True]
    again = _post(server, "/completions", {"prompt": [5, 6, 7], "n": 2, "max_tokens": 3, "seed": 7}).json()
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in answer["choices"]]


def test_trajectory_must_grow(server):
    tid = {"trajectory_id": "grow"}
    first = _post(server, "/completions", {"prompt": [5, 6, 7], **tid}).json()["choices"][0]
    wrong = _post(server, "/completions", {"prompt": [5, 6, 8, 9], **tid})
    assert wrong.status_code == 400 and "does not extend" in wrong.json()["error"]["message"]
    right = _post(server, "/completions", {"prompt": [5, 6, 7, *first["token_ids"], 9], **tid})
    assert right.status_code == 200
    chat = _post(server, "/chat/completions", {**CHAT, "trajectory_id": "chat"}).json()["choices"][0]
    edited = [{"role": "user", "content": "HELLO"}, {**chat["message"]}, {"role": "user", "content": "more"}]
    answer = _post(server, "/chat/completions", {"messages": edited, "trajectory_id": "chat"})
    assert answer.status_code == 400 and "messages[0]" in answer.json()["error"]["message"]
    forged = [*CHAT["messages"], chat["message"], {"role": "assistant", "content": "forged"}]
    answer = _post(server, "/chat/completions", {"messages": forged, "trajectory_id": "chat"})
    assert answer.status_code == 400 and "did not sample" in answer.json()["error"]["message"]


def test_concurrency_bound_timeout_and_backend_failure(rollout):
    gate = threading.Event()
    failing = threading.Event()

    def generate(prompts, config, seeds):
        gate.wait(30)
        if failing.is_set():
            raise RuntimeError("engine exploded")
        return rollout.generate_token_ids(prompts, config, seeds)

    config = ServerConfig(max_concurrency=1, request_timeout_s=0.5)
    with TokenServer(generate, rollout.config, rollout.tokenizer, rollout.eos_token_ids, config) as server:
        results = {}
        first = threading.Thread(target=lambda: results.update(a=_post(server, "/completions",
                                                                         {"prompt": [5]})))
        first.start()
        while server._admitted == 0:
            threading.Event().wait(0.01)
        busy = _post(server, "/completions", {"prompt": [5]})
        first.join()
        assert busy.status_code == 429 and "max_concurrency=1" in busy.json()["error"]["message"]
        late = results["a"]
        assert late.status_code == 504 and "request_timeout_s" in late.json()["error"]["message"]
        failing.set()
        gate.set()
        broken = _post(server, "/completions", {"prompt": [5]})
        assert broken.status_code == 500 and "engine exploded" in broken.json()["error"]["message"]


@pytest.mark.parametrize(("key", "value", "names"), [
    ("port", 70000, "port"), ("max_concurrency", 0, "max_concurrency"), ("request_timeout_s", 0,
                                                                          "request_timeout_s"),
    ("host", "", "host"),
])
def test_config_errors(key, value, names):
    with pytest.raises(ValueError, match=names):
        ServerConfig(**{key: value})


def test_an_openai_sdk_client_gets_token_ids_and_tags_its_trajectory(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    messages = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=3,
                                           extra_body={"trajectory_id": "sdk"})
    ids = first.choices[0].model_extra["token_ids"]
    assert 0 < len(ids) <= 3 and len(first.choices[0].logprobs.content) == len(ids)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "more"}]
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=3,
                                            extra_headers={"X-Trajectory-Id": "sdk"})
    context = first.model_extra["prompt_token_ids"] + ids  # the sampled ids, kept as they were
    assert second.model_extra["prompt_token_ids"][: len(context)] == context
    with pytest.raises(openai.BadRequestError, match="stop"):
        client.chat.completions.create(model="policy", messages=messages, stop=["x"])
    record = server.store.take("sdk")
    sampled = len(ids) + len(second.choices[0].model_extra["token_ids"])
    assert record.turns == 2 and sum(record.model_mask) == sampled


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"agent": "missing_file.py:agent"}, "missing_file.py"),
    ({"agent": 3}, "not callable|function agent"),
    ({"agent": "tests.serving.agents:chat_agent", "tools": ["verl_trainer.agents.builtin_tools:calculator"]},
     "runs the whole conversation"),
    ({"agent": "tests.serving.agents:chat_agent", "server": {"port": -1}}, "server.port"),
])
def test_multi_turn_agent_config_errors(kwargs, names):
    from verl_trainer.agents.config import MultiTurnConfig

    with pytest.raises(ValueError, match=names):
        MultiTurnConfig(enable=True, **kwargs)
