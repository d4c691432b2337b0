"""`hf-latentlm serve`: an OpenAI-compatible HTTP server (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
streaming as server-sent events) for every family, with concurrent requests batched into one `generate()` call.

- `protocol`: the OpenAI request bodies, error JSON and response / chunk shapes;
- `sampling`: a request's sampling fields turned into the family's `generate()` options, validated before queueing;
- `text`: incremental decoding with stop strings (what a row streams equals what it returns whole);
- `scheduler`: the bounded queue and the worker thread that batches rows into one `generate()` call;
- `app`: the FastAPI routes and `serve()`, which runs them with uvicorn.

FastAPI and uvicorn are the `[serve]` extra: only `app` imports them.
"""
