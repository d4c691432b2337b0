"""PEFT (LoRA) and TRL (`SFTTrainer`) on every multi-token language-model family of the registry, as they work with
the installed PEFT and TRL (see ../shared/notes/hf-stack-facts.md).

What these tests establish, per family:
- LoRA: which `target_modules` wrap the backbone and nothing else (the registry's `lora_target_modules`); the bare projection
  names also wrap CALM's frozen autoencoder, whose LoRA layers then never receive a gradient. An adapter trained with
  the family's own loss, saved, reloaded by `AutoPeftModelForCausalLM` in a process where `hf_latentlm` cannot be
  imported and merged gives the same outputs and the same generated tokens as the merged model here.
- SFTTrainer as-is: TRL patches the forward with its fused LM head and optimises next-token cross-entropy of
  `base_model(...).last_hidden_state @ get_output_embeddings()`, never the family's loss. PLM trains, but with that
  loss (its decoder-only parameters do not move); CALM, which has no LM head, fails on the first step.
- SFTTrainer whose `compute_loss` calls the model with `labels` (the package fix proposed for a later issue) trains
  every family with its own loss.
"""

import json
import math
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from family_contract import build_tiny, multi_token_families

from hf_latentlm.families import get_family

FAMILIES = multi_token_families()

# The bare projection names, which would also match the SwiGLU MLPs of CALM's frozen autoencoder and of its energy
# head; the registry's `lora_target_modules` (a regex on the full module name) matches the backbone's blocks only.
PROJECTION_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_LOADER = Path(__file__).parent / "modeling" / "peft_isolated_load.py"
PROMPT = [[5, 60, 700, 42, 9, 31, 17, 8]]


def lora_wrapped(peft_model) -> set[str]:
    """Names (relative to the wrapped model) of the modules that carry a LoRA adapter."""
    prefix = "base_model.model."
    return {name.removeprefix(prefix) for name, module in peft_model.named_modules() if hasattr(module, "lora_A")}


def head_output(model, ids: torch.Tensor) -> torch.Tensor:
    """What a family returns for plain `input_ids`: token logits if it has an LM head, else the hidden states."""
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def params_with_gradient(model, loss: torch.Tensor) -> set[str]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    names = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}
    model.zero_grad(set_to_none=True)
    return names


