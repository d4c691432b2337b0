"""Post-training library: SFT and DPO on TRL's trainers, for the AR baseline and every multi-token family
(docs/guide.md, "Post-training").

* The AR baseline (transformers' `LlamaForCausalLM`, and any model outside the family registry) trains with TRL's
  STOCK `SFTTrainer` and `DPOTrainer`; its DPO loss is TRL's `loss_type="sigmoid_norm"`: the log-ratio of each
  response summed over its tokens (the terminal end-of-text token included) and divided by their number — the
  paper's AR score (App. 16.2, "decoder component omitted").
* A multi-token family trains with `LatentSFTTrainer` / `LatentDPOTrainer`, subclasses that change only the loss:
  SFT is the family's own objective with the prompt's labels at -100 (CALM's rows chunk-aligned first,
  `chunk_aligned_sft_batch`); DPO is reference-relative and length-normalised over the family's response score
  (`ResponseScorer`, `scorers.py`), with β = `DPOConfig.beta` (γ = 5 in the paper).
* `sft_config` / `dpo_config`: TRL's own config classes with the paper's optimisation (App. 16.2) and CPU-safe
  defaults. The CLI's `sft` / `dpo` runs are recipes built on these classes: `hf_latentlm/recipes.py`.

Multi-process: each rank computes the draws and reference scores of every N-th pair and the ranks exchange them
(`gather_object`), so every rank holds the same columns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from datasets import Dataset, IterableDataset, concatenate_datasets
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from ..families import family_of_model_type
from ..modeling.modeling_backbone import training_hooks
from ..modeling.sampling import model_mode
from .encoder_kl import EncoderKL
from .loop import parameter_groups
from .scorers import (ResponseScore, ResponseScorer, TokenLikelihoodScorer, TokenStats, core_model, fill_token_id,
                      pair_key, split_rows)

logger = logging.getLogger(__name__)

#: Paper App. 16: Adam (0.9, 0.95), eps 1e-8, no weight decay, clipping at norm 1, linear warmup then linear decay.
OPTIMISATION = dict(adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
                    lr_scheduler_type="linear", optim="adamw_torch")
SFT_WARMUP = 0.03  # fraction of training (App. 16.1)
DPO_WARMUP = 0.10  # fraction of training (App. 16.2: "warmed up over the first 10% of training")
DPO_BETA = 5.0     # γ, the DPO inverse temperature (App. 16.2)
#: Default learning rates of the CPU-scale models (the paper's are for 1.3B/3B models); LoRA runs use 10x.
SFT_LEARNING_RATE = 1e-4
DPO_LEARNING_RATE = 5e-6
LORA_LEARNING_RATE_FACTOR = 10.0

#: Steps between post-training checkpoints (CLI `--save-every`), and how many checkpoints are kept.
SAVE_EVERY = 100
SAVE_TOTAL_LIMIT = 2

REF_CHOSEN, REF_REJECTED = "ref_chosen_score", "ref_rejected_score"
PAIR_KEY = "pair_key"
CANDIDATES = ("chosen", "rejected")


# ---------------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------------

def trainer_arguments(output_dir, learning_rate: float, batch_size: int, max_steps: int | None, seed: int,
                      warmup: float) -> dict:
    """The `TrainingArguments` fields every post-training config shares (SFT, DPO, GRPO): the paper's optimisation,
    CPU-safe precision, resumable checkpoints."""
    return dict(
        output_dir=str(output_dir), learning_rate=learning_rate, per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size, max_steps=max_steps if max_steps else -1, num_train_epochs=1,
        seed=seed, warmup_steps=warmup, **OPTIMISATION,
        # CPU-safe: TRL defaults to bf16 and gradient checkpointing.
        bf16=False, fp16=False, use_cpu=not torch.cuda.is_available(), activation_checkpointing=False,
        report_to=[], logging_steps=10, disable_tqdm=True, dataloader_num_workers=0,
        # Resumable checkpoints (module docstring): every SAVE_EVERY steps and at the last step, the newest 2 kept.
        save_strategy="steps", save_steps=SAVE_EVERY, save_total_limit=SAVE_TOTAL_LIMIT,
    )


def sft_config(output_dir, *, learning_rate: float = SFT_LEARNING_RATE, batch_size: int = 8,
               max_steps: int | None = None, seed: int = 0, **overrides) -> SFTConfig:
    """TRL's `SFTConfig` with the paper's SFT optimisation (3% warmup) and CPU-safe defaults; `overrides` win.
    `max_steps=None` trains one epoch. Checkpoints every `SAVE_EVERY` steps (`save_steps=` to change)."""
    return SFTConfig(**{**trainer_arguments(output_dir, learning_rate, batch_size, max_steps, seed, SFT_WARMUP),
                        **overrides})


def dpo_config(output_dir, *, beta: float = DPO_BETA,
               learning_rate: float = DPO_LEARNING_RATE, batch_size: int = 8, max_steps: int | None = None,
               seed: int = 0, **overrides) -> DPOConfig:
    """TRL's `DPOConfig` with the paper's DPO optimisation (β = γ = 5, 10% warmup) and CPU-safe defaults;
    `overrides` win. The reference is precomputed (`precompute_ref_log_probs=True`): it is the frozen starting
    model, never reloaded from disk. The loss is TRL's length-normalised `sigmoid_norm` for every family (the stock
    `DPOTrainer` computes it for AR, `LatentDPOTrainer` with the family's score); `loss_type=["sigmoid"]` is the
    unnormalised ablation (summed log-ratios / summed response terms)."""
    return DPOConfig(**{**trainer_arguments(output_dir, learning_rate, batch_size, max_steps, seed, DPO_WARMUP),
                        "beta": beta, "loss_type": ["sigmoid_norm"],
                        "precompute_ref_log_probs": True, **overrides})


# ---------------------------------------------------------------------------------------------------------------------
# Dataset checks
# ---------------------------------------------------------------------------------------------------------------------

def _columns(dataset) -> list[str]:
    names = getattr(dataset, "column_names", None)
    if names is None and isinstance(dataset, IterableDataset):
        names = list(next(iter(dataset)).keys())
    return list(names or [])


def check_sft_dataset(dataset, text_field: str = "text", label: str = "train") -> None:
    """ValueError unless `dataset` is one of TRL's SFT formats: prompt/completion (response-only loss), messages,
    a text column or already tokenized input_ids."""
    if dataset is None:
        raise ValueError("SFT needs a train dataset")
    columns = _columns(dataset)
    if "prompt" in columns and "completion" not in columns:
        raise ValueError(f"the {label} dataset has a 'prompt' column but no 'completion': SFT needs prompt/completion "
                         f"pairs (columns: {columns})")
    if not ({"prompt", "completion"} <= set(columns) or {"messages", text_field, "input_ids"} & set(columns)):
        raise ValueError(f"the {label} dataset has none of TRL's SFT columns (prompt + completion, messages, "
                         f"{text_field!r} or input_ids); it has {columns}")


def check_preference_dataset(dataset, label: str = "train") -> None:
    """ValueError unless `dataset` holds preference pairs: chosen + rejected (with a prompt, or one TRL can extract),
    or TRL's tokenized prompt_ids / chosen_ids / rejected_ids."""
    if dataset is None:
        raise ValueError("DPO needs a train dataset")
    columns = set(_columns(dataset))
    if not ({"chosen", "rejected"} <= columns or {"prompt_ids", "chosen_ids", "rejected_ids"} <= columns):
        raise ValueError(f"the {label} dataset is not a preference dataset: it needs 'prompt', 'chosen' and "
                         f"'rejected' columns; it has {sorted(columns)}")


