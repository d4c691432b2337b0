"""A model against the optimum of the generated language it was trained on (`hf_latentlm.data.generated`).

The language is itself a model the harness can sample and score (`LanguageReference`): the true distribution,
and its unigram marginal, the best a model that ignores the prefix can do. All three are measured with the same
estimator on the same windows, so

    gap closed = (score_model − score_unigram) / (score_true − score_unigram)

is 0 for a model that learnt only word frequencies and 1 for the optimum; its 95% interval comes from one
bootstrap that resamples the positions of all three together. Because the true law is known, the gap is computed
from Brier terms whose hit indicators are replaced by the true probabilities of the draws (`exact_target_terms`:
same expectation, far less noise), next to the harness's own estimator. Families with token likelihoods are also
measured by their NLL excess over the true conditional entropy and their mean KL(true ‖ model).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import torch
from transformers.modeling_outputs import CausalLMOutput

from ..data.generated import GeneratedLanguage
from ..modeling.sampling import model_mode
from .brier import MAX_N, _geometric_score, brier_terms, interval_entry, paired_draws, summarize_brier
from .nll import has_likelihood
from .sampling import evaluation_windows, model_device, trained_row_length

EVALUATION_TOKENS = 200_000  # validation ids the windows are spread over (like the corpus's validation split)
REFERENCE_PAIRS = 16  # pairs of draws per window for the true language and its unigram (cheap: numpy)
LIKELIHOOD_ROWS = 64  # rows of 256 ids for NLL excess and KL: the exact distribution is [rows, 256, vocab] doubles


class LanguageReference(torch.nn.Module):
    """The generated language as a model: `kind="true"` samples and scores the exact next-token distribution,
    `kind="unigram"` its marginal (every prefix ignored). `forward` gives log-probabilities as logits; `generate`
    draws plain samples (temperature 1, no truncation) with torch's global RNG, as the harness seeds it."""

    def __init__(self, language: GeneratedLanguage, kind: str = "true"):
        super().__init__()
        if kind not in ("true", "unigram"):
            raise ValueError(f"kind must be 'true' or 'unigram', got {kind!r}")
        self.language, self.kind = language, kind
        self.config = SimpleNamespace(has_token_likelihood=True, vocab_size=language.vocab_size,
                                      model_type=f"generated-{kind}")
        self.device = torch.device("cpu")

    def _position_probs(self, input_ids: torch.Tensor) -> np.ndarray:
        ids = input_ids.cpu().numpy()
        if self.kind == "unigram":
            return np.broadcast_to(self.language.unigram_probs(), (*ids.shape, self.language.vocab_size))
        return self.language.position_probs(ids)

    def forward(self, input_ids: torch.Tensor, **unused) -> CausalLMOutput:
        probs = torch.from_numpy(np.ascontiguousarray(self._position_probs(input_ids)))
        return CausalLMOutput(logits=torch.log(probs.clamp(min=1e-30)).float())

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 1,
                 do_sample: bool = True, temperature: float = 1.0, top_k: int | None = 0, top_p: float = 1.0,
                 eos_token_id=None, **unused) -> torch.Tensor:
        if not do_sample or temperature != 1.0 or top_k not in (0, None) or top_p != 1.0 or eos_token_id is not None:
            raise ValueError("the reference language draws plain samples only (do_sample, temperature 1, top_k 0, "
                             "top_p 1, no end-of-sequence stop)")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("the reference language scores whole windows: no padding")
        uniforms = torch.rand(input_ids.shape[0], 2 * max_new_tokens, dtype=torch.float64).numpy()
        if self.kind == "unigram":
            new = self.language.sample_unigram(uniforms[:, 1::2])
        else:
            new = self.language.sample_continuations(input_ids.cpu().numpy(), uniforms)
        return torch.cat([input_ids.cpu(), torch.from_numpy(new).long()], dim=1)


def evaluation_stream(language: GeneratedLanguage, split: str = "validation") -> torch.Tensor:
    """The first `EVALUATION_TOKENS` ids of the language's fixed validation (or test) documents."""
    return torch.tensor(language.stream(split, EVALUATION_TOKENS), dtype=torch.long)


