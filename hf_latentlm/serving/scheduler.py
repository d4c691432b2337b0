"""The bounded queue of rows and the worker thread that runs them, several at a time, through one `generate()`.

The worker takes the oldest queued row, waits up to `batch_wait` seconds for company, and runs every queued row that
can share its call (equal `RowSampling.batch_key`, and all within the model's positions), up to `max_batch_size`,
as one left-padded batch. A `RowObserver` (a `StoppingCriteria`, which every family's `generate()` calls after each
step) hands each row its new tokens as they come, and finishes a row at its own `max_tokens`, at a stop sequence, or
when its client has gone or the server shuts down (`Row.cancelled`), so it stops taking steps.

A row gets the tokens it would get alone: a multi-token family draws each row from its own seed
(`model.row_seeds_option`), and the AR baseline samples through `modeling.sampling.RowSampler`.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from ..modeling.sampling import RowSampler
from .protocol import OpenAIError
from .sampling import RowSampling
from .text import IncrementalText


@dataclass
class RowDone:
    """The last event of a row: why it ended, its generated tokens (EOS included), and the batch it ran in."""

    finish_reason: str  # "stop" (EOS or a stop sequence), "length" (max_tokens) or "cancelled"
    completion_tokens: int
    batch_id: int
    batch_size: int


@dataclass
class Row:
    """One request's generation. `sink` receives, from the worker thread, each new piece of text (str), then one
    `RowDone` or one `OpenAIError`; it must not block (the app forwards to its event loop)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: RowSampling
    text: IncrementalText
    sink: Callable[[object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: int = 0  # its tokens from generate(): up to the one completing a stop sequence, or EOS included
    finish_reason: str | None = None


class RowObserver(StoppingCriteria):
    """Called by `generate()` after each step with `sequences` [B, W + n] (W: the padded prompt width) and, for
    multi-token families, `num_new_tokens` [B] (transformers' own loop adds one token per row per step). Hands each
    unfinished row its new tokens and returns which rows are finished."""

    def __init__(self, rows: list[Row], prompt_width: int, eos_ids: set[int]):
        self.rows, self.width, self.eos_ids = rows, prompt_width, eos_ids

    def __call__(self, input_ids: torch.LongTensor, scores=None, num_new_tokens=None, **kwargs) -> torch.BoolTensor:
        counts = ([input_ids.shape[1] - self.width] * len(self.rows) if num_new_tokens is None
                  else num_new_tokens.tolist())
        for b, row in enumerate(self.rows):
            if row.finish_reason is None:
                self.advance(row, input_ids[b], int(counts[b]))
        return torch.tensor([row.finish_reason is not None for row in self.rows], device=input_ids.device)

    def advance(self, row: Row, sequence: torch.Tensor, count: int) -> None:
        end = min(count, row.max_tokens)
        accepted, eos = [], False
        for token in sequence[self.width + row.generated: self.width + end].tolist():
            if token in self.eos_ids:
                eos = True
                break
            accepted.append(token)
        piece = row.text.add(accepted)
        if piece:
            row.sink(piece)
        # The row's tokens are its text's (a step may commit several: those after the one completing a stop
        # sequence are not taken), plus an EOS that ended it.
        row.generated = row.text.tokens_used + int(eos and not row.text.stopped)
        if row.text.stopped or eos:
            row.finish_reason = "stop"
        elif row.generated >= row.max_tokens:
            row.finish_reason = "length"
        elif row.cancelled.is_set():
            row.finish_reason = "cancelled"


@dataclass
class SchedulerStats:
    """Counters /metrics reports."""

    batches: int = 0
    rows: int = 0
    generated_tokens: int = 0
    rejected_full: int = 0
    rejected_closing: int = 0
    failed_batches: int = 0
    batch_sizes: collections.Counter = field(default_factory=collections.Counter)
    finish_reasons: collections.Counter = field(default_factory=collections.Counter)
    recent_rows: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))