# ---------------------------------------------------------------------------------------------------------------------
# A family's learning-rate scales in a Trainer's optimizer
# ---------------------------------------------------------------------------------------------------------------------

class FamilyLearningRates:
    """Mixin for a transformers `Trainer` (TRL's included), listed before it in the bases: `create_optimizer` gives
    the optimizer one parameter group per (learning-rate scale, decay) pair of the model's
    `parameter_learning_rate_scales()` (`loop.parameter_groups`; Cola DLM: the VAE at `vae_learning_rate_ratio` × the
    rate). The optimizer class and its arguments are the Trainer's own, weight decay goes where the Trainer puts it
    (`get_decay_parameter_names`), and its scheduler keeps the ratios. An optimizer that builds its own groups (a
    factory such as Muon, GaLore, LOMO) takes the Trainer's path when every scale is 1 and is refused (ValueError)
    otherwise, rather than dropping the scales."""

    def create_optimizer(self, model=None):
        from transformers.trainer_optimizer import is_optimizer_factory

        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        optimizer_cls, optimizer_kwargs = (self.optimizer_cls_and_kwargs if self.optimizer_cls_and_kwargs is not None
                                           else self.get_optimizer_cls_and_kwargs(self.args, opt_model))
        if is_optimizer_factory(optimizer_cls) or {"params", "model", "optimizer_dict"} & set(optimizer_kwargs):
            scales = training_hooks(core_model(opt_model)).parameter_learning_rate_scales()
            if any(scale != 1.0 for scale in scales.values()):
                raise ValueError(f"the optimizer {self.args.optim!r} builds its own parameter groups, so the model's "
                                 f"learning-rate scales {scales} would be lost: use an optimizer such as adamw_torch")
            return super().create_optimizer(model)
        decay = set(self.get_decay_parameter_names(opt_model))
        groups = parameter_groups(opt_model, self.args.learning_rate, self.args.weight_decay,
                                  decays=lambda name, param: name in decay)
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer


# ---------------------------------------------------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------------------------------------------------

