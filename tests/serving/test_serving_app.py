"""`hf-latentlm serve` over loopback HTTP: one server process for the module, serving a tiny model of every family,
driven with the openai client and plain httpx. Streamed text equals the whole answer, and both equal the family's own
generate() of the request alone; concurrent requests share one generate() call and get their tokens alone; bad
requests get OpenAI's error JSON and the server keeps serving; a full queue is a 429; a client that leaves cancels
its row. In process: refused requests draw no seed, and a shutdown answers queued and running requests at once."""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from family_contract import build_tiny
from official_checkpoints import CONVERTED, CONVERTED_CALM, convert_fixture

FAMILIES = ("ar", "plm", "calm", "cola", "aurora")
SERVED = FAMILIES + CONVERTED  # and the official CALM and Cola weights, converted
PROMPT = "ROMEO.\nWhat light"
BATCH_WAIT_MS = 400  # long enough that requests sent together on loopback are batched together
MAX_QUEUE = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def models(tokenizer, tmp_path_factory):
    from hf_latentlm.modeling.modeling_calm import CALMForCausalLM
    from hf_latentlm.modeling.modeling_cola import ColaForCausalLM

    root = tmp_path_factory.mktemp("converted")
    classes = dict(zip(CONVERTED, (CALMForCausalLM, ColaForCausalLM)))
    return {**{family: build_tiny(family, tokenizer).eval() for family in FAMILIES},
            **{name: classes[name].from_pretrained(convert_fixture(name, root / name)).eval() for name in CONVERTED}}


