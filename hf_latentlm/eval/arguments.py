"""The `--model NAME=DIR` and `--sweep` arguments of `bench` and `report`, read without torch, so that a malformed
one is refused in a second, before the slow imports."""

from __future__ import annotations

import json


def named_models(items: list[str]) -> dict[str, str]:
    """`--model NAME=DIR` items -> {name: folder}, refused with one line when malformed or a name repeats."""
    models = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--model expects NAME=DIR, got {item!r}")
        if name in models:
            raise ValueError(f"model name {name!r} given twice")
        models[name] = path
    return models


def parse_sweeps(items: list[str], models: dict[str, str]) -> dict[str, dict[str, dict]]:
    """`--sweep MODEL:KEY=V1,V2,...` items -> {model: {"KEY=V": {KEY: V}}}, each value read as JSON (a bare word as
    text); refused with one line when malformed or naming a model not among `models`."""
    sweeps = {}
    for item in items:
        model, sep, rest = item.partition(":")
        key, eq, values = rest.partition("=")
        if not (sep and eq and model and key and values):
            raise ValueError(f"--sweep expects MODEL:KEY=V1,V2,..., got {item!r}")
        if model not in models:
            raise ValueError(f"--sweep {item!r}: no model {model!r} among {sorted(models)}")
        sweeps.setdefault(model, {}).update({f"{key}={v}": {key: _json_or_text(v)} for v in values.split(",")})
    return sweeps


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
