"""GRPO (reinforcement learning with verifiable rewards) on TRL's `GRPOTrainer`, for every family.

The AR baseline (any model outside the registry) trains with TRL's stock `GRPOTrainer`. A registered family trains
with `LatentGRPOTrainer`, which changes two things and leaves the rest (advantages, clipping, the KL term, loss
types, logging, checkpoints, `accelerate launch`) to TRL:
* rollouts come from the family's own `generate()`, batched with left padding, one seed per row (the family's
  `row_seeds_option`) from (run seed, mode, step, process, row), with the registry's `rollout_options` (PLM: lossless
  `acceptance="exact"`) and the user's `generation_kwargs`;
* the policy log-likelihood of a completion y given x is what the family can honestly give:
  - PLM (`config.has_token_likelihood`): the encoder's log q_θ(y_t | x, y_<t). Exact acceptance commits the tokens
    of one-token-per-call Voronoi sampling, which draws y_t from q̃: the top M = `auxiliary_top_m` tokens of q
    renormalised and rounded to cells of 1/N. q is q̃'s smooth, full-support form (log q̃ is −inf outside a
    model's top M, which would make the reference KL and stale ratios infinite). The cost: log q = log q̃ + log Z_M
    (Z_M the top-M mass), so the on-policy gradient adds A·∇log Z_M, and stale ratios (`num_iterations > 1`) carry
    Z_M(θ) / Z_M(old). Both vanish as Z_M → 1, as it does for a trained model
    (scripts/experiments/plm_top_m_mass.py measures it).
  - CALM, Cola DLM, AURORA-LM (no token likelihood): a surrogate, the family's DPO response score
    (`hf_latentlm.training.scorers`) averaged over M = `num_score_draws` draw sets, s_θ = −(1/M) Σ_m L_θ(x, y; u_m) /
    n_terms. Every completion token carries its row's s_θ, so TRL's token- and sequence-level ratios coincide,
    exp(s_θ − s_old), and the KL estimate is TRL's k3 of s_ref − s_θ. The draws u_m depend on (generation round,
    x, y, m) alone, so the policy, the old policy and the reference share them (identical weights give a ratio of
    exactly 1), and M draw sets divide the variance by M. The surrogate ranks responses by how well the family's
    objective fits them: with a positive advantage its gradient is the family's SFT gradient on that response, as
    ELBO-based RL for diffusion LMs uses. These families log `entropy` as NaN and refuse the options that need a
    token distribution. Cola's latents come without gradient, so GRPO trains Cola's prior, never its VAE.

Rewards: `hf_latentlm.training.tasks.exact_match_reward` and `partial_credit_reward` (TRL reward functions).
"""

from __future__ import annotations

import copy

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp, unwrap_model_for_generation
from trl.trainer.callbacks import SyncRefModelCallback
from trl.trainer.utils import pad

from ..families import family_of_model_type
from .post_training import FamilyLearningRates, trainer_arguments, scorer_for
from .scorers import ResponseScorer, core_model, pair_key, stable_int

GRPO_LEARNING_RATE = 1e-5
NUM_GENERATIONS = 8
#: M, independent draw sets per response in the latent families' surrogate.
NUM_SCORE_DRAWS = 2

#: GRPOConfig options a family's rollouts or log-likelihoods cannot honour, with the value that is allowed: rollouts
#: sample at temperature 1 from the family's own `generate()` (no token filters, no external engine, its own
#: cache), and the log-likelihoods are computed from float32 logits already (no LM-head cast). Every other option
#: (loss types, ε, δ, β, reward weights and scaling, importance-sampling level, iterations, masks, logging) acts
#: on TRL's side of the computation and is honoured; `generation_kwargs` go to the family's `generate()`, which
#: refuses by name what it does not know.
UNSUPPORTED_ROLLOUT_OPTIONS = {"use_vllm": False, "use_transformers_continuous_batching": False,
                               "use_transformers_paged": False, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                               "min_p": None, "repetition_penalty": 1.0, "cache_implementation": None,
                               "cast_lm_head_to_fp32": False}
#: Options that need a token distribution; refused for the surrogate families (CALM, Cola, AURORA).
TOKEN_DISTRIBUTION_OPTIONS = {"top_entropy_quantile": 1.0, "entropy_coef": 0.0, "use_adaptive_entropy": False}


