"""The FastAPI app of `hf-latentlm serve`: OpenAI's `/v1/completions`, `/v1/chat/completions` and `/v1/models`, plus
`/health` and `/metrics` (batch counters as JSON), run by uvicorn in `serve()`.

Every request is validated before it is queued (a 400 in OpenAI's error JSON, never a traceback); a full queue is a
429, a server shutting down a 503. Generation runs in each model's worker thread (`scheduler.BatchScheduler`); the
event loop only moves text: the worker hands a row's pieces to its request's `asyncio.Queue` through
`call_soon_threadsafe`. A streamed request is answered as server-sent events in OpenAI's chunk format, ending with
`data: [DONE]`; when its client disconnects, its row is cancelled (it stops taking steps), as is a non-streamed
request's whose client goes away while it waits.

Responses carry, besides OpenAI's fields, `hf_latentlm: {"batch_id", "batch_size", "seed"}` (in the last chunk of a
stream): the `generate()` call the row ran in and the seed it was drawn from, which makes a response reproducible.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from .protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, chat_chunk, chat_object,
                       completion_chunk, completion_object, invalid, new_id, usage, usage_chunk)
from .sampling import resolve_sampling
from .scheduler import BatchScheduler, Row, RowDone
from .text import IncrementalText

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
# Running rows are cancelled as the shutdown starts and end at their next step; this bounds a step that hangs.
GRACEFUL_SHUTDOWN_S = 10.0


@dataclass
class ServedModel:
    name: str
    model: object
    tokenizer: object
    scheduler: BatchScheduler
    created: int


def create_app(models: dict[str, tuple], max_batch_size: int = 8, max_queue: int = 64, batch_wait: float = 0.005,
               seed: int = 0) -> FastAPI:
    """The app serving `models` ({name: (model, tokenizer)}). A request without `seed` gets the next value of a
    counter starting at `seed` (drawn once the request is queued, so refused requests draw none), so that a server
    started the same way answers the same requests the same way. `app.state.schedulers`: {name: BatchScheduler}."""
    served = {name: ServedModel(name, model, tokenizer, BatchScheduler(model, tokenizer, max_batch_size, max_queue,
                                                                       batch_wait), int(time.time()))
              for name, (model, tokenizer) in models.items()}
    seeds = SeedCounter(seed)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        for entry in served.values():
            entry.scheduler.start()
        yield
        for entry in served.values():
            await asyncio.to_thread(entry.scheduler.close)

    app = FastAPI(title="hf-latentlm", lifespan=lifespan)
    app.state.schedulers = {name: entry.scheduler for name, entry in served.items()}

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(Exception, unexpected_error)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(entry) for entry in served.values()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        return model_card(pick(served, name))

    @app.get("/metrics")
    async def metrics():
        return {name: metrics_of(entry.scheduler) for name, entry in served.items()}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse(CompletionRequest, await read_json(request))
        entry = pick(served, body.model)
        prompt_ids = completion_prompt(entry.tokenizer, body.prompt)
        return await run_request(request, entry, body, prompt_ids, COMPLETION_MAX_TOKENS, seeds, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse(ChatCompletionRequest, await read_json(request))
        entry = pick(served, body.model)
        take_max_completion_tokens(body)
        prompt_ids = chat_prompt(entry.tokenizer, body.messages)
        return await run_request(request, entry, body, prompt_ids, None, seeds, chat=True)

    return app


async def openai_error(request, err: OpenAIError):
    return JSONResponse(err.body(), status_code=err.status)


async def unexpected_error(request, err: Exception):  # a bug answers 500 in OpenAI's form, the server lives on
    return JSONResponse(OpenAIError(500, f"{type(err).__name__}: {err}", "server_error").body(), status_code=500)


def take_max_completion_tokens(body: ChatCompletionRequest) -> None:
    """The chat route's newer name for max_tokens, taken into max_tokens; both at once is refused."""
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise invalid("give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
    if body.max_completion_tokens is not None:
        body.max_tokens = body.max_completion_tokens


def model_card(entry: ServedModel) -> dict:
    return {"id": entry.name, "object": "model", "created": entry.created, "owned_by": "hf-latentlm",
            "max_model_len": getattr(entry.model.config, "max_position_embeddings", None),
            "model_type": entry.model.config.model_type}


def metrics_of(scheduler: BatchScheduler) -> dict:
    stats = scheduler.stats
    return {"batches": stats.batches, "rows": stats.rows, "generated_tokens": stats.generated_tokens,
            "queued": scheduler.queued(), "running": len(scheduler.running), "rejected_full": stats.rejected_full,
            "rejected_closing": stats.rejected_closing, "failed_batches": stats.failed_batches,
            "batch_sizes": {str(k): v for k, v in sorted(stats.batch_sizes.items())},
            "finish_reasons": dict(stats.finish_reasons), "recent_rows": list(stats.recent_rows)}


async def read_json(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise invalid(f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def parse(schema, body: dict):
    try:
        return schema.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise invalid(f"{where}: {first['msg']}" if where else first["msg"],
                      param=str(first["loc"][0]) if first["loc"] else None) from None


def pick(served: dict[str, ServedModel], name: str | None) -> ServedModel:
    if name is None:
        if len(served) == 1:
            return next(iter(served.values()))
        raise invalid(f"model is required: this server serves {sorted(served)}", param="model")
    if name not in served:
        raise OpenAIError(404, f"The model '{name}' does not exist; this server serves {sorted(served)}",
                          "invalid_request_error", param="model", code="model_not_found")
    return served[name]


def completion_prompt(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise invalid(f"one prompt per request, got {len(prompt)}: send one request per prompt", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        ids = list(prompt)
        if any(not 0 <= i < len(tokenizer) for i in ids):
            raise invalid(f"prompt token ids must be in [0, {len(tokenizer)})", param="prompt")
    else:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise invalid("the prompt is empty", param="prompt")
    return ids


def chat_prompt(tokenizer, messages) -> list[int]:
    """The messages rendered by the tokenizer's chat template (with the generation prompt), as token ids; what the
    template refuses (a role it has no turn for) is a 400 with the template's message."""
    from jinja2.exceptions import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise invalid("this model's tokenizer has no chat template: use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in messages], tokenize=False,
                                             add_generation_prompt=True)
    except TemplateError as err:
        raise invalid(f"the chat template refuses these messages: {err}", param="messages") from None
    return completion_prompt(tokenizer, text)


class SeedCounter:
    """The seeds of requests without one: `peek()` is the next, `take()` moves on (once the request is queued)."""

    def __init__(self, first: int):
        self.next = first

    def peek(self) -> int:
        return self.next

    def take(self) -> None:
        self.next += 1


async def run_request(request: Request, entry: ServedModel, body, prompt_ids: list[int], default_max_tokens,
                      seeds: SeedCounter, chat: bool):
    """Validate the sampling fields, queue the row, and answer (a stream or one object)."""
    if body.n not in (None, 1):
        raise invalid(f"n must be 1 (got {body.n}): send one request per choice, each with its own seed", param="n")
    limit = getattr(entry.model.config, "max_position_embeddings", None)
    room = None if limit is None else limit - len(prompt_ids)
    if room is not None and room < 1:
        raise invalid(f"the prompt has {len(prompt_ids)} tokens, this model's context is {limit}",
                      param="messages" if chat else "prompt", code="context_length_exceeded")
    max_tokens = body.max_tokens if body.max_tokens is not None else (default_max_tokens or room)
    if max_tokens < 1:
        raise invalid(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if room is not None and max_tokens > room:
        raise invalid(f"this model's context is {limit} tokens: the prompt ({len(prompt_ids)}) plus max_tokens "
                      f"({max_tokens}) do not fit", param="max_tokens", code="context_length_exceeded")
    seed = body.seed if body.seed is not None else seeds.peek()
    sampling = resolve_sampling(entry.model, body.temperature, body.top_p, seed, body.extra_fields())
    request_id = new_id("chatcmpl" if chat else "cmpl")
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    row = Row(request_id, prompt_ids, max_tokens, sampling, IncrementalText(entry.tokenizer, body.stop_strings()),
              lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
    entry.scheduler.submit(row)  # a 429 / 503 raises here
    if body.seed is None:  # no await since peek(): no other request took this seed
        seeds.take()
    answer = Answer(entry.name, request_id, len(prompt_ids), seed, chat)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream_events(answer, row, events, include_usage), media_type="text/event-stream")
    return await whole_answer(request, answer, row, events)


@dataclass
class Answer:
    model: str
    request_id: str
    prompt_tokens: int
    seed: int
    chat: bool

    def extra(self, done: RowDone) -> dict:
        return {"hf_latentlm": {"batch_id": done.batch_id, "batch_size": done.batch_size, "seed": self.seed}}


async def whole_answer(request: Request, answer: Answer, row: Row, events: asyncio.Queue):
    pieces, checked = [], time.monotonic()
    while True:
        try:
            event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            event = None
        if time.monotonic() - checked >= DISCONNECT_POLL_S:  # also while pieces keep coming
            checked = time.monotonic()
            if await request.is_disconnected():
                row.cancelled.set()
                return JSONResponse({}, status_code=499)  # nobody reads it; nginx's "client closed request"
        if event is None:
            continue
        if isinstance(event, OpenAIError):
            raise event
        if isinstance(event, RowDone):
            break
        pieces.append(event)
    text, use = "".join(pieces), usage(answer.prompt_tokens, event.completion_tokens)
    build = chat_object if answer.chat else completion_object
    return JSONResponse(build(answer.request_id, answer.model, text, event.finish_reason, use, answer.extra(event)))


async def stream_events(answer: Answer, row: Row, events: asyncio.Queue, include_usage: bool):
    """Server-sent events: OpenAI chunks, then `data: [DONE]`. Leaving early (the client disconnected) cancels the
    row."""
    def sse(payload) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    rid, name = answer.request_id, answer.model
    try:
        if answer.chat:
            yield sse(chat_chunk(rid, name, {"role": "assistant", "content": ""}))
        while True:
            event = await events.get()
            if isinstance(event, OpenAIError):
                yield sse(event.body())
                break
            if isinstance(event, RowDone):
                final = (chat_chunk(rid, name, {}, event.finish_reason, answer.extra(event)) if answer.chat else
                         completion_chunk(rid, name, "", event.finish_reason, answer.extra(event)))
                yield sse(final)
                if include_usage:
                    yield sse(usage_chunk(rid, name, "chat.completion.chunk" if answer.chat else "text_completion",
                                          usage(answer.prompt_tokens, event.completion_tokens)))
                break
            yield sse(chat_chunk(rid, name, {"content": event}) if answer.chat else completion_chunk(rid, name, event))
        yield "data: [DONE]\n\n"
    finally:
        row.cancelled.set()  # no effect once the row is done; otherwise its client has gone


def load_models(models: dict[str, str], device: str | None = None) -> dict[str, tuple]:
    """{name: folder} -> {name: (model, tokenizer)} through `hf_latentlm.loading` (damaged folders refused)."""
    from ..loading import load_model_and_tokenizer

    return {name: load_model_and_tokenizer(folder, device=device) for name, folder in models.items()}


def build_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                 graceful_shutdown_s: float = GRACEFUL_SHUTDOWN_S):
    """The uvicorn server of `app` (from `create_app`), whose shutdown begins by closing the schedulers.

    uvicorn's own shutdown stops accepting connections, waits for the open ones to finish, and only then runs the
    app's lifespan shutdown: left alone, it would run every queued and running request to its end first. Closing the
    schedulers as the shutdown starts answers the queued requests (and any arriving meanwhile) with a 503 and cancels
    the running rows, which end at their next step, answered with a 503 too; the wait for connections is then short,
    and bounded by `graceful_shutdown_s`.
    """
    import uvicorn

    class SchedulerClosingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            for scheduler in app.state.schedulers.values():
                scheduler.begin_close()
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_shutdown_s)
    return SchedulerClosingServer(config)


def serve(models: dict[str, str], host: str = "127.0.0.1", port: int = 8000, max_batch_size: int = 8,
          max_queue: int = 64, batch_wait: float = 0.005, seed: int = 0, device: str | None = None,
          log_level: str = "info") -> None:
    """Load `models` ({name: folder}) and serve them until interrupted (SIGINT / SIGTERM; see `build_server`)."""
    app = create_app(load_models(models, device), max_batch_size, max_queue, batch_wait, seed)
    server = build_server(app, host, port, log_level)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal it handled once it has shut down, as uvicorn.run does
        pass
    if not server.started:
        raise SystemExit(f"the server did not start on {host}:{port} (see the log above)")
