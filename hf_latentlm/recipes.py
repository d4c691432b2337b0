"""Post-training recipes, the CLI's `sft`, `dpo` and `grpo`: load a model folder, train it on a task with the
trainers of `training/post_training.py` and `training/grpo.py`, and save a normal checkpoint (a LoRA run merged
first) that `hf-latentlm generate/eval`, the Auto classes and `push` load.

* The family is resolved once (`PostTrainingRun`): the AR baseline (any model outside the registry) trains with
  TRL's stock `SFTTrainer` / `DPOTrainer` / `GRPOTrainer`, every registered family with `LatentSFTTrainer` /
  `LatentDPOTrainer` / `LatentGRPOTrainer`; GRPO's rewards are the task's exact match plus its partial credit
  (`tasks.exact_match_reward`, `tasks.partial_credit_reward`, weighted 1:1 as TRL's default weights);
  LoRA targets come from the registry's `lora_target_modules`.
* Checkpoints: the Trainer saves `output_dir/checkpoint-<step>/` (weights — the adapter under LoRA —, optimizer,
  scheduler, RNG states, `trainer_state.json`) every `save_every` steps and at the last step, keeping the newest
  `SAVE_TOTAL_LIMIT`; `resume=True` (CLI `--resume`) continues from the newest complete one
  (`training.checkpoint.latest_checkpoint`), with the same data order, schedule and RNG, so 2 steps + resume to 4
  ends where 4 straight steps do. The final model is written at the top of `output_dir`; the checkpoint folders
  sit beside it (the top-level `config.json` is the final model's). A fresh run refuses an `output_dir` that holds
  checkpoints (rotation would delete them): resume it or pick another folder. The Trainer's save is not atomic (a
  crash mid-save leaves a partial newest folder beside the previous complete one, `trainer_state.json` written
  last), so `latest_checkpoint` skips a folder without a readable `trainer_state.json`.
* Multi-process: under `torchrun --nproc_per_node N` (or `accelerate launch --multi_gpu`) with `use_cpu=True` on
  CPU, `LatentDPOTrainer` splits the reference precomputation across ranks and gathers it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset
from trl import DPOTrainer, GRPOTrainer, SFTTrainer

from .eval.task import generate_answers
from .families import BACKBONE_LORA_TARGETS, BASELINE_FAMILY, FamilySpec, build_model, family_of_model_type
from .folders import POST_TRAINING_RECORD
from .loading import load_model_and_tokenizer
from .modeling.sampling import model_mode
from .training import tasks
from .training.checkpoint import latest_checkpoint, save_tokenizer
from .training.config import parse_report_to
from .training.encoder_kl import EncoderKL
from .training.grpo import GRPO_LEARNING_RATE, NUM_GENERATIONS, NUM_SCORE_DRAWS, LatentGRPOTrainer, grpo_config
from .training.loop import load_source_model, load_tokenizer
from .training.post_training import (DPO_BETA, DPO_LEARNING_RATE, LORA_LEARNING_RATE_FACTOR, SAVE_EVERY,
                                     SFT_LEARNING_RATE, LatentDPOTrainer, LatentSFTTrainer, dpo_config, sft_config)
from .training.scorers import core_model

#: `rejected_kind` of a pair whose rejected answer the model itself sampled (`with_policy_rejections`).
SAMPLED_REJECTION = "sampled"


@dataclass(frozen=True)
class PostTrainingRun:
    """What one `sft` / `dpo` run needs to know about its model, looked up once: its family (None: the AR baseline
    or another model outside the registry, trained with TRL's stock trainers)."""

    spec: FamilySpec | None

    @classmethod
    def of(cls, model) -> "PostTrainingRun":
        return cls(family_of_model_type(core_model(model).config.model_type))

    @property
    def family(self) -> str:
        return self.spec.name if self.spec is not None else BASELINE_FAMILY

    @property
    def autoregressive(self) -> bool:
        return self.spec is None

    def trainer_class(self, stage: str):
        stock, latent = {"sft": (SFTTrainer, LatentSFTTrainer), "dpo": (DPOTrainer, LatentDPOTrainer),
                         "grpo": (GRPOTrainer, LatentGRPOTrainer)}[stage]
        return stock if self.autoregressive else latent

    def lora_config(self, r: int = 16, alpha: int = 32):
        """PEFT LoRA on the family's recommended backbone projections (the registry's `lora_target_modules`; the
        AR baseline: the same projection names of `model.layers.*`)."""
        from peft import LoraConfig

        targets = (self.spec.lora_target_modules if self.spec is not None else None) or BACKBONE_LORA_TARGETS
        return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")


def save_post_trained(trainer, output_dir, tokenizer, origin: dict | None = None) -> None:
    """The trained model as a normal checkpoint in `output_dir` (a PEFT model merged first), with its tokenizer, the
    trainer's log (`post_training_log.json`) and `origin` ({"stage", "base_model", "lora", "task"}: the model card's
    `base_model`, `folders.POST_TRAINING_RECORD`); written by the main process."""
    from accelerate.utils import is_peft_model

    model = trainer.accelerator.unwrap_model(trainer.model)
    if is_peft_model(model):
        model = model.merge_and_unload()
    if trainer.accelerator.is_main_process:
        output = Path(output_dir)
        output.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(output)
        save_tokenizer(tokenizer, output)
        (output / "post_training_log.json").write_text(json.dumps(trainer.state.log_history, indent=1) + "\n")
        if origin is not None:
            (output / POST_TRAINING_RECORD).write_text(json.dumps(origin, indent=1) + "\n")
    trainer.accelerator.wait_for_everyone()


def resume_checkpoint(output_dir, resume: bool) -> str | None:
    """The checkpoint to resume from (`resume`), else None; ValueError when `resume` finds none, or when a fresh run
    would write into a folder holding another run's checkpoints (the Trainer's rotation would delete them)."""
    checkpoint = latest_checkpoint(output_dir)
    if resume and checkpoint is None:
        raise ValueError(f"--resume: no complete checkpoint-<step> folder in {output_dir} to resume from")
    if not resume and checkpoint is not None:
        raise ValueError(f"{output_dir} already holds the checkpoint {checkpoint.name} of an earlier run: "
                         f"continue it with --resume, or choose another --output-dir")
    return str(checkpoint) if checkpoint is not None else None


@torch.no_grad()
def with_policy_rejections(pairs: Dataset, model, tokenizer, batch_size: int = 8, seed: int = 0,
                           max_new_tokens: int | None = None) -> Dataset:
    """`pairs` (prompt / chosen / rejected) with every rejected answer replaced by the model's own answer to the
    prompt, sampled as `hf_latentlm.eval.task` samples (temperature 1, per-row seeds), wherever that answer is wrong
    (not an exact match of `chosen`); its `rejected_kind` becomes `SAMPLED_REJECTION`. Where the model answers
    right, the given rejected answer stays. On-policy rejections put DPO's push-down on the mistakes the model
    actually makes. An answer that ended with end-of-text keeps it, as the chosen answers do; one cut off at the
    token limit (`max_new_tokens`; default: the batch's longest chosen answer plus 8) has none. The samples depend
    only on the model, the prompts, `batch_size` and `seed`, so a resumed run (and every rank of a multi-process
    one) rebuilds the same pairs."""
    if len(pairs) == 0:
        raise ValueError("no preference pairs to sample rejections for")
    eos = tokenizer.eos_token
    with model_mode(model, False):
        rejected = list(pairs["rejected"])
        kinds = list(pairs["rejected_kind"]) if "rejected_kind" in pairs.column_names else [None] * len(pairs)
        for start in range(0, len(pairs), batch_size):
            rows = pairs.select(range(start, min(start + batch_size, len(pairs))))
            limit = max_new_tokens or max(len(tokenizer(c, add_special_tokens=False)["input_ids"])
                                          for c in rows["chosen"]) + 8
            answers, _ = generate_answers(model, tokenizer, list(rows["prompt"]), limit, seed + start)
            for offset, (answer, chosen) in enumerate(zip(answers, rows["chosen"])):
                text = tokenizer.decode(answer) + (eos if len(answer) < limit else "")
                if not tasks.exact_match(text, chosen):
                    rejected[start + offset], kinds[start + offset] = text, SAMPLED_REJECTION
    columns = [c for c in ("rejected", "rejected_kind") if c in pairs.column_names]
    return pairs.remove_columns(columns).add_column("rejected", rejected).add_column("rejected_kind", kinds)


def starting_model(stage: str, model_dir, init_from: str | None, family: str | None, preset: str | None, seed: int,
                   encoder_kl_weight: float, lora: bool) -> tuple:
    """(model, tokenizer, encoder KL term or None) a `stage` run starts from: the model folder `model_dir`, or
    (`init_from`, SFT of every weight only) a fresh `family` model (None: plm) at `preset` (None: small) around a copy
    of that causal LM, its own parts drawn from `seed`, with the source kept frozen as the reference of
    `encoder_kl_weight` · KL(source ‖ encoder) when that is positive."""
    if (model_dir is None) == (init_from is None):
        raise ValueError(f"give exactly one of model_dir ({model_dir!r}) and init_from ({init_from!r})")
    if init_from is None:
        return (*load_model_and_tokenizer(str(model_dir)), None)
    if stage != "sft" or lora:  # LoRA would leave the family's freshly drawn parts untrained
        raise ValueError(f"init_from starts a full SFT run (not {stage}{' with LoRA' if lora else ''})")
    source = load_source_model(init_from)
    tokenizer = load_tokenizer(init_from, option="--init-from")
    torch.manual_seed(seed)
    model = build_model(family or "plm", preset or "small", tokenizer, init_from=source)
    return model, tokenizer, EncoderKL(source, encoder_kl_weight) if encoder_kl_weight else None


def completion_limit(dataset: Dataset, tokenizer, reward_funcs) -> int:
    """GRPO's completion length: room for the longest reference answer, its separating space and end-of-text token,
    plus a margin of 8 (as `eval.task`); 64 for a dataset without reference answers, rewarded by `reward_funcs`."""
    if "response" in dataset.column_names:
        return max(tasks.response_lengths(dataset, tokenizer, "response")) + 2 + 8
    if reward_funcs is None:
        raise ValueError(f"the GRPO dataset needs a 'response' column (the reference answer the default rewards "
                         f"compare with), or reward_funcs of your own; it has {dataset.column_names}")
    return 56 + 8


#: Learning rates per stage (LoRA runs: `LORA_LEARNING_RATE_FACTOR` times these).
LEARNING_RATES = {"sft": SFT_LEARNING_RATE, "dpo": DPO_LEARNING_RATE, "grpo": GRPO_LEARNING_RATE}


def _post_train(stage: str, model_dir, output_dir, task: str | None, max_steps: int | None, lora: bool, *,
                learning_rate: float | None, batch_size: int, seed: int, train_size: int | None,
                dataset: Dataset | None, callbacks: Sequence | None, save_every: int, resume: bool,
                policy_rejections: bool = False, beta: float | None = None, num_generations: int = NUM_GENERATIONS,
                num_score_draws: int = NUM_SCORE_DRAWS, reward_funcs: Sequence | None = None,
                report_to: str | Sequence[str] | None = "none", init_from: str | None = None,
                family: str | None = None, preset: str | None = None, encoder_kl_weight: float = 0.0,
                **config_overrides) -> dict:
    """The body of `run_sft`, `run_dpo` and `run_grpo` (`stage`): load (`starting_model`), build the data, train, save,
    summarise. `report_to`: the trainer's `TrainingArguments.report_to` (docs/tracking.md), checked before loading."""
    report_to = parse_report_to(report_to)
    checkpoint = resume_checkpoint(output_dir, resume)
    model, tokenizer, encoder_kl = starting_model(stage, model_dir, init_from, family, preset, seed, encoder_kl_weight,
                                                  lora)
    origin = {"stage": stage, "base_model": str(init_from or model_dir), "lora": lora,  # the card's base_model
              "task": None if dataset is not None else task or tasks.DEFAULT_TASK}
    if init_from is not None:  # the card says the model is a new family's, started from `base_model`
        origin["init_from"] = {"family": model.config.model_type, "encoder_kl_weight": encoder_kl_weight}
    run = PostTrainingRun.of(model)
    if dataset is None:
        load = tasks.load_preference_task if stage == "dpo" else tasks.load_task
        dataset = load(task or tasks.DEFAULT_TASK, tokenizer=tokenizer, seed=seed,
                       split_sizes={"train": train_size or tasks.DEFAULT_SPLIT_SIZES["train"]})["train"]
    if policy_rejections:
        dataset = with_policy_rejections(dataset, model, tokenizer, batch_size=batch_size, seed=seed)
        origin["policy_rejections"] = True
        origin["sampled_rejections"] = sum(kind == SAMPLED_REJECTION for kind in dataset["rejected_kind"])
    if learning_rate is None:
        learning_rate = LEARNING_RATES[stage] * (LORA_LEARNING_RATE_FACTOR if lora else 1.0)
    options = dict(learning_rate=learning_rate, batch_size=batch_size, max_steps=max_steps, seed=seed,
                   save_steps=save_every, report_to=report_to)
    trainer_options = {} if encoder_kl is None else {"encoder_kl": encoder_kl}  # SFT only (`starting_model`)
    if stage == "grpo":
        if beta is not None:  # else TRL's default β
            options["beta"] = beta
        args = grpo_config(output_dir, num_generations=num_generations,
                           max_completion_length=completion_limit(dataset, tokenizer, reward_funcs),
                           **{**options, **config_overrides})
        trainer_options["reward_funcs"] = list(reward_funcs or [tasks.exact_match_reward, tasks.partial_credit_reward])
        if not run.autoregressive:
            trainer_options["num_score_draws"] = num_score_draws
    else:
        options["max_length"] = getattr(core_model(model).config, "max_position_embeddings", None)
        if stage == "sft":
            args = sft_config(output_dir, **{**options, **config_overrides})
        else:
            args = dpo_config(output_dir, beta=DPO_BETA if beta is None else beta, **{**options, **config_overrides})
    trainer = run.trainer_class(stage)(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                       peft_config=run.lora_config() if lora else None,
                                       callbacks=list(callbacks or []), **trainer_options)
    result = trainer.train(resume_from_checkpoint=checkpoint)
    save_post_trained(trainer, output_dir, tokenizer, origin=origin)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"stage": stage, "family": run.family, "output_dir": str(output_dir), "steps": trainer.state.global_step,
            "train_loss": result.training_loss, "losses": losses,
            "finite": all(math.isfinite(x) for x in losses) and math.isfinite(result.training_loss)}