def grpo_config(output_dir, *, learning_rate: float = GRPO_LEARNING_RATE, batch_size: int = 8,
                num_generations: int = NUM_GENERATIONS, max_completion_length: int = 64, max_steps: int | None = None,
                seed: int = 0, **overrides) -> GRPOConfig:
    """TRL's `GRPOConfig` with the package's optimisation (Adam (0.9, 0.95), clipping at 1, no warmup, linear decay)
    and CPU-safe defaults; everything else (loss type, β, ε, reward scaling) is TRL's default; `overrides` win.
    `batch_size` counts completions per device per step, so it must be a multiple of `num_generations`."""
    return GRPOConfig(**{**trainer_arguments(output_dir, learning_rate, batch_size, max_steps, seed, 0.0),
                         "num_generations": num_generations, "max_completion_length": max_completion_length,
                         "disable_dropout": True, **overrides})


def _refuse(args, options: dict, reason: str) -> None:
    for option, allowed in options.items():
        value = getattr(args, option, allowed)
        if value != allowed and not (option == "top_k" and value is None):
            raise ValueError(f"LatentGRPOTrainer does not support {option}={value!r}: {reason}; leave it at "
                             f"{allowed!r}")


def right_aligned(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int):
    """TRL's rows [left padding][prompt][completion][right padding] moved so each row's real tokens come first:
    (input_ids, attention_mask, completion_mask [B, T], columns [B, logits_to_keep]: where completion token j of
    each row now sits). Positions then count from the row's first real token, as the families' `generate()` does."""
    order = torch.sort((attention_mask == 0).long(), dim=1, stable=True).indices
    ids, mask = input_ids.gather(1, order), attention_mask.gather(1, order)
    in_completion = torch.zeros_like(attention_mask)
    in_completion[:, -logits_to_keep:] = attention_mask[:, -logits_to_keep:]
    columns = torch.argsort(order, dim=1)[:, -logits_to_keep:]
    return ids, mask, in_completion.gather(1, order), columns