def chunk_aligned_sft_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor,
                            chunk_size: int, eos_id: int) -> dict[str, torch.Tensor]:
    """CALM's SFT rows, laid out as `CALMForCausalLM.generate()` reads a prompt and writes a response.

    CALM's objective trains the latent of chunk i+1 from the hidden state of chunk i, and only chunks whose K labels
    are all set and whose K tokens are all attended. A TRL row [prompt][response + EOS][padding] would lose the
    response tokens in the chunk that straddles the prompt/response boundary and the final partial chunk (which
    holds the terminal EOS). Each row becomes, in chunks of K = `chunk_size`:

        [EOS left-fill][prompt] [response + terminal EOS][EOS right-fill] [padding chunks]
         attention 0   1         1                       1                 0
         label -100    -100      the token               EOS               -100

    * The left-fill, (−P) mod K EOS tokens with attention 0, is exactly `generate()`'s (`_start_decoding`), so the
      last prompt chunk's hidden state is the one `generate()` draws the first response chunk from, and the
      response starts on a chunk boundary.
    * The right-fill, (−R) mod K EOS tokens (R: response + terminal EOS), makes the last response chunk whole; it is
      labelled and attended so that chunk is trained, its target the EOS-filled chunk, as `CALMResponseScorer` (the
      DPO score) takes it. The fill is never an input to a trained step (it is the row's last real chunk), so
      attending it changes no hidden state. `generate()` stops at the EOS inside that chunk.
    * Rows are right-padded with whole chunks (attention 0, labels -100), so a row gives the same hidden states, the
      same trained chunks and the same loss terms alone or in any batch.

    The trained run (labels != -100 on attended tokens; TRL's response, terminal EOS included) must be the last
    part of each row's real tokens (ValueError otherwise, e.g. for several assistant turns); its targets are the
    row's own ids. A row with no trained token (a completion truncated away) stays context only; a row with no
    prompt (plain-text SFT) starts its response at chunk 0, whose first chunk, as in pretraining, is not a target.
    Returns `input_ids`, `attention_mask`, `labels` [B, C·K], C ≥ 2 (the objective needs two chunks).
    """
    K = chunk_size
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    trained = (labels != -100) & attention_mask.bool()
    rows = []
    for b in range(input_ids.shape[0]):
        if trained[b].any():
            row = split_rows(input_ids[b:b + 1], attention_mask[b:b + 1], trained[b:b + 1].long())[0]
            prompt, response = row.prompt, row.response
        else:
            prompt, response = input_ids[b][attention_mask[b].bool()], input_ids.new_empty(0)
        left, right = (-prompt.numel()) % K, (-response.numel()) % K
        ids = torch.cat([prompt.new_full((left,), eos_id), prompt, response, prompt.new_full((right,), eos_id)])
        mask = torch.ones_like(ids)
        mask[:left] = 0
        target = torch.full_like(ids, -100)
        target[left + prompt.numel():] = ids[left + prompt.numel():]
        rows.append((ids, mask, target))
    width = max(2 * K, max(ids.numel() for ids, _, _ in rows))
    out = {"input_ids": input_ids.new_full((len(rows), width), eos_id),
           "attention_mask": attention_mask.new_zeros((len(rows), width)),
           "labels": labels.new_full((len(rows), width), -100)}
    for b, row in enumerate(rows):
        for name, value in zip(("input_ids", "attention_mask", "labels"), row):
            out[name][b, :value.numel()] = value
    return out


