"""Evaluate one model on a split of the embedded corpus (or of a generated language): Brier-n/BrierLM(-2), NLL,
MAUVE, and against a generated language's optimum.

Every family is measured through the same sampling interface (`sampling.sample_continuations`), on the same evenly
spaced windows of the split, so numbers are comparable across families.
"""

from __future__ import annotations

import torch

from ..data.generated import GeneratedLanguage
from ..training.corpus import load_corpus_documents
from ..training.data import token_stream
from .brier import MAX_N, batch_starts, evaluate_brier
from .nll import evaluate_nll, has_likelihood
from .optimum import evaluate_against_optimum, evaluation_stream
from .sampling import check_trained_length, evaluation_windows, sample_continuations, trained_row_length


def split_stream(tokenizer, split: str = "validation") -> torch.Tensor:
    return token_stream(load_corpus_documents(split), tokenizer)


#: Row length of the NLL evaluation, and of MAUVE's prompts and continuations.
NLL_ROW_LENGTH = 256
MAUVE_PROMPT_LEN, MAUVE_CONTINUATION_LEN = 64, 128


def nll_rows(stream: torch.Tensor, seq_len: int = NLL_ROW_LENGTH) -> torch.Tensor:
    n = stream.numel() // seq_len
    if n == 0:
        raise ValueError(f"stream of {stream.numel()} tokens is shorter than seq_len {seq_len}")
    return stream[: n * seq_len].view(n, seq_len)


def generate_mauve_texts(model, tokenizer, stream: torch.Tensor, num_samples: int = 400,
                         prompt_len: int = MAUVE_PROMPT_LEN, continuation_len: int = MAUVE_CONTINUATION_LEN, batch_size: int = 16, seed: int = 0,
                         generate_kwargs: dict | None = None, progress: bool = False) -> tuple[list[str], list[str]]:
    """Model continuations of held-out prompts and the human continuations of the same prompts.
    `generate_kwargs`: extra `generate()` options, merged over the unbiased-sampling defaults."""
    prompts, human = evaluation_windows(stream, num_samples, prompt_len, continuation_len)
    model_texts = []
    for i, start in enumerate(batch_starts(len(prompts), batch_size, progress, "mauve samples")):
        draws = sample_continuations(model, prompts[start:start + batch_size], continuation_len, seed=seed * 7919 + i,
                                     generate_kwargs=generate_kwargs)
        model_texts += tokenizer.batch_decode(draws, skip_special_tokens=True)
    return model_texts, tokenizer.batch_decode(human, skip_special_tokens=True)


def evaluate_model(model, tokenizer, split: str = "validation", num_positions: int = 20000, context_len: int = 128,
                   batch_size: int = 64, seed: int = 0, mauve: bool = False, mauve_samples: int = 400,
                   progress: bool = False, generate_kwargs: dict | None = None, nll: bool = True,
                   language: GeneratedLanguage | None = None, documents: list[str] | None = None) -> dict:
    """Brier-1..4, BrierLM, BrierLM-2 (with intervals); NLL/perplexity when the model has a
    likelihood (and `nll`); MAUVE when asked (needs the `eval` extra). `generate_kwargs`: extra `generate()` options
    for the Brier and MAUVE samples, merged over the unbiased-sampling defaults (NLL does not sample).

    `documents`: texts to evaluate on instead of the embedded corpus's `split`.

    `language`: the generated language the model was trained on. The windows then come from its `split` and the
    result has an `optimum` entry: the true language and its unigram on the same windows, and the gap the model
    closes between them (`optimum.evaluate_against_optimum`).

    Only positions the model was trained at are evaluated (`config.trained_seq_len`): Brier windows or MAUVE
    samples that reach past it are refused before anything runs, and the NLL rows are that long when it is below
    `NLL_ROW_LENGTH` (the result's `nll.row_length` says so)."""
    check_evaluation_lengths(model.config, context_len, mauve)
    if language is not None:
        stream = evaluation_stream(language, split)
        optimum = evaluate_against_optimum(model, language, num_positions, context_len, batch_size, seed,
                                           progress=progress, generate_kwargs=generate_kwargs, split=split,
                                           likelihood=nll)
        result = {"split": split, "brier": {**optimum.pop("model"), "context_len": context_len}, "optimum": optimum}
    else:
        stream = split_stream(tokenizer, split) if documents is None else token_stream(documents, tokenizer)
        result = {"split": split if documents is None else "documents", "brier": evaluate_brier(model, stream, num_positions, context_len, batch_size, seed,
                                                          progress=progress, generate_kwargs=generate_kwargs)}
    if nll and has_likelihood(model):
        row_length = trained_row_length(model.config, NLL_ROW_LENGTH)
        result["nll"] = {**evaluate_nll(model, nll_rows(stream, row_length), batch_size=16), "row_length": row_length}
    if mauve:
        from .mauve import mauve_score
        model_texts, human_texts = generate_mauve_texts(model, tokenizer, stream, num_samples=mauve_samples, seed=seed,
                                                        generate_kwargs=generate_kwargs, progress=progress)
        result["mauve"] = mauve_score(model_texts, human_texts, seed=seed)
    return result


def check_evaluation_lengths(config, context_len: int, mauve: bool, label: str = "the model") -> None:
    """Refuse (ValueError naming both lengths) an evaluation whose Brier windows (context + MAX_N drawn tokens) or
    MAUVE samples reach past the length `config` (an object or config.json's dict) was trained at."""
    check_trained_length(config, context_len, MAX_N, f"Brier windows (--context-len {context_len})", label)
    if mauve:
        check_trained_length(config, MAUVE_PROMPT_LEN, MAUVE_CONTINUATION_LEN, "MAUVE samples", label)