def run_sft(model_dir, output_dir, task: str | None = None, max_steps: int | None = None, lora: bool = False, *,
            learning_rate: float | None = None, batch_size: int = 8, seed: int = 0, train_size: int | None = None,
            dataset: Dataset | None = None, callbacks: Sequence | None = None, save_every: int = SAVE_EVERY,
            resume: bool = False, init_from: str | None = None, family: str | None = None,
            preset: str | None = None, encoder_kl_weight: float = 0.0, **config_overrides) -> dict:
    """SFT of the model in `model_dir` on `task` (`tasks.load_task`; or `dataset`, prompt/completion rows) and a
    normal checkpoint in `output_dir`. AR: stock `SFTTrainer`; other families: `LatentSFTTrainer`. `lora`: train a
    LoRA adapter, then save the merged model. `callbacks`: extra `TrainerCallback`s. Checkpoints every `save_every`
    steps into `output_dir/checkpoint-<step>/`; `resume` continues from the newest (ValueError if there is none; a
    fresh run refuses a folder that holds checkpoints). Call with the same arguments as the interrupted run.
    `config_overrides` go to `sft_config`; `report_to` (e.g. "tensorboard", `TrainingArguments`' meaning) is checked
    before anything loads. `init_from` (a causal LM folder or Hub id; `model_dir` None): SFT a fresh `family` model
    at `preset` started from it (`train --init-from`), adding `encoder_kl_weight` · KL(source ‖ encoder) when
    positive. Returns a summary (steps, losses)."""
    return _post_train("sft", model_dir, output_dir, task, max_steps, lora, learning_rate=learning_rate,
                       batch_size=batch_size, seed=seed, train_size=train_size, dataset=dataset, callbacks=callbacks,
                       save_every=save_every, resume=resume, init_from=init_from, family=family, preset=preset,
                       encoder_kl_weight=encoder_kl_weight, **config_overrides)