class LatentSFTTrainer(FamilyLearningRates, SFTTrainer):
    """TRL's `SFTTrainer` whose loss is the family's own objective, `model(input_ids, attention_mask, labels)`.

    Labels are TRL's (the prompt, and padding, at -100 for prompt/completion data), so the objective covers the
    response only, the terminal end-of-text included. A family that trains whole chunks (CALM: its config has
    `chunk_size`) gets its rows re-laid out first (`chunk_aligned_sft_batch`). The loss is a per-micro-batch mean
    (`loss_is_scaled_for_ga = False`: the Trainer divides it by the accumulation steps). Every other scalar of the
    model's output (PLM: encoder_nll, decoder_nll, alignment_loss, ...) is logged. Conversational data goes through
    the tokenizer's chat template, whose `{% generation %}` markers let `assistant_only_loss=True` train the answers
    only (a warning says so when a `messages` dataset lacks it). `encoder_kl` (`EncoderKL`, PLM started from a causal
    LM): its weighted KL(source ‖ encoder) over the attended positions is added to the loss and logged as
    `encoder_kl`.
    """

    loss_is_scaled_for_ga = False
    _tag_names = ["trl", "sft", "hf-latentlm"]

    def __init__(self, model, args: SFTConfig | None = None, train_dataset=None, eval_dataset=None,
                 encoder_kl: EncoderKL | None = None, **kwargs):
        for option in ("packing", "padding_free"):
            if getattr(args, option, False):
                raise ValueError(f"LatentSFTTrainer does not support {option}=True: the family's objective reads "
                                 f"one sequence per row (input_ids, attention_mask, labels) and gets no position ids "
                                 f"or sequence lengths, so packed rows would attend across examples")
        check_sft_dataset(train_dataset, getattr(args, "dataset_text_field", "text"))
        if eval_dataset is not None and not isinstance(eval_dataset, dict):
            check_sft_dataset(eval_dataset, getattr(args, "dataset_text_field", "text"), "eval")
        if "messages" in _columns(train_dataset) and not getattr(args, "assistant_only_loss", False):
            logger.warning("LatentSFTTrainer: a 'messages' dataset without assistant_only_loss=True trains every token "
                           "of every turn, the user's included (TRL's default); set assistant_only_loss=True (the "
                           "packaged chat template marks the assistant's answers) for the response-only loss")
        super().__init__(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs)
        config = core_model(self.model).config
        #: K of a family that trains whole chunks (CALM), else None; its rows are chunk-aligned in `model_inputs`.
        self.chunk_size: int | None = getattr(config, "chunk_size", None)
        self.fill_token_id = fill_token_id(config)
        if encoder_kl is not None:
            spec = family_of_model_type(config.model_type)
            if spec is None or spec.init_from is None:  # the families whose encoder pass is a causal LM's
                raise ValueError(f"encoder_kl holds the encoder pass of a model started from a causal LM "
                                 f"(--init-from); a {config.model_type!r} model has none")
            encoder_kl.source.to(self.accelerator.device)
        self.encoder_kl = encoder_kl

    @staticmethod
    def response_labels(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The labels the model is trained on: TRL's `labels` (else the input ids), -100 on padding and, where the
        batch carries one, outside the `completion_mask`."""
        labels = inputs.get("labels", inputs["input_ids"])
        if inputs.get("attention_mask") is not None:
            labels = labels.masked_fill(inputs["attention_mask"] == 0, -100)
        if inputs.get("completion_mask") is not None:
            labels = labels.masked_fill(inputs["completion_mask"] == 0, -100)
        return labels

    def model_inputs(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`input_ids`, `attention_mask`, `labels` the model's objective reads: TRL's batch with `response_labels`;
        for a chunked family (CALM), chunk-aligned by `chunk_aligned_sft_batch`."""
        ids, mask, labels = inputs["input_ids"], inputs.get("attention_mask"), self.response_labels(inputs)
        if self.chunk_size:
            return chunk_aligned_sft_batch(ids, mask, labels, self.chunk_size, self.fill_token_id)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        batch = self.model_inputs(inputs)
        out = model(**batch)
        scalars = dict(out.items())
        if self.encoder_kl is not None:
            out.loss, parts = self.encoder_kl.add_to(out, batch["input_ids"], batch["attention_mask"])
            scalars.update(parts)
        for name, value in scalars.items():
            if name != "loss" and isinstance(value, torch.Tensor) and value.dim() == 0:
                self._metrics[mode][name].append(self.accelerator.gather_for_metrics(value.detach()).mean().item())
        self.log_token_metrics(mode, out, batch["labels"], inputs)
        return (out.loss, out) if return_outputs else out.loss

    def log_token_metrics(self, mode: str, out, labels: torch.Tensor, inputs) -> None:
        """TRL's SFTTrainer metrics that have a meaning here: `num_tokens` (the attended tokens of TRL's batches
        seen in training, as TRL counts them) for every family; `mean_token_accuracy` and `entropy` (of the
        next-token distribution, over the trained targets) for a family whose output has next-token `logits` [B, T, V]
        (PLM: its encoder's; CALM, Cola and AURORA predict latents, not tokens, so these two are not logged)."""
        metrics = self._metrics[mode]
        if mode == "train":
            attended = inputs["attention_mask"].sum() if inputs.get("attention_mask") is not None else \
                torch.tensor(inputs["input_ids"].numel(), device=inputs["input_ids"].device)
            self._total_train_tokens += self.accelerator.gather_for_metrics(attended).sum().item() // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        logits = out.get("logits")
        if not (isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.shape[:2] == labels.shape
                and getattr(core_model(self.model).config, "has_token_likelihood", True)):
            return
        targets = labels[:, 1:]
        (count,), (correct,), (entropy,), _ = token_totals(self.accelerator,
                                                           TokenStats.of(logits[:, :-1], targets, targets != -100))
        metrics["mean_token_accuracy"].append(correct / max(count, 1))
        metrics["entropy"].append(entropy / max(count, 1))


# ---------------------------------------------------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------------------------------------------------

@dataclass
class ScoredPreferenceCollator:
    """TRL's preference collator (`base`: [chosen; rejected] rows with input_ids, attention_mask, completion_mask)
    plus the stored draws as `draw_<key>` [2B, ...] (padded along dim 1 with the scorer's pad values) and the
    reference scores `ref_chosen_score` / `ref_rejected_score` [B]."""

    base: Callable
    draw_keys: Sequence[str]
    pad_values: Mapping[str, float | int]

    def __call__(self, examples: list[dict]) -> dict:
        needed = [REF_CHOSEN, REF_REJECTED] + [f"{c}_draw_{k}" for c in CANDIDATES for k in self.draw_keys]
        missing = [name for name in needed if name not in examples[0]]
        if missing:
            raise ValueError(f"preference examples lack the precomputed columns {missing}: build the dataset through "
                             f"LatentDPOTrainer, which adds them")
        batch = self.base(examples)
        if PAIR_KEY in examples[0]:  # a scorer whose draws come from the pair keys makes them again from these
            batch[PAIR_KEY] = [e[PAIR_KEY] for e in examples]
        for key in self.draw_keys:
            rows = [torch.as_tensor(e[f"{c}_draw_{key}"]) for c in CANDIDATES for e in examples]
            pad = self.pad_values.get(key, 0)
            batch[f"draw_{key}"] = (torch.stack(rows) if rows[0].dim() == 0
                                    else torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad))
        for name in (REF_CHOSEN, REF_REJECTED):
            batch[name] = torch.tensor([e[name] for e in examples], dtype=torch.float32)
        return batch