class BatchScheduler:
    """Queue of `Row`s for one model and the worker thread that batches them (see the module docstring).

    max_batch_size: rows per `generate()` call. max_queue: rows waiting (not yet running) before `submit` answers 429.
    batch_wait: seconds the worker waits, after taking the first row of a batch, for more rows to arrive.
    """

    def __init__(self, model, tokenizer, max_batch_size: int = 8, max_queue: int = 64, batch_wait: float = 0.005):
        if max_batch_size < 1 or max_queue < 1 or batch_wait < 0:
            raise ValueError(f"max_batch_size and max_queue must be at least 1 and batch_wait >= 0, got "
                             f"{max_batch_size}, {max_queue}, {batch_wait}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size, self.max_queue, self.batch_wait = max_batch_size, max_queue, batch_wait
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else list(eos or []))
        pad = model.generation_config.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                                   else next(iter(self.eos_ids), 0))
        self.stats = SchedulerStats()
        self.running: list[Row] = []
        self._pending: collections.deque[Row] = collections.deque()
        self._condition = threading.Condition()
        self._closing = False
        self._batch_ids = itertools.count(1)
        self._worker = threading.Thread(target=self._work, name="hf-latentlm-generate", daemon=True)

    # ---- the request side -----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._worker.start()

    def submit(self, row: Row) -> None:
        """Queue `row`, or raise an `OpenAIError`: 503 when the server is shutting down, 429 when the queue is full."""
        with self._condition:
            if self._closing:
                self.stats.rejected_closing += 1
                raise OpenAIError(503, "the server is shutting down; retry on another instance", "server_error",
                                  code="server_shutting_down")
            if len(self._pending) >= self.max_queue:
                self.stats.rejected_full += 1
                raise OpenAIError(429, f"the server's queue is full ({self.max_queue} requests waiting); retry later",
                                  "rate_limit_error", code="queue_full")
            self._pending.append(row)
            self._condition.notify_all()

    def queued(self) -> int:
        with self._condition:
            return len(self._pending)

    def begin_close(self) -> None:
        """Refuse new rows (503), answer the queued ones with 503, and cancel the running ones: they end at their
        next step, answered with a 503 as well. Returns at once (the server calls it as its shutdown starts)."""
        with self._condition:
            self._closing = True
            pending, self._pending = list(self._pending), collections.deque()
            for row in self.running:
                row.cancelled.set()
            self._condition.notify_all()
        for row in pending:
            row.sink(OpenAIError(503, "the server shut down before this request ran", "server_error",
                                 code="server_shutting_down"))

    def close(self, timeout: float = 30.0) -> None:
        """`begin_close()`, then wait (up to `timeout` seconds) for the worker to stop."""
        self.begin_close()
        if self._worker.is_alive():
            self._worker.join(timeout)

    # ---- the worker -----------------------------------------------------------------------------------------------

    def fits(self, rows: list[Row]) -> bool:
        """Whether the rows' longest prompt plus their largest max_tokens fit the model's positions (generate()
        checks the batch as a whole)."""
        if self.max_positions is None:
            return True
        return max(len(r.prompt_ids) for r in rows) + max(r.max_tokens for r in rows) <= self.max_positions

    def _take_batch(self) -> list[Row] | None:
        with self._condition:
            while not self._pending and not self._closing:
                self._condition.wait()
            if self._closing:
                return None
            key = self._pending[0].sampling.batch_key
            deadline = time.monotonic() + self.batch_wait
            while not self._closing:
                same = sum(1 for r in self._pending if r.sampling.batch_key == key)
                left = deadline - time.monotonic()
                if same >= self.max_batch_size or left <= 0:
                    break
                self._condition.wait(left)
            batch = []
            for row in list(self._pending):
                if len(batch) == self.max_batch_size:
                    break
                if row.sampling.batch_key == key and self.fits(batch + [row]):
                    batch.append(row)
                    self._pending.remove(row)
            self.running = batch
            return batch

    def _work(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            live = [row for row in batch if not row.cancelled.is_set()]
            batch_id = next(self._batch_ids)
            for row in batch:
                if row.cancelled.is_set():  # its client left while it waited
                    row.finish_reason = "cancelled"
                    self._finish(row, batch_id, 0)
            if live:
                self._run(live, batch_id)
            with self._condition:
                self.running = []

    def _run(self, rows: list[Row], batch_id: int) -> None:
        try:
            self._generate(rows)
        except Exception as err:  # a failed call answers its rows with a 500; the server keeps serving
            self.stats.failed_batches += 1
            for row in rows:
                row.finish_reason = "error"
                row.sink(OpenAIError(500, f"generation failed: {type(err).__name__}: {err}", "server_error"))
            return
        self.stats.batches += 1
        self.stats.batch_sizes[len(rows)] += 1
        for row in rows:
            self._finish(row, batch_id, len(rows))

    def _finish(self, row: Row, batch_id: int, batch_size: int) -> None:
        piece = row.text.finish() if row.finish_reason != "cancelled" else ""
        if piece:
            row.sink(piece)
        self.stats.rows += 1
        self.stats.generated_tokens += row.generated
        self.stats.finish_reasons[row.finish_reason] += 1
        self.stats.recent_rows.append({"id": row.request_id, "batch_id": batch_id, "batch_size": batch_size,
                                       "generated_tokens": row.generated, "max_tokens": row.max_tokens,
                                       "finish_reason": row.finish_reason})
        if row.finish_reason == "cancelled" and self._closing:  # cut short by the shutdown (or its client left)
            row.sink(OpenAIError(503, "the server shut down while this request ran", "server_error",
                                 code="server_shutting_down"))
        else:
            row.sink(RowDone(row.finish_reason, row.generated, batch_id, batch_size))

    @torch.no_grad()
    def _generate(self, rows: list[Row]) -> None:
        width = max(len(r.prompt_ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, row in enumerate(rows):  # left padding
            ids[b, width - len(row.prompt_ids):] = torch.tensor(row.prompt_ids)
            mask[b, width - len(row.prompt_ids):] = 1
        device = next(self.model.parameters()).device
        observer = RowObserver(rows, width, self.eos_ids)
        kwargs = dict(max_new_tokens=max(r.max_tokens for r in rows), eos_token_id=sorted(self.eos_ids) or None,
                      pad_token_id=self.pad_id, stopping_criteria=StoppingCriteriaList([observer]),
                      return_dict_in_generate=True)
        first = rows[0].sampling
        if first.per_row_sampler:
            kwargs.update(do_sample=False, top_k=None, top_p=None, temperature=None,
                          logits_processor=LogitsProcessorList([RowSampler(
                              [r.sampling.temperature for r in rows], [r.sampling.top_p for r in rows],
                              [r.sampling.seed for r in rows])]))
        else:
            kwargs.update(first.options)
            kwargs[self.model.row_seeds_option] = [r.sampling.seed for r in rows]
        out = self.model.generate(ids.to(device), attention_mask=mask.to(device), **kwargs)
        sequences = out.sequences.cpu()
        counts = getattr(out, "num_new_tokens", None)
        counts = [sequences.shape[1] - width] * len(rows) if counts is None else counts.tolist()
        for b, row in enumerate(rows):  # whatever the last step left unobserved
            if row.finish_reason is None:
                observer.advance(row, sequences[b], int(counts[b]))
            if row.finish_reason is None:  # generate() ended the row (its max_new_tokens)
                row.finish_reason = "length"