def exact_target_terms(language: GeneratedLanguage, contexts: torch.Tensor, draws_a: torch.Tensor,
                       draws_b: torch.Tensor) -> torch.Tensor:
    """Per-position Brier estimates [P, MAX_N] with each hit indicator 1{x₁..ₙ = y₁..ₙ} replaced by its
    expectation over the target y, the true probability p(x₁..ₙ | context): the same expectation as
    `brier.brier_terms`, without the target's sampling noise."""
    states = language.next_state_probs(contexts.numpy())  # the context's filter, shared by both draws
    prob_a, prob_b = (torch.from_numpy(language.continuation_probs(None, d[:, :MAX_N].numpy(), states))
                      for d in (draws_a, draws_b))
    agree = (draws_a[:, :MAX_N] == draws_b[:, :MAX_N]).long().cumprod(dim=1)
    return (prob_a + prob_b - agree).double()


def optimum_position_terms(model, language: GeneratedLanguage, stream: torch.Tensor, num_positions: int,
                           context_len: int, batch_size: int = 64, seed: int = 0, pairs: int = 1,
                           progress: bool = False, generate_kwargs: dict | None = None):
    """(plain, exact) per-position Brier terms [P, MAX_N] from the same draws, each averaged over `pairs`
    independent pairs of samples per window: `brier_terms` against the stream's own continuation (the harness's
    estimator) and `exact_target_terms` (lower variance, what the gap closed is computed from)."""
    contexts, targets = evaluation_windows(stream, num_positions, context_len, MAX_N)
    plain, exact = [], []
    for pair in range(pairs):
        for start, a, b in paired_draws(model, contexts, batch_size, seed + 7919 * pair, progress and pair == 0,
                                        generate_kwargs):
            plain.append(brier_terms(a, b, targets[start:start + len(a)]))
            exact.append(exact_target_terms(language, contexts[start:start + len(a)], a, b))
    # Concatenated pair after pair: [pairs, P, MAX_N], averaged over the pairs.
    return tuple(torch.cat(parts).view(pairs, len(contexts), MAX_N).mean(dim=0) for parts in (plain, exact))


def _bootstrap_gap(terms: dict[str, torch.Tensor], num_bootstrap: int, seed: int) -> dict:
    """Gap closed in Brier-1 and BrierLM-2, each with a 95% interval from resampling positions jointly."""
    num_positions = terms["model"].shape[0]
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(num_positions, (num_bootstrap, num_positions), generator=gen)
    out = {}
    for name, score in (("brier_1", lambda m: m[..., 0]), ("brierlm_2", lambda m: _geometric_score(m[..., :2]))):
        point = {k: score(t.mean(dim=0)) for k, t in terms.items()}
        boots = {k: score(t[idx].mean(dim=1)) for k, t in terms.items()}
        gap = (point["model"] - point["unigram"]) / (point["true"] - point["unigram"])
        out[name] = interval_entry(gap, (boots["model"] - boots["unigram"]) / (boots["true"] - boots["unigram"]))
    return out