def token_totals(accelerator, tokens: TokenStats, halves: int = 1) -> list[list[float]]:
    """[field][half]: each `TokenStats` field (count, correct, entropy_sum, logit_sum) summed over the rows of each of
    `halves` equal row blocks (DPO: chosen, rejected) and over every process (one all-gather)."""
    fields = dataclasses.astuple(tokens)
    local = torch.stack([part.sum() for value in fields for part in value.float().chunk(halves)])
    total = accelerator.gather(local).view(-1, local.numel()).sum(0)
    return total.view(len(fields), halves).tolist()


def scorer_for(model) -> ResponseScorer:
    """The response scorer of `model`'s family (through DDP / PEFT wrappers): its registry entry's
    `response_scorer`, else `TokenLikelihoodScorer` for a family with a token likelihood (next-token `logits`;
    `config.has_token_likelihood`, True unless the family says otherwise). ValueError for a model
    outside the registry (an autoregressive model trains with TRL's own `DPOTrainer`, loss_type="sigmoid_norm") and
    for a family with neither."""
    core = core_model(model)
    model_type = getattr(getattr(core, "config", None), "model_type", None)
    spec = family_of_model_type(model_type) if model_type is not None else None
    if spec is None:
        raise ValueError(f"no response scorer for model type {model_type!r}, which is not a registered family: an "
                         f"autoregressive model trains with TRL's own DPOTrainer and loss_type='sigmoid_norm' "
                         f"(hf_latentlm.training.post_training.dpo_config)")
    if spec.response_scorer is not None:
        return spec.response_scorer()
    if getattr(core.config, "has_token_likelihood", True):  # its forward returns next-token logits
        return TokenLikelihoodScorer()
    raise ValueError(f"the {spec.name} family has no token likelihood and its registry entry names no "
                     f"response_scorer: DPO needs one (a ResponseScorer class, FamilySpec.response_scorer)")


#: TRL `DPOConfig` options the latent loss does not implement, with the default that is allowed (refused otherwise;
#: an option the installed TRL lacks, e.g. `rpo_alpha`, is skipped). `DPO_OPTION_EQUIVALENTS`: other values
#: that mean the default (`loss_weights=[1.0]`, `router_aux_loss_coef=0.0`), accepted.
#:
#: TRL's `DPOConfig` fields, one by one:
#: * honoured as TRL does (TRL's own `__init__`, dataset preparation, collator or `Trainer`): learning_rate,
#:   model_init_kwargs, trust_remote_code, disable_dropout, dataset_num_proc, max_length, pad_to_multiple_of,
#:   precompute_ref_batch_size (the batch size of the draws/reference pass), beta, activation_offloading (TRL wraps
#:   `training_step`), pad_token (deprecated); padding_free: TRL itself warns and falls back to padding.
#: * checked by `LatentDPOTrainer.__init__`: loss_type (["sigmoid_norm"] or ["sigmoid"]), precompute_ref_log_probs
#:   (forced True, with a warning), sync_ref_model (refused), truncation_mode (only "keep_start").
#: * refused unless at their default: the entries below. f_divergence_type: the latent loss is the reverse-KL
#:   (standard) DPO loss; router_aux_loss_coef: `compute_loss` adds no Mixture-of-Experts auxiliary loss.
#: * inert, as in stock TRL, because the option that reads them is refused: f_alpha_divergence_coef (only with
#:   f_divergence_type="alpha_divergence"), discopop_tau (only with loss_type "discopop"), ref_model_mixup_alpha and
#:   ref_model_sync_steps (only with sync_ref_model).
UNSUPPORTED_DPO_OPTIONS = {"label_smoothing": 0.0, "ld_alpha": None, "rpo_alpha": None, "loss_weights": None,
                           "use_weighting": False, "f_divergence_type": "reverse_kl", "router_aux_loss_coef": None}