def next_token_nll(model, input_ids, labels, attention_mask=None) -> torch.Tensor:
    """TRL's SFT loss: mean cross-entropy of the shifted labels under the LM head's logits."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                             ignore_index=-100)


# ---------------------------------------------------------------------------------------------------------------------
# PEFT
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_lora_targets_the_backbone_projections_and_no_frozen_component(family, tokenizer, tiny_rows):
    from peft import LoraConfig, get_peft_model

    model = build_tiny(family, tokenizer)
    layers = model.config.num_hidden_layers
    parts = [f"self_attn.{p}" for p in PROJECTION_NAMES[:4]] + [f"mlp.{p}" for p in PROJECTION_NAMES[4:]]
    # The backbone's decoder blocks: `model.layers` (AURORA: the denoiser's, `model.denoiser.layers`).
    stack = "model.denoiser.layers" if isinstance(getattr(model.model, "denoiser", None), torch.nn.Module) else "model.layers"
    backbone = {f"{stack}.{i}.{part}" for i in range(layers) for part in parts}
    frozen = {name for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad}
    assert bool(frozen) == bool(get_family(family).components), "frozen Linear layers are those of the components"

    recommended = get_peft_model(model, LoraConfig(target_modules=get_family(family).lora_target_modules, r=4))
    assert lora_wrapped(recommended) == backbone
    assert {n for n, p in recommended.named_parameters() if p.requires_grad} == {
        f"base_model.model.{m}.lora_{ab}.default.weight" for m in backbone for ab in "AB"}

    # The bare names also match SwiGLU MLPs outside the backbone: none in PLM; in CALM the energy head's and those of
    # the frozen autoencoder.
    plain_base = build_tiny(family, tokenizer)
    if hasattr(plain_base, "prepare_training"):  # AURORA: the base's latent statistics, as the training loop sets them
        plain_base.prepare_training(tiny_rows[8:24, :32])
    plain = get_peft_model(plain_base, LoraConfig(target_modules=PROJECTION_NAMES, r=4))
    assert backbone <= lora_wrapped(plain)
    in_frozen = lora_wrapped(plain) & frozen
    assert bool(in_frozen) == bool(frozen)
    if family == "plm":
        assert lora_wrapped(plain) == backbone
    if in_frozen:
        # ...where they are dead weight: the family's loss never reaches them (CALM encodes targets without gradient
        # and decodes only while generating), whereas the backbone's adapters do get a gradient.
        rows = tiny_rows[:2, :32]
        trained = params_with_gradient(plain, plain(input_ids=rows, labels=rows).loss)
        assert not {n for n in trained if any(f".{m}." in n for m in in_frozen)}
        assert {n for n in trained if "lora_B" in n} >= {f"base_model.model.{m}.lora_B.default.weight"
                                                         for m in backbone}


def reload_adapter_without_the_package(adapter, prompt, max_new_tokens: int, options: dict, home) -> dict:
    """`AutoPeftModelForCausalLM.from_pretrained(adapter, trust_remote_code=True)` + `merge_and_unload()` in a
    `python -S` process where `hf_latentlm` cannot be imported (tests/peft_isolated_load.py)."""
    paths = sysconfig.get_paths()
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(torch.get_num_threads())}  # a matmul split otherwise can round differently
    done = subprocess.run([sys.executable, "-S", str(PEFT_LOADER), paths["purelib"], paths["platlib"], str(adapter),
                           json.dumps(prompt), str(max_new_tokens), json.dumps(options)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_fine_tune_save_and_reload_merged_without_the_package(family, tokenizer, tiny_rows, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    base = build_tiny(family, tokenizer)
    if hasattr(base, "prepare_training"):  # AURORA: latent statistics belong to the base, as the training loop sets
        base.prepare_training(tiny_rows[8:24, :32])
    if family == "calm":  # an untrained reference energy head (seven std-0.02 layers between the backbone and its
        with torch.no_grad():  # output) passes the backbone ~1e-13 gradients, below Adam's eps; a trained head does not
            for param in base.energy_head.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, 0.2)
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, trust_remote_code=True)
    prompt = torch.tensor(PROMPT)
    before = head_output(base, prompt)
    frozen_before = {n: p.detach().clone() for n, p in base.named_parameters()}

    targets = get_family(family).lora_target_modules
    model = get_peft_model(base, LoraConfig(target_modules=targets, r=4, task_type="CAUSAL_LM"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(3):
        batch = tiny_rows[2 * step:2 * step + 2, :32]
        loss = model(input_ids=batch, labels=batch).loss  # the family's own loss
        assert math.isfinite(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    # LoRA trains the adapters only; the base weights (and CALM's autoencoder) are untouched.
    for name, param in model.get_base_model().named_parameters():
        if "lora_" not in name:
            assert torch.equal(param, frozen_before[name.replace(".base_layer", "")]), name
    model.save_pretrained(adapter_dir)
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base_dir)
    assert adapter_config["target_modules"] == get_family(family).lora_target_modules

    unmerged = head_output(model, prompt)
    merged = model.merge_and_unload().eval()
    after = head_output(merged, prompt)
    torch.testing.assert_close(after, unmerged, atol=1e-5, rtol=1e-5)
    assert (after - before).abs().max() > 1e-3, "the trained LoRA weights must change the output"

    options = {"eos_token_id": None, merged.row_seeds_option: [11]}
    expected = merged.generate(prompt, max_new_tokens=12, **options)[0, prompt.shape[1]:].tolist()
    result = reload_adapter_without_the_package(adapter_dir, PROMPT, 12, options, tmp_path / "hf_home")
    assert result["module"].startswith("transformers_modules"), "must run the checkpoint's own code"
    assert result["peft_class"] == "PeftModelForCausalLM" and result["lora_layers"] == 0
    assert result["output"] == ("logits" if merged.get_output_embeddings() is not None else "last_hidden_state")
    torch.testing.assert_close(torch.tensor(result["values"]), after, atol=1e-6, rtol=0)
    assert result["tokens"] == expected


# ---------------------------------------------------------------------------------------------------------------------
# TRL
# ---------------------------------------------------------------------------------------------------------------------

def sft_setup(family, tokenizer, tmp_path, trainer_class=None):
    """A tiny `family` model and an SFTTrainer (2 steps, CPU) on two text snippets of the embedded corpus; with two
    examples and batch size 2, both steps see the same batch."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_latentlm.training.corpus import load_corpus_documents

    doc = load_corpus_documents("validation")[0]
    texts = [doc[2000 + 400 * i: 2400 + 400 * i] for i in range(2)]  # each well over 32 tokens
    model = build_tiny(family, tokenizer)
    args = SFTConfig(output_dir=str(tmp_path / "sft"), use_cpu=True, bf16=False, report_to=[], max_steps=2,
                     per_device_train_batch_size=2, save_strategy="no", logging_steps=1, max_length=32,
                     learning_rate=1e-2, dataloader_num_workers=0, disable_tqdm=True)
    trainer = (trainer_class or SFTTrainer)(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                                            processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert batch["input_ids"].shape == (2, 32)  # whole CALM chunks
    return model, trainer, batch


def snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(model, before: dict) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_trainer_as_is_optimises_next_token_cross_entropy_or_fails_without_lm_head(family, tokenizer, tmp_path):
    model, trainer, batch = sft_setup(family, tokenizer, tmp_path)
    before = snapshot(model)
    if model.get_output_embeddings() is None:
        # CALM: TRL's fused head runs the backbone, then multiplies by get_output_embeddings().weight, which is None.
        with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'weight'"):
            trainer.train()
        assert not changed(model, before)
        return
    # Which parameters each loss can move: the family's own loss reaches parameters TRL's next-token NLL does not
    # (PLM: the decoder's auxiliary read-in, mask auxiliary and alignment projection).
    ids, labels = batch["input_ids"], batch["labels"]
    first_nll = next_token_nll(model, ids, labels, batch["attention_mask"])
    nll_params = params_with_gradient(model, first_nll)
    family_params = params_with_gradient(model, model(input_ids=ids, labels=labels,
                                                      attention_mask=batch["attention_mask"]).loss)
    family_only = family_params - nll_params
    assert family_only

    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    moved = changed(model, before)
    assert moved == nll_params, "SFTTrainer trains exactly what next-token cross-entropy reaches"
    assert not moved & family_only, f"the family's loss did not run: {sorted(family_only)} never moved"
    # The first logged loss is TRL's cross-entropy of the untrained model on this batch.
    assert losses[0] == pytest.approx(first_nll.item(), rel=1e-4)


def family_loss_trainer_class():
    """The fix proposed for the package: an SFTTrainer whose loss is the model's own `forward(..., labels=...)`."""
    from trl import SFTTrainer

    class FamilyLossSFTTrainer(SFTTrainer):
        loss_is_scaled_for_ga = False  # a mean over the micro-batch: the Trainer divides by the accumulation steps

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                        labels=inputs["labels"])
            return (out.loss, out) if return_outputs else out.loss

    return FamilyLossSFTTrainer


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_trainer_with_compute_loss_calling_the_model_trains_the_family_loss(family, tokenizer, tmp_path):
    model, trainer, batch = sft_setup(family, tokenizer, tmp_path, family_loss_trainer_class())
    family_params = params_with_gradient(model, model(input_ids=batch["input_ids"], labels=batch["labels"],
                                                      attention_mask=batch["attention_mask"]).loss)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    before = snapshot(model)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    # Everything the family's loss reaches on the first batch moved (PLM: its decoder-only parameters too; CALM: the
    # energy head), and nothing frozen (CALM's autoencoder) did.
    moved = changed(model, before)
    assert family_params <= moved and not moved & frozen