class LatentGRPOTrainer(FamilyLearningRates, GRPOTrainer):
    """TRL's `GRPOTrainer` for a registered family: rollouts from the family's `generate()`, and the family's
    log-likelihood (PLM: encoder log-probabilities) or likelihood surrogate (CALM, Cola, AURORA: the response score
    averaged over `num_score_draws` draw sets); see the module docstring. Takes TRL's arguments plus `scorer` (a
    `ResponseScorer`, default the registry's) and `num_score_draws` (M, default `NUM_SCORE_DRAWS`).

    The reference (β ≠ 0) is the model as passed, frozen (a copy), rather than TRL's reload from
    `config.name_or_path`, so an in-memory model works too; with PEFT it is TRL's (a new `peft_config`: the
    adapter-disabled model; a model already wrapped in PEFT: a "ref" copy of its adapter). Options a family cannot
    honour are refused by name (`UNSUPPORTED_ROLLOUT_OPTIONS`; `TOKEN_DISTRIBUTION_OPTIONS` for the surrogate
    families; `tools`, `environment_factory` and `rollout_func`, whose rollouts would not be the family's). The
    optimizer honours the family's learning-rate scales (`FamilyLearningRates`: Cola's VAE:DiT ratio)."""

    _tag_names = ["trl", "grpo", "hf-latentlm"]

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 scorer: ResponseScorer | None = None, num_score_draws: int = NUM_SCORE_DRAWS, **kwargs):
        if isinstance(model, str):
            raise ValueError("LatentGRPOTrainer takes a loaded model (hf_latentlm.loading.load_model_and_tokenizer)")
        config = core_model(model).config
        spec = family_of_model_type(config.model_type)
        if spec is None:
            raise ValueError(f"model type {config.model_type!r} is not a registered family: an autoregressive model "
                             f"trains with TRL's own GRPOTrainer")
        if args is None:
            args = grpo_config(f"{spec.name}-grpo")
        for name in ("tools", "environment_factory", "rollout_func"):
            if kwargs.get(name) is not None:
                raise ValueError(f"LatentGRPOTrainer does not support {name}: its rollouts come from the family's "
                                 f"own generate()")
        _refuse(args, UNSUPPORTED_ROLLOUT_OPTIONS, f"{spec.name} rollouts are plain samples (temperature 1) of its "
                                                   f"own generate()")
        self.token_likelihood = bool(getattr(config, "has_token_likelihood", True))
        if not self.token_likelihood:
            _refuse(args, TOKEN_DISTRIBUTION_OPTIONS, f"{spec.name} has no token distribution (its log-likelihood "
                                                      f"is a surrogate, and its entropy is unknown)")
        if isinstance(num_score_draws, bool) or not isinstance(num_score_draws, int) or num_score_draws < 1:
            raise ValueError(f"num_score_draws must be a positive int, got {num_score_draws!r}")
        self.spec, self.num_score_draws = spec, num_score_draws
        self.scorer = None if self.token_likelihood else (scorer or scorer_for(model))
        self.rollout_options = rollout_options(spec, args.generation_kwargs, core_model(model).row_seeds_option)
        self._last_rollout = (None, -1)  # ((mode, optimizer step), index of the last rollout made at it)
        #: [B] draw nonce of the rows being scored (one per generation round; see `surrogate_scores`).
        self._draw_nonces: torch.Tensor | None = None
        # TRL would reload the reference from config.name_or_path, which an in-memory model does not have: TRL
        # is built from a copy of the config that asks for no reference, and the reference is the model as passed.
        frozen = None
        if args.beta != 0.0 and kwargs.get("peft_config") is None and not hasattr(model, "peft_config"):
            frozen = copy.deepcopy(model).eval().requires_grad_(False)
        trl_args = args
        if frozen is not None:  # a shallow copy: the caller's config keeps its β
            trl_args = copy.copy(args)
            trl_args.beta, trl_args.sync_ref_model = 0.0, False
        super().__init__(model=model, reward_funcs=reward_funcs, args=trl_args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, **kwargs)
        self.args, self.beta = args, args.beta
        if frozen is not None:  # prepared as TRL prepares its own reference
            if self.is_deepspeed_enabled:
                self.ref_model = prepare_deepspeed(frozen, self.accelerator)
            elif self.is_fsdp_enabled:
                self.ref_model = prepare_fsdp(frozen, self.accelerator)
            else:
                self.ref_model = self.accelerator.prepare_model(frozen, evaluation_mode=True)
            if args.sync_ref_model:
                self.add_callback(SyncRefModelCallback(ref_model=self.ref_model, accelerator=self.accelerator))

    # -- rollouts -------------------------------------------------------------------------------------------------

    def rollout_seeds(self, count: int) -> list[int]:
        """One generate() seed per row: a function of the run's seed, mode, optimizer step, the rollout's index
        within that step, process and row. So the `num_generations` copies of a prompt differ, every step differs,
        and a rerun, or a run resumed from a checkpoint at a generation boundary, repeats them (TRL does not
        checkpoint its rollout buffer, so with `steps_per_generation > 1` a run resumed mid-window draws anew).
        Also sets the round's draw nonce of the surrogate families (`_generate_and_score_completions`)."""
        mode = "train" if self.model.training else "eval"
        step = self.state.global_step
        index = self._last_rollout[1] + 1 if self._last_rollout[0] == (mode, step) else 0
        self._last_rollout = ((mode, step), index)
        nonce = stable_int(self.args.seed, "draws", mode, step, index, self.accelerator.process_index) % 2**62
        self._draw_nonces = torch.full((count,), nonce, dtype=torch.long)
        return [stable_int(self.args.seed, "rollout", mode, step, index, self.accelerator.process_index, row) % 2**31
                for row in range(count)]

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields:
            raise ValueError(f"the {self.spec.name} family generates text only (images were given)")
        device = self.accelerator.device
        rows = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(rows, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(device)
        attention_mask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="left").to(device)
        with (unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                          gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                                          gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs)
              as unwrapped, torch.no_grad(), self._dist.summon_full_params(self.model_wrapped, recurse=False)):
            seeds_option = core_model(unwrapped).row_seeds_option
            out = unwrapped.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                                     max_new_tokens=self.max_completion_length, eos_token_id=self.eos_token_ids,
                                     pad_token_id=self._tokenizer.pad_token_id,
                                     **{seeds_option: self.rollout_seeds(len(rows))}, **self.rollout_options)
        sequences = out.sequences if hasattr(out, "sequences") else out
        completions = []
        for row in sequences[:, input_ids.shape[1]:].tolist():
            stop = next((i for i, token in enumerate(row) if token in self.eos_token_ids), None)
            completions.append(row if stop is None else row[:stop + 1])  # the first EOS kept, as TRL does
        return completions, None

    # -- log-likelihoods ------------------------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs):
        """TRL's, plus the rows' draw nonce (`draw_nonce`, split and shuffled with them) for the surrogate families:
        one per generation round, so their draws are fresh every round and shared by that round's policy,
        old-policy and reference scores. `rollout_seeds` sets it while TRL scores the old policy and reference."""
        try:
            output = super()._generate_and_score_completions(inputs)
            if not self.token_likelihood:
                output["draw_nonce"] = self._draw_nonces.to(output["completion_ids"].device)
        finally:
            self._draw_nonces = None
        return output

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._draw_nonces = inputs.get("draw_nonce")
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._draw_nonces = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """[B, logits_to_keep] log-likelihood of each completion token (surrogate families: the row's s_θ on every
        token), entropies (NaN for the surrogate families) and no aux loss."""
        if compute_aux_loss:
            raise ValueError("LatentGRPOTrainer has no router aux loss (no family is a mixture of experts)")
        ids, mask, completion, columns = right_aligned(input_ids, attention_mask, logits_to_keep)
        batch_size = batch_size or ids.shape[0]
        logps, entropies = [], []
        for start in range(0, ids.shape[0], batch_size):
            part = slice(start, start + batch_size)
            with self.accelerator.autocast():
                if self.token_likelihood:
                    part_logps, part_entropy = self.token_log_probs(model, ids[part], mask[part], columns[part])
                else:
                    nonces = None if self._draw_nonces is None else self._draw_nonces[part].tolist()
                    row_scores = self.surrogate_scores(model, ids[part], mask[part], completion[part], nonces)
                    part_logps = row_scores[:, None].expand(-1, logits_to_keep)
                    part_entropy = torch.full_like(part_logps, float("nan"))
            logps.append(part_logps)
            entropies.append(part_entropy)
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

    @staticmethod
    def token_log_probs(model, input_ids, attention_mask, columns) -> tuple[torch.Tensor, torch.Tensor]:
        """log q(token) and the entropy of q at each completion column ([B, J]), q the forward's next-token
        distribution (PLM: the encoder's)."""
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        before = (columns - 1).clamp(min=0)
        picked = logits.gather(1, before[..., None].expand(-1, -1, logits.shape[-1])).float()
        log_q = picked.log_softmax(-1)
        target = input_ids.gather(1, columns)
        return log_q.gather(-1, target[..., None]).squeeze(-1), -(log_q.exp() * log_q).sum(-1)

    def surrogate_scores(self, model, input_ids, attention_mask, completion_mask,
                         nonces: list[int] | None = None) -> torch.Tensor:
        """[B] s_θ: the mean over `num_score_draws` draw sets of the family's normalised response score, the draws
        seeded by each row's nonce (its generation round; None: 0), (prompt, completion) ids and the draw index. A
        row without completion tokens (TRL masks them, e.g. under `mask_truncated_completions`) is scored on its
        last prompt token and counts 0, so every micro-batch still runs the model and keeps a gradient graph (as DDP
        and backward need)."""
        has_completion = completion_mask.bool().any(1)
        last_real = attention_mask.long().cumsum(1).argmax(1)
        stand_in = torch.zeros_like(completion_mask).scatter(1, last_real[:, None], 1)
        completion = torch.where(has_completion[:, None], completion_mask, stand_in)
        nonces = nonces or [0] * input_ids.shape[0]
        keys = [f"{nonce}/{rollout_key(i, m, c)}" for nonce, i, m, c in
                zip(nonces, input_ids.tolist(), attention_mask.tolist(), completion.tolist())]
        M = self.num_score_draws
        stacked = [t.repeat(M, 1) for t in (input_ids, attention_mask, completion)]
        draw_keys = [f"{key}/{m}" for m in range(M) for key in keys]
        draws = self.scorer.draws(model, *stacked, draw_keys)
        scores = self.scorer.score(model, *stacked, draws).normalised().view(M, -1).mean(0)
        return torch.where(has_completion.to(scores.device), scores, scores * 0.0)