DPO_OPTION_EQUIVALENTS = {"loss_weights": ([1.0],), "router_aux_loss_coef": (0.0,)}


def trl_dpo_default(name: str):
    """The default of `DPOConfig` field `name` in the installed TRL (loss_type ["sigmoid"], beta 0.1)."""
    field = next(f for f in dataclasses.fields(DPOConfig) if f.name == name)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def warn_on_trl_dpo_defaults(args: DPOConfig) -> None:
    """Logs a warning when `args` keeps TRL's default loss_type or beta (a plain `DPOConfig`): the run then trains
    TRL's unnormalised sigmoid loss and/or β = 0.1, not the paper's length-normalised loss with β = γ = 5, which
    `dpo_config()` sets."""
    defaults = [name for name in ("loss_type", "beta") if getattr(args, name) == trl_dpo_default(name)]
    if defaults:
        logger.warning(f"LatentDPOTrainer trains with loss_type={list(args.loss_type)} and beta={args.beta}; "
                       f"{' and '.join(defaults)} {'is' if len(defaults) == 1 else 'are'} TRL's DPOConfig default, "
                       f"not the paper's loss (loss_type=['sigmoid_norm'], the length-normalised score, with "
                       f"beta={DPO_BETA}). hf_latentlm.training.post_training.dpo_config(output_dir, ...) builds the "
                       f"paper's config (its keyword overrides win)")


