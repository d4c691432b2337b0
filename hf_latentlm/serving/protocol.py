"""The OpenAI wire format of the server: request bodies, the error JSON, and the response and stream-chunk objects.

Requests are pydantic models (pydantic comes with FastAPI). Fields the server honours are typed; the OpenAI fields it
does not implement are refused by name unless they hold their neutral value; any other field must be one of the
family's own `generate()` options (`sampling.resolve_sampling` checks it), e.g. `num_inference_steps` for Cola DLM,
sent with the openai client's `extra_body`.
"""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

# OpenAI fields the server does not implement -> the values that mean "off", which are accepted.
UNSUPPORTED_FIELDS = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},), "logprobs": (False, 0),
    "top_logprobs": (0,), "best_of": (1,), "echo": (False,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",),
    "functions": ([],), "function_call": ("none",), "response_format": ({"type": "text"},), "store": (False,),
    "prediction": (), "modalities": (["text"],), "audio": (), "reasoning_effort": (), "web_search_options": (),
}
# Accepted and ignored: they do not change what is generated (parallel_tool_calls only matters with tools).
IGNORED_FIELDS = frozenset({"user", "metadata", "service_tier", "parallel_tool_calls"})


class OpenAIError(Exception):
    """An error answered as OpenAI does: HTTP `status` and {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 for a request the server refuses (bad value, unsupported option)."""
    return OpenAIError(400, message, "invalid_request_error", param, code)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class SamplingRequest(BaseModel):
    """Fields both routes share (`max_tokens` None: the route's default)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    n: StrictInt | None = None  # None: 1
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None

    def extra_fields(self) -> dict:
        """The fields outside the typed ones, without the ignored and the neutral unsupported ones; an unsupported
        OpenAI field with a non-neutral value is refused by name."""
        extra = {}
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED_FIELDS or value is None:
                continue
            if name in UNSUPPORTED_FIELDS:
                if value in UNSUPPORTED_FIELDS[name]:
                    continue
                raise invalid(f"{name} is not supported by this server", param=name, code="unsupported_parameter")
            extra[name] = value
        return extra

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise invalid(f"stop takes at most 4 sequences, got {len(stops)}", param="stop")
        if any(not s for s in stops):
            raise invalid("stop sequences must be non-empty strings", param="stop")
        return stops


class CompletionRequest(SamplingRequest):
    """/v1/completions. `prompt`: a string, or a list of token ids (one prompt; send one request per prompt)."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: the chat template decides what it reads

    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(SamplingRequest):
    """/v1/chat/completions, rendered with the tokenizer's chat template. `max_completion_tokens` is OpenAI's newer
    name of `max_tokens`; without either, a reply may fill the model's context (OpenAI's default)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_object(request_id: str, model: str, text: str, finish_reason: str, use: dict, extra: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use, **extra}


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None = None,
                     extra: dict | None = None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            **(extra or {})}


def chat_object(request_id: str, model: str, text: str, finish_reason: str, use: dict, extra: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": use, **extra}


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None,
               extra: dict | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
            **(extra or {})}


def usage_chunk(request_id: str, model: str, object_name: str, use: dict) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage (OpenAI's form)."""
    return {"id": request_id, "object": object_name, "created": int(time.time()), "model": model, "choices": [],
            "usage": use}
