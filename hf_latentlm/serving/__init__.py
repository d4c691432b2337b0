"""`hf-latentlm serve`: an OpenAI-compatible HTTP server (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
streaming as server-sent events) for every family, with concurrent requests batched into one `generate()` call.

- `protocol`: the OpenAI request bodies, error JSON and response / chunk shapes;
- `sampling`: a request's sampling fields turned into the family's `generate()` options, validated before queueing;
- `text`: incremental decoding with stop strings (what a row streams equals what it returns whole);
- `scheduler`: the bounded queue and the worker thread that batches rows into one `generate()` call;
- `app`: the FastAPI routes and `serve()`, which runs them with uvicorn.

FastAPI and uvicorn are the `[serve]` extra: only `app` imports them (and pydantic, which FastAPI brings, `protocol`).
This package's own namespace stays light (no torch), so the CLI checks its arguments in a second.
"""

from __future__ import annotations

from pathlib import Path


def model_names(items: list[str]) -> dict[str, str]:
    """`--model DIR` or `--model NAME=DIR` items -> {name: folder}; a bare DIR is named after its folder."""
    models = {}
    for item in items:
        name, sep, folder = item.partition("=")
        if not sep:
            name, folder = Path(item).resolve().name, item
        if not name or not folder:
            raise ValueError(f"--model expects DIR or NAME=DIR, got {item!r}")
        if name in models:
            raise ValueError(f"model name {name!r} given twice: name them with NAME=DIR")
        models[name] = folder
    return models