@pytest.fixture(scope="module")
def server(models, tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    for family, model in models.items():
        model.save_pretrained(root / family)
        tokenizer.save_pretrained(root / family)
    port = free_port()
    command = [sys.executable, "-m", "hf_latentlm.cli", "serve", *(f"--model={f}={root / f}" for f in SERVED),
               "--port", str(port), "--batch-wait-ms", str(BATCH_WAIT_MS), "--max-queue", str(MAX_QUEUE),
               "--log-level", "info"]
    log = open(root / "server.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (root / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up in 120 s"
            time.sleep(0.2)
        yield base
    finally:
        # A graceful stop (uvicorn's shutdown, then the schedulers'), awaited in the log; the interpreter's own
        # teardown after it (seconds of module finalisation) is not waited for.
        process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 20
        while process.poll() is None and "Finished server process" not in (root / "server.log").read_text():
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        process.kill()
        process.wait()
        log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def alone(model, tokenizer, prompt_ids, max_tokens, seed) -> str:
    """The family's own generate() of the request alone, decoded (AR: greedy, the test's temperature 0)."""
    ids = torch.tensor([prompt_ids])
    if getattr(model, "row_seeds_option", None):
        out = model.generate(ids, max_new_tokens=max_tokens, eos_token_id=None, **{model.row_seeds_option: [seed]})
    else:
        out = model.generate(ids, do_sample=False, max_new_tokens=max_tokens, eos_token_id=None)
    return tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)


def sampling_of(family: str) -> dict:
    return {"temperature": 0.0} if family == "ar" else {}


def metrics(server, family):
    return httpx.get(f"{server}/metrics").json()[family]


def test_models_route_lists_every_served_model(client):
    assert sorted(m.id for m in client.models.list().data) == sorted(SERVED)


def test_streamed_text_equals_the_whole_answer_and_generate_alone_for_every_family(client, models, tokenizer):
    def check(family):
        options = dict(model=family, prompt=PROMPT, max_tokens=10, seed=7, **sampling_of(family))
        whole = client.completions.create(**options)
        chunks = list(client.completions.create(stream=True, **options))
        return whole, chunks

    with concurrent.futures.ThreadPoolExecutor(len(SERVED)) as pool:  # one worker per model: they run side by side
        answers = dict(zip(SERVED, pool.map(check, SERVED)))
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    for family, (whole, chunks) in answers.items():
        streamed = "".join(chunk.choices[0].text for chunk in chunks)
        assert streamed == whole.choices[0].text == alone(models[family], tokenizer, prompt_ids, 10, 7), family
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == 10 and whole.usage.prompt_tokens == len(prompt_ids)


def test_chat_streams_what_it_answers_whole_and_refuses_a_system_message(client, server):
    messages = [{"role": "user", "content": "Say hello"}]
    whole = client.chat.completions.create(model="plm", messages=messages, max_tokens=8, seed=3)
    chunks = list(client.chat.completions.create(model="plm", messages=messages, max_tokens=8, seed=3, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    with httpx.stream("POST", f"{server}/v1/chat/completions", json={
            "model": "plm", "messages": messages, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    usage_chunk = json.loads(lines[-2][6:])  # OpenAI's usage chunk: no choices
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 2
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="plm", max_tokens=2,
                                       messages=[{"role": "system", "content": "Be brief"}, *messages])
    assert err.value.status_code == 400
    assert err.value.body["param"] == "messages" and "system" in err.value.body["message"]


@pytest.mark.parametrize("family", ["ar", "plm", CONVERTED_CALM])
def test_two_concurrent_clients_share_a_batch_and_get_their_tokens_alone(client, family):
    requests = [dict(model=family, prompt=PROMPT, max_tokens=9, seed=11, temperature=1.0 if family == "ar" else None),
                dict(model=family, prompt="JULIET.\nO", max_tokens=5, seed=12)]
    ask = lambda options: client.completions.create(**{k: v for k, v in options.items() if v is not None})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = list(pool.map(ask, requests))
    shared = [answer.model_extra["hf_latentlm"] for answer in together]
    assert shared[0]["batch_size"] == shared[1]["batch_size"] == 2 and shared[0]["batch_id"] == shared[1]["batch_id"]
    for options, answer in zip(requests, together):
        single = ask(options)
        assert single.model_extra["hf_latentlm"]["batch_size"] == 1
        assert single.choices[0].text == answer.choices[0].text


def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(server, client):
    bad_json = httpx.post(f"{server}/v1/completions", content=b'{"model": "ar", "prompt": ',
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400
    assert set(bad_json.json()["error"]) == {"message", "type", "param", "code"}
    for body, param in [({"model": "ar", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
                        ({"model": "plm", "prompt": "x", "temperature": 0.5}, "temperature"),
                        ({"model": "ar", "prompt": "x", "n": 2}, "n"),
                        ({"model": "cola", "prompt": "x", "frequency_penalty": 1.0}, "frequency_penalty")]:
        response = httpx.post(f"{server}/v1/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert httpx.post(f"{server}/v1/completions", json={"model": "gpt-4", "prompt": "x"}).status_code == 404
    assert client.completions.create(model="ar", prompt="x", max_tokens=2).choices[0].finish_reason == "length"


def test_a_full_queue_is_a_429_and_a_disconnected_stream_cancels_its_row(server, client, models, tokenizer):
    long_request = {"model": "cola", "prompt": PROMPT, "max_tokens": 400, "seed": 1, "stream": True,
                    "num_inference_steps": 64}  # a family option, sent as an extra field (and a slow row)
    with httpx.stream("POST", f"{server}/v1/completions", json=long_request) as stream:
        lines = stream.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two more wait while the long row runs
            waiting = [pool.submit(client.completions.create, model="cola", prompt=p, max_tokens=6, seed=s)
                       for p, s in [(PROMPT, 5), ("JULIET.\nO", 6)]]
            deadline = time.monotonic() + 30
            while metrics(server, "cola")["queued"] < MAX_QUEUE:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            full = httpx.post(f"{server}/v1/completions", json={"model": "cola", "prompt": "x", "max_tokens": 2})
            assert full.status_code == 429
            assert full.json()["error"]["type"] == "rate_limit_error" and full.json()["error"]["code"] == "queue_full"
            assert metrics(server, "cola")["running"] == 1
            stream.close()  # the client leaves mid-stream
            answers = [future.result(timeout=60) for future in waiting]
    row = next(r for r in metrics(server, "cola")["recent_rows"] if r["id"] == first["id"])
    assert row["finish_reason"] == "cancelled" and row["generated_tokens"] < 400
    extras = [answer.model_extra["hf_latentlm"] for answer in answers]
    assert [e["batch_size"] for e in extras] == [2, 2] and extras[0]["batch_id"] == extras[1]["batch_id"]
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert answers[0].choices[0].text == alone(models["cola"], tokenizer, prompt_ids, 6, 5)


def test_a_client_that_stops_waiting_for_a_whole_answer_cancels_its_row(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", timeout=BATCH_WAIT_MS / 1000 + 0.3,
                   json={"model": "aurora", "prompt": PROMPT, "max_tokens": 480, "num_inference_steps": 64})
    deadline = time.monotonic() + 30
    while not any(r["max_tokens"] == 480 for r in metrics(server, "aurora")["recent_rows"]):
        assert time.monotonic() < deadline, "the abandoned row was never finished"
        time.sleep(0.1)
    row = next(r for r in metrics(server, "aurora")["recent_rows"] if r["max_tokens"] == 480)
    assert row["finish_reason"] == "cancelled" and row["generated_tokens"] < 480


def test_a_model_without_a_chat_template_refuses_chat_with_a_400(models, tokenizer):
    """In process (FastAPI's TestClient): the same app, a tokenizer saved before the chat template shipped."""
    import copy

    from fastapi.testclient import TestClient

    from hf_latentlm.serving.app import create_app

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with TestClient(create_app({"ar": (models["ar"], plain)}, batch_wait=0.0)) as http:
        refused = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        answered = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0.0})
    assert refused.status_code == 400 and "no chat template" in refused.json()["error"]["message"]
    assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 3


def test_requests_refused_before_they_are_queued_draw_no_seed(models, tokenizer):
    from fastapi.testclient import TestClient

    from hf_latentlm.serving.app import create_app

    with TestClient(create_app({"plm": (models["plm"], tokenizer)}, batch_wait=0.0, seed=100)) as http:
        ask = lambda **fields: http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **fields})
        first = ask()
        refused = [ask(temperature=0.5), ask(max_tokens=0), ask(n=2), ask(no_such_option=3)]
        second = ask()
    assert [r.status_code for r in refused] == [400] * 4
    assert [first.json()["hf_latentlm"]["seed"], second.json()["hf_latentlm"]["seed"]] == [100, 101]


def test_shutting_down_answers_the_queued_request_503_and_ends_the_running_one_at_once(models, tokenizer):
    """uvicorn in a thread, stopped as its SIGINT / SIGTERM handler stops it (`should_exit`), while one slow streamed
    row runs and one request waits (batches of one): the waiting one is a 503, the running one is cancelled at its
    next step and its stream ends with a 503 error event, long before its max_tokens."""
    import threading

    from hf_latentlm.serving.app import build_server, create_app

    app = create_app({"cola": (models["cola"], tokenizer)}, max_batch_size=1, batch_wait=0.0)
    server = build_server(app, port=free_port(), log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    base = f"http://127.0.0.1:{server.config.port}"
    slow = {"model": "cola", "prompt": PROMPT, "max_tokens": 480, "stream": True, "num_inference_steps": 64}
    with httpx.stream("POST", f"{base}/v1/completions", json=slow, timeout=30) as stream:
        lines = (line for line in stream.iter_lines() if line)
        first = json.loads(next(lines)[6:])
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, f"{base}/v1/completions", timeout=30,
                                  json={"model": "cola", "prompt": PROMPT, "max_tokens": 4})
            while httpx.get(f"{base}/metrics").json()["cola"]["queued"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            server.should_exit = True
            rest = list(lines)
            queued = waiting.result()
    thread.join(20)
    assert not thread.is_alive(), "the server did not finish shutting down"
    assert queued.status_code == 503 and queued.json()["error"]["code"] == "server_shutting_down"
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["error"]["code"] == "server_shutting_down"
    row, = app.state.schedulers["cola"].stats.recent_rows
    assert row["id"] == first["id"] and row["finish_reason"] == "cancelled" and row["generated_tokens"] < 480