@torch.no_grad()
def likelihood_against_optimum(model, language: GeneratedLanguage, stream: torch.Tensor, seq_len: int = 256,
                               num_rows: int = LIKELIHOOD_ROWS, batch_size: int = 8) -> dict:
    """Nats per predicted token on `num_rows` rows of `stream`: the model's NLL, the true conditional entropy of
    the same tokens (the NLL of the true distribution), their difference, the unigram's NLL, and the mean
    per-position KL(true ‖ model)."""
    rows = stream[: num_rows * seq_len].view(-1, seq_len)
    device = model_device(model)
    sums = {"model": 0.0, "true": 0.0, "unigram": 0.0, "kl": 0.0}
    unigram = torch.from_numpy(language.unigram_probs())
    with model_mode(model, False):
        for start in range(0, len(rows), batch_size):
            batch = rows[start:start + batch_size]
            true = torch.from_numpy(language.position_probs(batch.numpy()))[:, :-1]  # [B, T-1, V] float64
            logits = model(input_ids=batch.to(device)).logits[:, :-1].double().cpu()
            if logits.shape[-1] < true.shape[-1]:
                raise ValueError(f"the model scores {logits.shape[-1]} tokens, the language has {true.shape[-1]}")
            # Normalised over the model's whole vocabulary (it may be padded past the language's ids).
            log_model = torch.log_softmax(logits, dim=-1)[..., :true.shape[-1]]
            target = batch[:, 1:]
            picked = lambda logp: -logp.gather(-1, target.unsqueeze(-1)).sum().item()  # noqa: E731
            sums["model"] += picked(log_model)
            sums["true"] += picked(torch.log(true.clamp(min=1e-300)))
            sums["unigram"] -= torch.log(unigram[target]).sum().item()
            support = true > 0
            sums["kl"] += torch.where(support, true * (torch.log(true.clamp(min=1e-300)) - log_model), 0.0).sum().item()
    count = rows[:, 1:].numel()
    mean = {name: value / count for name, value in sums.items()}
    return {"nll": mean["model"], "true_nll": mean["true"], "unigram_nll": mean["unigram"],
            "excess_nll": mean["model"] - mean["true"], "kl": mean["kl"], "num_tokens": count,
            "perplexity_ratio": math.exp(mean["model"] - mean["true"])}


def evaluate_against_optimum(model, language: GeneratedLanguage, num_positions: int = 5000, context_len: int = 128,
                             batch_size: int = 64, seed: int = 0, num_bootstrap: int = 1000, progress: bool = False,
                             generate_kwargs: dict | None = None, split: str = "validation",
                             likelihood: bool = True, pairs: int = 1, reference_pairs: int = REFERENCE_PAIRS) -> dict:
    """The model, the true language and its unigram on the same windows of `split`.

    `model`, `true`, `unigram`: Brier summaries with the harness's estimator (against the stream's own
    continuation), `pairs` / `reference_pairs` pairs of draws per window averaged. `gap_closed`: Brier-1 and
    BrierLM-2 gap closed from the exact-target terms, with one joint bootstrap interval. `likelihood` (a model
    with token likelihoods): NLL excess and KL (`likelihood_against_optimum`)."""
    stream = evaluation_stream(language, split)
    models = {"model": (model, pairs), "true": (LanguageReference(language), reference_pairs),
              "unigram": (LanguageReference(language, "unigram"), reference_pairs)}
    plain, exact = {}, {}
    for name, (m, count) in models.items():
        plain[name], exact[name] = optimum_position_terms(
            m, language, stream, num_positions, context_len, batch_size, seed, count, progress and name == "model",
            generate_kwargs if name == "model" else None)
    result = {"language": language.record(), "split": split, "context_len": context_len, "pairs": pairs,
              "reference_pairs": reference_pairs,
              **{name: summarize_brier(t, num_bootstrap, seed) for name, t in plain.items()},
              "exact_target": {name: summarize_brier(t, num_bootstrap, seed) for name, t in exact.items()},
              "gap_closed": _bootstrap_gap(exact, num_bootstrap, seed)}
    if likelihood and has_likelihood(model):
        # Rows no longer than the model was trained at (the default 256 otherwise).
        row_length = trained_row_length(getattr(model, "config", None), 256)
        result["likelihood"] = {**likelihood_against_optimum(model, language, stream, row_length),
                                "row_length": row_length}
    return result


def percent_interval(entry: dict) -> str:
    """A gap closed with its interval, in percent."""
    return f"{100 * entry['value']:.1f}% [{100 * entry['ci_low']:.1f}, {100 * entry['ci_high']:.1f}]"


def optimum_headline(result: dict) -> str:
    """One line: the gap closed with intervals, and the likelihood excess where there is one."""
    parts = [f"{label} gap closed {percent_interval(result['gap_closed'][name])}"
             for name, label in (("brierlm_2", "BrierLM-2"), ("brier_1", "Brier-1"))]
    if "likelihood" in result:
        lk = result["likelihood"]
        parts.append(f"NLL {lk['nll']:.3f} vs optimum {lk['true_nll']:.3f} nats/token (excess {lk['excess_nll']:.3f}, "
                     f"KL {lk['kl']:.3f})")
    return ", ".join(parts)
