"""lm-evaluation-harness adapter: every family as lm-eval model ``"hf-latentlm"``.

    import hf_latentlm.eval.lm_eval  # registers "hf-latentlm" with lm-eval
    lm_eval.simple_evaluate(model="hf-latentlm", model_args="pretrained=DIR", tasks=[...])

    python -m hf_latentlm.eval.lm_eval --model hf-latentlm --model_args pretrained=DIR --tasks ... [--include_path ...]
    hf-latentlm lm-eval --model hf-latentlm --model_args pretrained=DIR --tasks ...

lm-eval finds models only in its own registry (no entry points), so the two commands above import this module and
then run lm-eval's own command line unchanged. See docs/lm_eval.md.

* ``generate_until``: every family through its own ``generate()`` with the task's settings as given (a family
  refuses what it cannot do with its own error), batched with left padding; each request gets its own seed
  (``request_seeds``), so its text does not depend on the batch it lands in.
* ``loglikelihood`` / ``loglikelihood_rolling``: from the forward's next-token logits, for models with token
  likelihoods (``eval.nll.has_likelihood``); other families raise ``NotImplementedError`` naming the family.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Sequence

import torch

try:
    import lm_eval.models  # noqa: F401  (the built-in models: `get_model` imports them only into an empty registry)
    from lm_eval import utils as lm_eval_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import model_registry
    from lm_eval.models.utils import (Collator, _add_special_kwargs, handle_stop_sequences, has_bos_prefix,
                                      normalize_gen_kwargs, postprocess_generated_text, resolve_max_length)
except ImportError as err:  # an optional extra
    raise ImportError(f"hf_latentlm.eval.lm_eval needs lm-evaluation-harness ({err}): pip install "
                      f"'hf-latentlm[eval]'") from err
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from ..families import family_of_model_type
from ..training.scorers import stable_int
from .nll import has_likelihood
from ..modeling.sampling import RowSampler

logger = logging.getLogger(__name__)

MODEL_NAME = "hf-latentlm"
#: lm-eval's default torch seed (`simple_evaluate(torch_random_seed=1234)`, the 4th value of `--seed`).
LM_EVAL_TORCH_SEED = 1234


class StopStringCriteria(StoppingCriteria):
    """Finishes a row once the text of its new tokens contains one of `stop` strings.

    Called by transformers' `generate()` with `input_ids` [B, T + n] (finished rows padded), and by the multi-token
    families' `generate()` with `num_new_tokens` [B], each row's own number of new tokens (the rest is padding).
    Returns [B] bool, True for a row that has met a stop string (it stays True).

    Each call decodes only the tokens a row gained since the last call plus a lookback of `lookback` tokens (a
    token is at least one byte, so a stop string completed by the new tokens lies within the new tokens and the
    last `4 * longest stop + 1` before them, with room for a character split over tokens): linear in length."""

    def __init__(self, tokenizer, stop: Sequence[str], prompt_width: int):
        self.tokenizer, self.stop, self.prompt_width = tokenizer, [s for s in stop if s], prompt_width
        self.lookback = 4 * max((len(s) for s in self.stop), default=0) + 1
        self.done: torch.Tensor | None = None
        self.seen: list[int] = []

    def __call__(self, input_ids: torch.Tensor, scores=None, num_new_tokens: torch.Tensor | None = None,
                 **kwargs) -> torch.BoolTensor:
        if self.done is None:
            self.done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
            self.seen = [0] * input_ids.shape[0]
        width = input_ids.shape[1] - self.prompt_width
        counts = [width] * input_ids.shape[0] if num_new_tokens is None else num_new_tokens.tolist()
        for b in (~self.done).nonzero().flatten().tolist():
            start = max(0, self.seen[b] - self.lookback)
            window = input_ids[b, self.prompt_width + start:self.prompt_width + counts[b]].tolist()
            text = self.tokenizer.decode(window, skip_special_tokens=False)
            self.done[b] = any(s in text for s in self.stop)
            self.seen[b] = counts[b]
        return self.done.to(input_ids.device).clone()


class HFLatentLM(TemplateLM):
    """An `hf_latentlm` model folder (any family) or any causal LM folder, for lm-eval.

    Args (lm-eval's `--model_args`, plus `batch_size` / `device` from `--batch_size` / `--device`):
        pretrained: a local model folder (a `train` / `sft` / ... output, or any transformers causal LM with its
            tokenizer), loaded by `hf_latentlm.loading.load_model_and_tokenizer` (`trust_remote_code=True`); or a
            loaded `PreTrainedModel`, then with `tokenizer`.
        tokenizer: a tokenizer instance or folder (default: the model folder's).
        batch_size: requests per forward / `generate()` call (an int; "auto" is not supported).
        device: "cpu", "cuda", "cuda:1", ... (default: cuda if available, else cpu).
        dtype: "float32", "bfloat16", "float16" (default: as saved).
        max_length: context length (default: the config's `max_position_embeddings`, as lm-eval's `hf` model).
        max_gen_toks: default `max_gen_toks` of tasks that set none (256, as lm-eval's `hf` model).
        seed: base of the per-request generation seeds (default: `torch.initial_seed()`, which `simple_evaluate`
            and the CLI set from `--seed`, 1234 unless given).
        trust_remote_code: accepted for lm-eval's `--trust_remote_code`; folders always load with it.
    """

    def __init__(self, pretrained, tokenizer=None, batch_size: int | str | None = 1, max_batch_size=None,
                 device: str | None = None, dtype: str | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, seed: int | None = None, trust_remote_code: bool | None = None, **kwargs):
        super().__init__()
        if kwargs:
            raise ValueError(f"{MODEL_NAME}: unknown model_args {sorted(kwargs)}; it takes pretrained, tokenizer, "
                             f"batch_size, device, dtype, max_length, max_gen_toks, seed")
        self._batch_size = parse_batch_size(batch_size)
        device = resolve_device(device)
        if isinstance(pretrained, str):
            from ..loading import load_model_and_tokenizer

            model, folder_tokenizer = load_model_and_tokenizer(pretrained, device=device)
        elif tokenizer is None:
            raise ValueError(f"{MODEL_NAME}: a loaded model needs its tokenizer (tokenizer=...)")
        else:
            model, folder_tokenizer = pretrained.to(device).eval(), None
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer or folder_tokenizer
        if self.tokenizer.pad_token_id is None:  # left padding needs one; EOS as transformers' pipelines do
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if dtype not in (None, "auto"):
            if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                raise ValueError(f"{MODEL_NAME}: dtype {dtype!r} is not a torch dtype (float32, bfloat16, float16)")
            model = model.to(getattr(torch, dtype))
        self.model = model
        self._device = torch.device(device)
        self._max_length = int(max_length) if max_length is not None else None
        self._max_gen_toks = int(max_gen_toks)
        # Fixed here: the global torch seed that lm-eval's --seed sets could move later (AR sampling reseeds it).
        self.seed = torch.initial_seed() if seed is None else int(seed)
        spec = family_of_model_type(getattr(model.config, "model_type", None))
        #: The family's registry name, for messages (a model outside the registry: its model type).
        self.family = spec.name if spec is not None else getattr(model.config, "model_type", type(model).__name__)

    # ------------------------------------------------------------------------------------------------------------
    # What lm-eval reads
    # ------------------------------------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # What an empty context is conditioned on (lm-eval's `hf` convention: BOS, else EOS).
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length or resolve_max_length(self.model.config, self.tokenizer)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def get_model_info(self) -> dict:
        return {"model_family": self.family, "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype)}

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        # As lm-eval's `hf` model: the tokenizer's own special tokens, none added to a string that starts with BOS.
        special = _add_special_kwargs(add_special_tokens, None)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    # ------------------------------------------------------------------------------------------------------------
    # Log-likelihoods
    # ------------------------------------------------------------------------------------------------------------

    def check_token_likelihood(self, request_type: str) -> None:
        if not has_likelihood(self.model):
            raise NotImplementedError(
                f"{request_type}: the {self.family} family has no token likelihood (it generates through latents, "
                f"with no per-token probabilities), so it cannot score loglikelihood, multiple_choice or "
                f"loglikelihood_rolling tasks; evaluate it on generate_until tasks (docs/lm_eval.md)")

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self.check_token_likelihood("loglikelihood")
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Σ log p over each whole string, in disjoint windows of `max_length` (lm-eval's rolling windows, the first
        conditioned on the prefix token)."""
        self.check_token_likelihood("loglikelihood_rolling")
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_eval_utils.make_disjoint_window,
                                             lm_eval_utils.get_rolling_token_windows(
                                                 token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                                                 max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=True)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(Σ log p(continuation | context), whether every continuation token is the argmax) per request
        ((context, continuation) strings or None, context ids, continuation ids); the longest first, right padded
        in batches of `batch_size`, the context truncated from the left to fit `max_length`."""
        for request, _, continuation in requests:
            if len(continuation) > self.max_length:
                raise ValueError(f"{MODEL_NAME}: a continuation of {len(continuation)} tokens does not fit "
                                 f"max_length={self.max_length} ({str(request)[:80]}...)")
        ordered = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        results = []
        for chunk in ordered.get_batched(n=self.batch_size):
            inputs = [(context + continuation)[-(self.max_length + 1):][:-1] for _, context, continuation in chunk]
            batch = self.tokenizer.pad({"input_ids": inputs}, padding=True, padding_side="right", return_tensors="pt")
            logits = self.model(input_ids=batch["input_ids"].to(self.device),
                                attention_mask=batch["attention_mask"].to(self.device)).logits
            log_probs = torch.log_softmax(logits.float(), dim=-1).cpu()
            for (request, _, continuation), row, row_log_probs in zip(chunk, inputs, log_probs):
                # Position t predicts token t + 1: the continuation's n tokens are predicted at the row's last n.
                scored = row_log_probs[len(row) - len(continuation):len(row)]
                targets = torch.tensor(continuation)
                answer = (float(scored.gather(1, targets[:, None]).sum()), bool((scored.argmax(-1) == targets).all()))
                results.append(answer)
                if request is not None:
                    self.cache_hook.add_partial("loglikelihood", request, answer)
        return ordered.get_original(results)

    # ------------------------------------------------------------------------------------------------------------
    # Generation
    # ------------------------------------------------------------------------------------------------------------

    def request_seeds(self, requests) -> list[int]:
        """One seed per request, from (base seed, task, document, index, copy): the same whatever the batch size, the
        order of the requests or the other tasks in the run. `copy` numbers identical requests (lm-eval repeats a
        request `repeats` times), so repeated samples differ. Base: `seed`, else `torch.initial_seed()` (set by
        lm-eval's `--seed`)."""
        seen = Counter()
        seeds = []
        for req in requests:
            key = (getattr(req, "task_name", None), getattr(req, "doc_id", None), getattr(req, "idx", None))
            seeds.append(stable_int("lm_eval", self.seed, *key, seen[key]))
            seen[key] += 1
        return seeds

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        seeds = self.request_seeds(requests)
        items = [(req.args[0], req.args[1], seed, getattr(req, "task_name", None))
                 for req, seed in zip(requests, seeds)]
        ordered = Collator(items, sort_fn=lambda item: (-len(self.tok_encode(item[0])), item[0]),
                           group_by="gen_kwargs", group_fn=lambda item: item[1])
        eos_text = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        seeds_option = getattr(self.model, "row_seeds_option", None)
        results = []
        for chunk in ordered.get_batched(n=self.batch_size):
            contexts, gen_kwargs, row_seeds, tasks = zip(*chunk)
            options = normalize_gen_kwargs(gen_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(options.pop("until", None), eos=eos_text)
            max_new_tokens = options.pop("max_gen_toks")
            if "max_length" in options:
                raise ValueError(f"{MODEL_NAME}: the generation kwargs set max_length; use max_gen_toks (new tokens)")
            if options.get("do_sample") is False and options.get("temperature") == 0.0:
                options.pop("temperature")  # greedy is do_sample=False alone (lm-eval's `hf` model does the same)
            if seeds_option is not None:
                if seeds_option in options:
                    raise ValueError(f"{MODEL_NAME} sets {seeds_option} per request; set seed= in model_args")
                options[seeds_option] = list(row_seeds)
            elif options.get("do_sample") and set(options) <= ROW_SAMPLER_OPTIONS:
                options = per_row_sampling(self.model.generation_config, options, row_seeds)
            ids, mask = self.left_padded(contexts, self.max_length - max_new_tokens)
            # Sampling options the per-row sampler does not take (transformers' generate, no per-row seeds): the
            # batch draws from the global RNG, seeded from its first request inside a fork, so that the caller's RNG
            # (and later batches' seeds) are left as they were.
            cuda = [self._device.index or 0] if self._device.type == "cuda" else []
            try:
                with torch.random.fork_rng(devices=cuda):
                    if seeds_option is None and options.get("do_sample"):
                        torch.manual_seed(row_seeds[0])
                    out = self.model.generate(
                        input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                        pad_token_id=self.tokenizer.pad_token_id,
                        stopping_criteria=StoppingCriteriaList([StopStringCriteria(self.tokenizer, until,
                                                                                   ids.shape[1])]),
                        **options)
            except ValueError as err:
                raise ValueError(f"{MODEL_NAME}: the {self.family} family cannot run the generation kwargs "
                                 f"{dict(gen_kwargs[0])} of task {sorted(set(map(str, tasks)))}: {err}. Give it "
                                 f"settings it supports with lm-eval's --gen_kwargs (docs/lm_eval.md)") from err
            sequences = out.sequences if hasattr(out, "sequences") else out
            for context, kwargs, row in zip(contexts, gen_kwargs, sequences[:, ids.shape[1]:].tolist()):
                text = postprocess_generated_text(self.tokenizer.decode(row, skip_special_tokens=True), until, None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, kwargs), text)
        return ordered.get_original(results)

    def left_padded(self, contexts: Sequence[str], max_context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] ids and mask of the contexts, left padded, each left-truncated to `max_context` tokens (an empty
        one is the prefix token)."""
        if max_context < 1:
            raise ValueError(f"{MODEL_NAME}: max_gen_toks leaves no room for a prompt in max_length="
                             f"{self.max_length} tokens")
        rows = [self.tok_encode(c, left_truncate_len=max_context) or [self.prefix_token_id] for c in contexts]
        batch = self.tokenizer.pad({"input_ids": rows}, padding=True, padding_side="left", return_tensors="pt")
        return batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)


#: What `per_row_sampling` takes over from transformers' sampler.
ROW_SAMPLER_OPTIONS = {"do_sample", "temperature", "top_p", "top_k"}


def per_row_sampling(generation_config, options: dict, seeds: Sequence[int]) -> dict:
    """`generate()` options for a model without per-row seeds (transformers' own generate: AR) that sample each row
    from its own generator (`modeling.sampling.RowSampler`), so that a request's text does not depend on its batch. The
    task's temperature / top_p / top_k; unset ones as transformers fills them (the generation config's, else 1.0,
    1.0 and 50)."""
    def chosen(name: str, default: float):
        value = options.get(name)
        value = getattr(generation_config, name, None) if value is None else value
        return default if value is None else value

    count = len(seeds)
    sampler = RowSampler([float(chosen("temperature", 1.0))] * count, [float(chosen("top_p", 1.0))] * count,
                         list(seeds), top_k=int(chosen("top_k", 50)))
    return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None,
            "logits_processor": LogitsProcessorList([sampler])}


def resolve_device(device: str | None) -> str:
    """The device to run on: `device`, except that a CUDA one without CUDA (lm-eval's CLI default is "cuda:0")
    falls back to the CPU with a warning, as lm-eval's `hf` model does; None: cuda if available, else cpu."""
    if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
        chosen = "cuda" if torch.cuda.is_available() else "cpu"
        if device is not None:
            logger.warning("%s: device %r is not available; running on %s", MODEL_NAME, device, chosen)
        return chosen
    return str(device)


def parse_batch_size(value) -> int:
    """lm-eval's `--batch_size` (an int or its text; None: 1). "auto" is refused: there is no memory probe here."""
    if value is None:
        return 1
    text = str(value)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{MODEL_NAME}: batch_size must be a positive integer, got {value!r} ('auto' is not "
                         f"supported)")
    return int(text)


if MODEL_NAME not in model_registry:
    # A lazy placeholder, so that this module run as `__main__` and imported by name register one class.
    model_registry.register(MODEL_NAME, target="hf_latentlm.eval.lm_eval:HFLatentLM")


def main(argv: list[str] | None = None) -> int:
    """lm-eval's own command line (`lm_eval ...`, unchanged) with "hf-latentlm" registered. A refusal (a family's
    missing token likelihood, a generation setting it cannot run) ends with one line on stderr and status 2."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    except (NotImplementedError, ValueError) as err:
        print(f"lm-eval: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