class LatentDPOTrainer(FamilyLearningRates, DPOTrainer):
    """TRL's `DPOTrainer` with a family's response score (`ResponseScorer`) in place of summed log-probabilities.

    loss = mean over pairs of −log σ(β·(δ+ − δ−)), δ = s_θ(x, u) − s_ref(x, u), s = `ResponseScore.normalised()`
    (loss_type `sigmoid_norm`, the default) or the summed score −loss_sum (`sigmoid`, the unnormalised ablation).

    At construction (TRL's `precompute_ref_log_probs` step, always on here) every pair of the train (and eval)
    dataset gets, from the reference (`ref_model`; under PEFT the adapter-disabled model; else the model itself,
    which has not trained yet): the frozen draws of both candidates (`scorer.draws`, seeded per pair, so independent
    of batching and epoch), stored as columns `chosen_draw_<key>` / `rejected_draw_<key>`, the reference scores
    `ref_chosen_score` / `ref_rejected_score` under those draws, and the `pair_key`. A scorer whose draws are seeded
    by the pair key (`draws_from_keys`: CALM, Cola, AURORA) has them made again at every step instead, except those
    the reference model made (`reference_draws`: Cola's latents, so DPO trains Cola's prior, never its VAE). Both
    passes run under `accelerator.autocast()`, so mixed precision treats policy and reference alike.

    Logged under TRL's DPOTrainer names where the value means the same (docs/guide.md): rewards/* (β·δ, on the
    loss's scale), logps/chosen, logps/rejected (the policy's summed score −loss_sum), scores/* (the s_θ the loss
    uses), num_tokens and, for a score with next-token predictions, entropy, mean_token_accuracy and logits/*.

    TRL options this loss does not implement are refused by name (`UNSUPPORTED_DPO_OPTIONS`). A plain
    `trl.DPOConfig` keeps TRL's defaults (`sigmoid`, β = 0.1), another loss 50 times softer, and gets a warning
    (`warn_on_trl_dpo_defaults`); `dpo_config()` gives the paper's. Without `args`: `dpo_config("latent-dpo")`.

    Resume (`train(resume_from_checkpoint=...)`): the draws and reference scores are computed in `__init__` from the
    model as passed (the frozen start) at global step 0; the checkpoint is loaded later, inside `train()`, so a
    resumed run keeps the reference of the uninterrupted one.
    """

    _tag_names = ["trl", "dpo", "hf-latentlm"]

    def __init__(self, model, ref_model=None, args: DPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 scorer: ResponseScorer | None = None, **kwargs):
        check_preference_dataset(train_dataset)
        if eval_dataset is not None and not isinstance(eval_dataset, dict):
            check_preference_dataset(eval_dataset, "eval")
        if args is None:
            args = dpo_config("latent-dpo")
        if list(args.loss_type) not in (["sigmoid_norm"], ["sigmoid"]):
            raise ValueError(f"LatentDPOTrainer supports loss_type ['sigmoid_norm'] (the length-normalised score) or "
                             f"['sigmoid'] (the summed score), got {args.loss_type}")
        warn_on_trl_dpo_defaults(args)
        if args.sync_ref_model:
            raise ValueError("LatentDPOTrainer keeps a frozen reference (its scores are precomputed): "
                             "sync_ref_model is not supported")
        for option, default in UNSUPPORTED_DPO_OPTIONS.items():
            value = getattr(args, option, default)
            plain = list(value) if isinstance(value, tuple) else value
            if value != default and plain not in DPO_OPTION_EQUIVALENTS.get(option, ()):
                raise ValueError(f"LatentDPOTrainer does not support {option}={value!r} (its loss is "
                                 f"−log σ(β·(δ+ − δ−)) over the family's response score; TRL's {option} would be "
                                 f"silently ignored): leave it at {default!r}")
        if getattr(args, "truncation_mode", "keep_start") != "keep_start":
            raise ValueError(f"LatentDPOTrainer does not support truncation_mode={args.truncation_mode!r}: cutting "
                             f"rows from the left would cut the chosen and rejected prompts differently, while a "
                             f"pair's draws and scores assume one shared prompt; use truncation_mode='keep_start'")
        if not args.precompute_ref_log_probs:
            logger.warning("LatentDPOTrainer precomputes the reference scores and frozen draws; setting "
                           "precompute_ref_log_probs=True")
            args.precompute_ref_log_probs = True
        self.scorer = scorer
        self._draw_keys: list[str] | None = None
        super().__init__(model=model, ref_model=ref_model, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, **kwargs)
        if self.scorer is None:
            self.scorer = scorer_for(self.model)
        self.data_collator = ScoredPreferenceCollator(base=self.data_collator, draw_keys=tuple(self._draw_keys or ()),
                                                      pad_values=dict(self.scorer.draw_pad_values))

    # -- reference ------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def reference_model(self):
        """The frozen reference, in eval mode and without gradient: `ref_model`; under PEFT the model with its
        adapters disabled (or its "ref" adapter); else the model itself, which is the reference only before the
        first optimizer step."""
        from accelerate.utils import is_peft_model
        from trl.trainer.utils import use_adapter

        unwrapped = self.accelerator.unwrap_model(self.model)
        model = self.ref_model if self.ref_model is not None else unwrapped
        with model_mode(model, False), torch.no_grad():
            if self.ref_model is not None:
                yield self.ref_model
            elif is_peft_model(unwrapped):
                with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                    yield unwrapped
            else:
                if self.state.global_step > 0:
                    raise ValueError("the reference is the initial model, which has trained since: pass the "
                                     "dataset when building the trainer, or give a ref_model")
                yield unwrapped

    def _precompute_ref_logps(self, dataset: Dataset, name: str, batch_size: int) -> Dataset:
        """Adds the pair key, the frozen draws and the reference scores of every pair as columns (see the class)."""
        from accelerate.utils import gather_object

        if isinstance(dataset, IterableDataset):
            raise ValueError("LatentDPOTrainer precomputes draws and reference scores: it needs a map-style Dataset")
        if REF_CHOSEN in dataset.column_names:
            return dataset
        missing = {"prompt_ids", "chosen_ids", "rejected_ids"} - set(dataset.column_names)
        if missing:
            raise ValueError(f"the {name} dataset lacks the tokenized columns {sorted(missing)}")
        if len(dataset) == 0:
            raise ValueError(f"the {name} dataset is empty")
        if self.scorer is None:
            self.scorer = scorer_for(self.model)
        collate = getattr(self.data_collator, "base", self.data_collator)
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        mine = list(range(rank, len(dataset), world))
        device = self.accelerator.device
        records = {}
        with self.reference_model() as reference, self.accelerator.autocast():
            for start in range(0, len(mine), batch_size):
                indices = mine[start:start + batch_size]
                examples = [dataset[i] for i in indices]
                batch = collate(examples)
                ids, mask, completion = (batch[k].to(device) for k in ("input_ids", "attention_mask", "completion_mask"))
                keys = [pair_key(e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]) for e in examples]
                draws = self.scorer.draws(reference, ids, mask, completion, keys + keys)
                scores = self.sequence_score(self.scorer.score(reference, ids, mask, completion, draws)).float().cpu()
                n = len(indices)
                stored = self.stored_draws(draws)
                for j, index in enumerate(indices):
                    record = {PAIR_KEY: keys[j], REF_CHOSEN: float(scores[j]), REF_REJECTED: float(scores[n + j])}
                    for key, value in stored.items():
                        record[f"chosen_draw_{key}"] = value[j].cpu().tolist()
                        record[f"rejected_draw_{key}"] = value[n + j].cpu().tolist()
                    records[index] = record
        if world > 1:
            records = {index: record for part in gather_object([records]) for index, record in part.items()}
        names = list(records[0])
        self._draw_keys = sorted(n.removeprefix("chosen_draw_") for n in names if n.startswith("chosen_draw_"))
        columns = {column: [records[i][column] for i in range(len(dataset))] for column in names}
        return concatenate_datasets([dataset, Dataset.from_dict(columns)], axis=1)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        extra = [PAIR_KEY, REF_CHOSEN, REF_REJECTED] + [f"{c}_draw_{k}" for c in CANDIDATES
                                                        for k in self._draw_keys or ()]
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *extra]))

    # -- loss -----------------------------------------------------------------------------------------------------

    def sequence_score(self, score) -> torch.Tensor:
        """s of each row: the length-normalised score (`sigmoid_norm`, the paper's) or the summed one (`sigmoid`)."""
        return score.normalised() if "sigmoid_norm" in self.args.loss_type else -score.loss_sum

    def stored_draws(self, draws: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The draws kept as dataset columns: all of them, or, for a scorer whose draws come from the pair keys
        (`draws_from_keys`), only those the reference model made (`reference_draws`, e.g. Cola's latents)."""
        if not getattr(self.scorer, "draws_from_keys", False):
            return dict(draws)
        return {k: v for k, v in draws.items() if k in getattr(self.scorer, "reference_draws", ())}

    def policy_scores(self, model, inputs) -> torch.Tensor:
        """[2B] s_θ (`sequence_score`) of the stacked [chosen; rejected] rows of `inputs` (`policy_score`)."""
        return self.sequence_score(self.policy_score(model, inputs))

    def policy_score(self, model, inputs) -> ResponseScore:
        """The `ResponseScore` of the stacked [chosen; rejected] rows of `inputs` under their stored draws (and, for
        a scorer whose draws come from the pair keys, those draws made again: `keyed_draws`, else `draws`)."""
        draws = {k.removeprefix("draw_"): v for k, v in inputs.items() if k.startswith("draw_")}
        keys = inputs.get(PAIR_KEY)
        keyed = getattr(self.scorer, "draws_from_keys", False)
        if keyed and keys is not None:
            rows = (inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"], list(keys) + list(keys))
            redraw = getattr(self.scorer, "keyed_draws", None)
            fresh = redraw(core_model(model).config, *rows) if redraw is not None else self.scorer.draws(model, *rows)
            draws = {**fresh, **draws}
        needs_draws = bool(self._draw_keys) or keyed
        if REF_CHOSEN not in inputs or (needs_draws and not draws):
            raise ValueError("the batch lacks the precomputed draws / reference scores (use the trainer's collator)")
        with self.accelerator.autocast():  # as the reference scores were computed
            return self.scorer.score(model, inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"],
                                     draws)

    def log_score_metrics(self, mode: str, score: ResponseScore, inputs) -> None:
        """TRL's DPOTrainer metrics that have a meaning here (see the class docstring): logps/chosen,
        logps/rejected, num_tokens and, for a score with next-token predictions, entropy, mean_token_accuracy,
        logits/chosen, logits/rejected."""
        gather, metrics = self.accelerator.gather_for_metrics, self._metrics[mode]
        logps_chosen, logps_rejected = (-score.loss_sum.detach()).chunk(2)
        metrics["logps/chosen"].append(gather(logps_chosen).mean().item())
        metrics["logps/rejected"].append(gather(logps_rejected).mean().item())
        if mode == "train":
            self._total_train_tokens += gather(inputs["attention_mask"].sum()).sum().item() // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        if score.tokens is not None:  # sums over every rank's tokens, then the ratios (as TRL)
            (count, count_rejected), (correct, _), (entropy, entropy_rejected), (logits, logits_rejected) = \
                token_totals(self.accelerator, score.tokens, halves=2)
            metrics["entropy"].append((entropy + entropy_rejected) / max(count + count_rejected, 1))
            metrics["mean_token_accuracy"].append(correct / max(count, 1))  # TRL: the chosen responses'
            metrics["logits/chosen"].append(logits / max(count, 1))
            metrics["logits/rejected"].append(logits_rejected / max(count_rejected, 1))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        score = self.policy_score(model, inputs)
        scores = self.sequence_score(score)
        chosen, rejected = scores.chunk(2)
        delta_chosen = chosen - inputs[REF_CHOSEN].to(chosen.dtype)
        delta_rejected = rejected - inputs[REF_REJECTED].to(rejected.dtype)
        losses = -F.logsigmoid(self.beta * (delta_chosen - delta_rejected))
        loss = losses.mean()

        gather = self.accelerator.gather_for_metrics
        reward_chosen, reward_rejected = self.beta * delta_chosen.detach(), self.beta * delta_rejected.detach()
        metrics = self._metrics[mode]
        metrics["rewards/chosen"].append(gather(reward_chosen).mean().item())
        metrics["rewards/rejected"].append(gather(reward_rejected).mean().item())
        metrics["rewards/margins"].append(gather(reward_chosen - reward_rejected).mean().item())
        metrics["rewards/accuracies"].append(gather((reward_chosen > reward_rejected).float()).mean().item())
        metrics["scores/chosen"].append(gather(chosen.detach()).mean().item())
        metrics["scores/rejected"].append(gather(rejected.detach()).mean().item())
        self.log_score_metrics(mode, score, inputs)
        return (loss, {"scores": scores.detach(), "losses": losses.detach()}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None
