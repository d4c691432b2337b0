"""What `hf-latentlm train` prints after a finished run: the family's own training report, then for a language model
its decoding speed next to a fresh AR baseline, how close it came to a generated language's optimum, and a sample."""

from __future__ import annotations

import torch

from ..data.generated import parse_corpus
from ..families import BASELINE_FAMILY, FamilySpec, get_family
from ..loading import load_model_and_tokenizer
from .optimum import evaluate_against_optimum, evaluation_stream, optimum_headline
from .sampling import PLAIN_SAMPLING
from .speed import alternating_speed_ratio, fresh_baseline, measure_generation_speed

DEFAULT_SAMPLE_PROMPT = "ROMEO.\n"
OPTIMUM_POSITIONS = 1000  # windows of the quick measurement against a generated language's optimum
SPEED_NEW_TOKENS = 64
SPEED_PAIRS = 3  # alternating model/baseline timings per speed line
NOISY_SPREAD = 1.5  # slowest/fastest run of one model above which the speed lines warn


def sample_prompt(corpus: str | None) -> str:
    """The default prompt of the sample: a generated language's first eight validation words (its word-level
    tokenizer knows no other text), else the embedded corpus's ROMEO."""
    language = parse_corpus(corpus)
    if language is None:
        return DEFAULT_SAMPLE_PROMPT
    words = language.document("validation", 0, 0)[:-1][:8]  # without its end-of-document id
    return " ".join(language.tokenizer().convert_ids_to_tokens(words)) + " "


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int = 100, seed: int = 0, **sampling) -> tuple[str, int]:
    """`prompt`'s continuation (sampled at temperature 1 unless `sampling` says otherwise) and its length in tokens."""
    if not prompt or not prompt.strip():
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"position limit {limit}")
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         **{**PLAIN_SAMPLING, **sampling})
    new = out[0, ids.shape[1]:]
    return tokenizer.decode(new, skip_special_tokens=True), new.numel()


def speed_lines(spec: FamilySpec, preset: str, model, tokenizer, ids: torch.Tensor, source=None,
                source_name: str | None = None) -> list[str]:
    """One line per decoding variant of the family: tokens/s and tokens per model call next to an untrained AR
    baseline of the same preset (or next to `source`, the AR model the run started from, `source_name`), the two
    timed in alternating pairs on the same prompt (`alternating_speed_ratio`), with the median ratio and its range;
    a line of warning when the repeats disagree by more than `NOISY_SPREAD`."""
    if spec.name == BASELINE_FAMILY:
        speed = measure_generation_speed(model, ids, max_new_tokens=SPEED_NEW_TOKENS, repeats=SPEED_PAIRS)
        return [f"{spec.name}: {speed['tokens_per_s']:.0f} tokens/s, "
                f"{1 / speed['model_calls_per_token']:.2f} tokens per model call"]
    baseline, lines, spread = source, [], 1.0
    baseline_name = f"its source AR ({source_name})"
    if source is None:
        baseline = fresh_baseline(model, preset, tokenizer)
        baseline_name = f"untrained AR baseline of the same size ({preset})"
    for label, kwargs in {"": {}, **spec.speed_variants}.items():
        compared = alternating_speed_ratio(model, baseline, ids, SPEED_PAIRS, SPEED_NEW_TOKENS,
                                           generate_kwargs=dict(kwargs))
        speed, ar, (low, high) = compared["model"], compared["baseline"], compared["ratio_range"]
        spread = max(spread, compared["spread"])
        lines.append(f"{spec.name}{f' ({label})' if label else ''}: {speed['tokens_per_s']:.0f} tokens/s, "
                     f"{speed['tokens_per_call']:.2f} tokens per model call | {baseline_name}: "
                     f"{ar['tokens_per_s']:.0f} tokens/s | speed ratio {compared['ratio']:.2f}x "
                     f"(median of {SPEED_PAIRS} alternating pairs, {low:.2f}-{high:.2f}x)")
    if spread > NOISY_SPREAD:
        lines.append(f"warning: repeated timings differ by {spread:.1f}x (a busy machine?); the ratios are uncertain")
    return lines


def print_training_summary(cfg, prompt: str | None = None) -> None:
    """The summary of the finished run `cfg` (a resolved `TrainConfig`), read back from its output folder.
    `prompt`: the sample's (default: `sample_prompt(cfg.corpus)`)."""
    spec = get_family(cfg.family)
    language = parse_corpus(cfg.corpus)  # None for the embedded corpus or the user's text
    if spec.training_report is not None:
        stream = None if language is None else evaluation_stream(language)  # measured on what it trained on
        print(spec.training_report(*load_model_and_tokenizer(cfg.output_dir, language_model=False), stream=stream))
    if not spec.language_model:
        return
    prompt = sample_prompt(cfg.corpus) if prompt is None else prompt
    model, tokenizer = load_model_and_tokenizer(cfg.output_dir)
    text, _ = generate_text(model, tokenizer, prompt, max_new_tokens=100, seed=cfg.seed)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    source = None
    if getattr(cfg, "init_from", None):  # compared with the model it started from, not a fresh one
        from ..training.loop import load_source_model

        source = load_source_model(cfg.init_from).eval()
    lines = speed_lines(spec, cfg.preset, model, tokenizer, ids, source, getattr(cfg, "init_from", None))
    print(f"\n--- speed (batch 1, {SPEED_NEW_TOKENS} new tokens, this process) ---\n" + "\n".join(lines))
    if language is not None:  # what the run reached, as a share of what the language allows
        context_len = min(128, cfg.seq_len - 4)  # windows inside the rows it was trained at
        optimum = evaluate_against_optimum(model.eval(), language, OPTIMUM_POSITIONS, context_len, seed=cfg.seed)
        print(f"--- against the optimum of generated:{language.name} ({OPTIMUM_POSITIONS} validation windows, "
              f"context {context_len}; `hf-latentlm eval` measures more) ---\n{optimum_headline(optimum)}")
    print(f"--- sample ---\n{prompt}{text}\n---")


__all__ = ["DEFAULT_SAMPLE_PROMPT", "generate_text", "print_training_summary", "sample_prompt"]