def rollout_options(spec, generation_kwargs: dict | None, seeds_option: str) -> dict:
    """The registry's rollout options plus `GRPOConfig.generation_kwargs`, which may add options but not change a
    registry one (PLM's lossless acceptance, which its log-probabilities assume) nor set what the trainer sets (the
    lengths, EOS, padding, the per-row seeds `seeds_option`)."""
    extra = dict(generation_kwargs or {})
    fixed = {"max_new_tokens", "do_sample", "eos_token_id", "pad_token_id", "input_ids", "attention_mask", seeds_option}
    for name, value in extra.items():
        if name in fixed:
            raise ValueError(f"generation_kwargs may not set {name!r}: LatentGRPOTrainer sets it (max_new_tokens is "
                             f"GRPOConfig.max_completion_length; every rollout row gets its own seed)")
        if name in spec.rollout_options and value != spec.rollout_options[name]:
            raise ValueError(f"generation_kwargs {name}={value!r}: {spec.name} rollouts use "
                             f"{name}={spec.rollout_options[name]!r}, which the trainer's log-likelihood assumes")
    return {**spec.rollout_options, **extra}


def rollout_key(ids: list[int], mask: list[int], completion: list[int]) -> str:
    """The draw key of one rollout: its real prompt ids and completion ids."""
    prompt = [t for t, m, c in zip(ids, mask, completion) if m and not c]
    response = [t for t, m, c in zip(ids, mask, completion) if m and c]
    return pair_key(prompt, response, ())


__all__ = ["GRPO_LEARNING_RATE", "LatentGRPOTrainer", "NUM_GENERATIONS", "NUM_SCORE_DRAWS", "grpo_config",
           "right_aligned", "rollout_key"]