def run_dpo(model_dir, output_dir, task: str | None = None, max_steps: int | None = None, lora: bool = False, *,
            learning_rate: float | None = None, batch_size: int = 8, seed: int = 0, train_size: int | None = None,
            beta: float = DPO_BETA, dataset: Dataset | None = None, callbacks: Sequence | None = None,
            save_every: int = SAVE_EVERY, resume: bool = False, policy_rejections: bool = False,
            **config_overrides) -> dict:
    """DPO of the (SFT) model in `model_dir` on `task` (`tasks.load_preference_task`; or `dataset`, prompt / chosen /
    rejected rows), the model itself being the frozen reference, and a normal checkpoint in `output_dir`. AR: stock
    `DPOTrainer` with `sigmoid_norm`; other families: `LatentDPOTrainer`. `lora`: train a LoRA adapter (the reference
    is then the adapter-disabled model), then save the merged model. `callbacks`: extra `TrainerCallback`s.
    Checkpoints and `resume` as `run_sft`; a resumed run rebuilds the draws and reference scores from `model_dir`
    (the frozen start) before the checkpoint's weights are loaded, so its reference is the uninterrupted run's.
    `policy_rejections`: the rejected answers are the model's own wrong samples (`with_policy_rejections`).
    Returns a summary (steps, losses)."""
    return _post_train("dpo", model_dir, output_dir, task, max_steps, lora, learning_rate=learning_rate,
                       batch_size=batch_size, seed=seed, train_size=train_size, dataset=dataset, callbacks=callbacks,
                       save_every=save_every, resume=resume, policy_rejections=policy_rejections, beta=beta,
                       **config_overrides)


def run_grpo(model_dir, output_dir, task: str | None = None, max_steps: int | None = None, lora: bool = False, *,
             learning_rate: float | None = None, batch_size: int = 16, num_generations: int = NUM_GENERATIONS,
             seed: int = 0, train_size: int | None = None, dataset: Dataset | None = None,
             callbacks: Sequence | None = None, save_every: int = SAVE_EVERY, resume: bool = False,
             beta: float | None = None, num_score_draws: int = NUM_SCORE_DRAWS, reward_funcs: Sequence | None = None,
             **config_overrides) -> dict:
    """GRPO of the (SFT) model in `model_dir` on `task`'s prompts (`tasks.load_task`; or `dataset`, rows with
    `prompt` and the reference `response`), rewarded by exact match plus partial credit (or by TRL reward functions
    `reward_funcs`), and a normal checkpoint in `output_dir`. AR: stock `GRPOTrainer`; other families:
    `LatentGRPOTrainer` (`num_score_draws`: the latent families' draws per response). `batch_size` completions per
    device per step, `num_generations` per prompt; completions up to the longest reference answer (with its space
    and end-of-text token) plus 8 tokens. `beta`: the KL weight (None: TRL's default, 0, and no
    reference model). LoRA, callbacks, checkpoints and `resume` as `run_sft`. Returns a summary."""
    return _post_train("grpo", model_dir, output_dir, task, max_steps, lora, learning_rate=learning_rate,
                       batch_size=batch_size, seed=seed, train_size=train_size, dataset=dataset, callbacks=callbacks,
                       save_every=save_every, resume=resume, num_generations=num_generations, beta=beta,
                       num_score_draws=num_score_draws, reward_funcs=reward_funcs, **config_overrides)
