"""Family registry: the one table of model families and how to build each.

A family is one `FamilySpec`: its name, a builder (preset + tokenizer -> untrained `PreTrainedModel` whose forward
returns `loss` for `input_ids`/`labels` batches), whether it is a language model, the trained components it needs
(`{"autoencoder": "calm-ae"}`), its config overrides per preset name, its transformers classes, and where its
family-specific pieces live (training report, DPO response scorer, model card), named "module:attribute" and
imported when first read. The CLI, loading, training, post-training, evaluation and the Hub upload read this
registry and never name a family; `docs/adding_a_family.md` shows how a new one registers.

This module sits low in the package: it imports only `presets` and `folders` (and the modeling classes and the
"module:attribute" fields when they are used); nothing here calls up into loading, training or evaluation.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from .folders import check_model_folder
from .presets import Preset, get_preset

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedModel

    from .modeling import (AuroraAutoencoder, AuroraForCausalLM, CALMAutoencoder, CALMForCausalLM, ColaForCausalLM,
                           ColaTextVAE, PLMForCausalLM)

# Reading this registry (names, components, presets: `hf-latentlm --help`, argument errors) must not import torch,
# which takes seconds: the built-in families name their classes as "module:attribute" and each builder imports its
# classes when called. Importing `hf_latentlm.modeling` registers them with the Auto classes.
MODELING = "hf_latentlm.modeling"
SCORERS = "hf_latentlm.training.scorers"
CARDS = "hf_latentlm.cards"
COMPONENT_REPORTS = "hf_latentlm.eval.components"
BENCH = "hf_latentlm.eval.family_bench"


class ImportedOnRead:
    """A `FamilySpec` field given as a class or as a "module:attribute" string, imported when first read."""

    def __set_name__(self, owner, name):
        self.slot = f"_{name}"

    def __get__(self, spec, owner=None):
        if spec is None:
            return None  # the dataclass default
        value = spec.__dict__[self.slot]
        if isinstance(value, str):
            module, _, attribute = value.partition(":")
            value = spec.__dict__[self.slot] = getattr(importlib.import_module(module), attribute)
        return value

    def __set__(self, spec, value):
        spec.__dict__[self.slot] = value


@dataclass(frozen=True)
class FamilySpec:
    """Everything the rest of the package needs to know about one family.

    name: the `--family` value.
    build: `build(preset, tokenizer, **kwargs) -> PreTrainedModel`; kwargs are config overrides plus one trained
        model per entry of `components` (already loaded and type-checked by `build_model`).
    config_class / model_class: the transformers classes; registered with the Auto classes on `register_family`
        (None for classes transformers already knows, such as Llama). A "module:attribute" string is imported when
        first read; that module registers its classes itself, as `hf_latentlm.modeling` does for the built-in ones.
    language_model: True if the family generates text; False for components (autoencoders, VAEs).
    components: argument name -> family that produces it; each becomes a `--<name> DIR` option of `train`.
    preset_overrides: preset name -> config overrides that depend on scale.
    training_report: `report(model, tokenizer, stream=None) -> str` (`stream`: validation ids of the generated
        language the run trained on, else None: the embedded corpus's), printed by `hf-latentlm train` when a run of this family
        finishes (components: reconstruction on the validation split); None: no report.
    response_scorer: the `ResponseScorer` class DPO scores this family's responses with
        (`hf_latentlm.training.scorers`); None: the token-likelihood score where the family has one.
    model_card: the `cards.FamilyCard` of `hf-latentlm push`; None: `cards.default_card` from the model class.
    lora_target_modules: the recommended PEFT `target_modules` (the trained backbone only, never a frozen
        component); see docs/using_the_models.md.
    speed_variants: label -> extra `generate()` options that `hf-latentlm train` also times against the baseline
        after a run, next to the default options (e.g. PLM's relaxed acceptance).
    bench_decodings: label -> `generate()` options that `hf-latentlm bench --extras` measures (speed, BrierLM-2)
        next to the default decoding.
    bench_measurements: `measure(model, baseline, stream) -> dict`, the family's own numbers in `bench --extras`
        (`hf_latentlm.eval.family_bench`); None: none.
    rollout_options: `generate()` options of reinforcement-learning rollouts (`LatentGRPOTrainer`), so that the
        rollout policy is the one the trainer's log-likelihood describes (PLM: lossless exact acceptance).
    init_from: `init_from(source, **overrides) -> PreTrainedModel`, the family built around a copy of a pretrained
        causal LM (`source`: a loaded model, its folder or its Hub id), whose vocabulary and sizes it takes;
        `overrides` are the family's own config fields (`train --init-from SRC`). None: the family starts from
        random weights only.
    """

    name: str
    build: Callable[..., PreTrainedModel]
    config_class: type | str | None = ImportedOnRead()
    model_class: type | str | None = ImportedOnRead()
    language_model: bool = True
    components: Mapping[str, str] = field(default_factory=dict)
    preset_overrides: Mapping[str, Mapping] = field(default_factory=dict)
    training_report: Callable | str | None = ImportedOnRead()
    response_scorer: type | str | None = ImportedOnRead()
    model_card: object | str | None = ImportedOnRead()
    lora_target_modules: str | list[str] | None = None
    speed_variants: Mapping[str, Mapping] = field(default_factory=dict)
    bench_decodings: Mapping[str, Mapping] = field(default_factory=dict)
    bench_measurements: Callable | str | None = ImportedOnRead()
    rollout_options: Mapping[str, object] = field(default_factory=dict)
    init_from: Callable | str | None = ImportedOnRead()

    @property
    def model_type(self) -> str | None:
        return getattr(self.config_class, "model_type", None)

    def overrides_for(self, preset: Preset) -> dict:
        """This family's config overrides for `preset`, found by the preset's name."""
        if not self.preset_overrides:
            return {}
        if preset.name not in self.preset_overrides:
            raise ValueError(f"the {self.name} family has settings for presets {sorted(self.preset_overrides)}, not "
                             f"for {preset.name!r}: derive a custom preset from one of them with "
                             f"dataclasses.replace(PRESETS[name], ...), which keeps its name")
        return dict(self.preset_overrides[preset.name])


FAMILIES: dict[str, FamilySpec] = {}
#: The matched autoregressive baseline every speed and quality number is compared with.
BASELINE_FAMILY = "ar"
#: LoRA targets of the shared decoder blocks: attention and MLP projections of `model.layers.*` only. The bare
#: projection names would also wrap CALM's frozen autoencoder and its energy head (tests/test_peft_trl.py).
BACKBONE_LORA_TARGETS = r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


def register_family(spec: FamilySpec) -> FamilySpec:
    """Add (or replace) a family; its classes become loadable through transformers' Auto classes."""
    for component, family in spec.components.items():
        if family not in FAMILIES:
            raise ValueError(f"family {spec.name!r}: component {component!r} names unregistered family {family!r}")
    if isinstance(spec._config_class, type) and isinstance(spec._model_class, type):
        from .modeling import register_auto_classes

        register_auto_classes(spec.config_class, spec.model_class, language_model=spec.language_model)
    FAMILIES[spec.name] = spec
    return spec


def get_family(name: str) -> FamilySpec:
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_of_model_type(model_type: str) -> FamilySpec | None:
    """The family whose config has this `model_type` (None for models from outside the registry)."""
    return next((s for s in FAMILIES.values() if s.model_type == model_type), None)


def families_using(component_family: str) -> list[str]:
    """The families whose models are built around a trained `component_family` model (sorted)."""
    return sorted(s.name for s in FAMILIES.values() if component_family in s.components.values())


def component_names() -> list[str]:
    """Every component argument any family takes (each is a `--<name>` option of `hf-latentlm train`)."""
    return sorted({name for spec in FAMILIES.values() for name in spec.components})


def check_components(family: str, components: Mapping[str, object]) -> None:
    """ValueError naming a missing component of `family`, or one it does not take."""
    spec = get_family(family)
    for name, value in components.items():
        if value is not None and name not in spec.components:
            takers = sorted(s.name for s in FAMILIES.values() if name in s.components)
            raise ValueError(f"--{name} only applies to --family {', '.join(takers) or '(none)'}, not {family!r}")
    for name, source in spec.components.items():
        if components.get(name) is None:
            raise ValueError(f"the {family} family needs a trained {name}: train one with `--family {source}` and "
                             f"pass its folder with --{name} DIR")


def load_component(name: str, source: str, folder: str) -> PreTrainedModel:
    """The trained `source`-family model saved in `folder`, refused with one line if the folder is damaged, holds
    another model type, or its weights do not match the class (missing or unexpected tensors)."""
    spec = get_family(source)
    if not Path(folder).is_dir():
        raise FileNotFoundError(f"--{name} {folder!r} does not exist: not a saved {name} folder")
    model_type = check_model_folder(folder, f"--{name} {folder!r}")["model_type"]  # also: weights intact
    if model_type != spec.model_type:
        raise ValueError(f"--{name} {folder!r} holds a {model_type!r} model, expected a {spec.model_type!r} "
                         f"(trained with --family {source})")
    model, info = spec.model_class.from_pretrained(folder, output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise ValueError(f"--{name} {folder!r}: its weights do not match {spec.model_class.__name__}: "
                         + "; ".join(f"{k} {sorted(v)[:3]}" for k, v in bad.items()))
    return model


def check_init_from(family: str) -> None:
    """ValueError unless `family` can start from a pretrained causal LM (`--init-from`)."""
    if get_family(family).init_from is None:
        able = sorted(s.name for s in FAMILIES.values() if s.init_from is not None)
        raise ValueError(f"--init-from only applies to --family {', '.join(able) or '(none)'}, not {family!r}: the "
                         f"{family} family starts from random weights")


def build_model(family: str, preset: str | Preset, tokenizer, init_from=None, **kwargs) -> PreTrainedModel:
    """A fresh model of `family` at `preset`. `kwargs`: the family's components (a trained model or its folder)
    and config overrides, which win over the preset's. `init_from`: a pretrained causal LM (model, folder or Hub id)
    the family starts from (`FamilySpec.init_from`); its sizes and vocabulary replace the preset's and the
    tokenizer's, and the family's preset overrides still apply."""
    spec = get_family(family)
    if isinstance(preset, str):
        preset = get_preset(preset)
    if init_from is not None:
        check_init_from(family)
        return spec.init_from(init_from, **{**spec.overrides_for(preset), **kwargs})
    components = {name: kwargs.pop(name, None) for name in spec.components}
    check_components(family, components)
    for name, value in components.items():
        if isinstance(value, (str, Path)):
            components[name] = load_component(name, spec.components[name], str(value))
    return spec.build(preset, tokenizer, **components, **{**spec.overrides_for(preset), **kwargs})


def build_fresh_model(family: str, preset: str | Preset, tokenizer, seed: int = 0, **overrides) -> PreTrainedModel:
    """`build_model` of `family` around fresh models of the components it needs (built the same way, at the same
    preset), with torch's global RNG seeded with `seed` before each build: for checks where trained components do
    not matter (speed, FLOP counts, the model contract). `overrides` go to `family`'s config only."""
    import torch  # not at the top: reading the registry must not import torch

    components = {name: build_fresh_model(source, preset, tokenizer, seed)
                  for name, source in get_family(family).components.items()}
    torch.manual_seed(seed)
    return build_model(family, preset, tokenizer, **components, **overrides)


# ==================================================================================================================
# The families
# ==================================================================================================================

def backbone_config_kwargs(preset: Preset, tokenizer) -> dict:
    """Config fields shared by every family (Llama names): the preset's backbone and the tokenizer's ids."""
    return dict(vocab_size=len(tokenizer), hidden_size=preset.hidden_size, intermediate_size=preset.intermediate_size,
                num_hidden_layers=preset.num_layers, num_attention_heads=preset.num_heads,
                num_key_value_heads=preset.num_kv_heads, max_position_embeddings=preset.max_position_embeddings,
                rope_theta=preset.rope_theta, **special_token_kwargs(tokenizer), tie_word_embeddings=False)


def special_token_kwargs(tokenizer) -> dict:
    return dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def component_config_kwargs(preset: Preset, tokenizer) -> dict:
    """Config fields of a component whose size comes from its family's preset overrides: the tokenizer's vocabulary
    and ids, and the preset's positions (RoPE)."""
    return dict(vocab_size=len(tokenizer), **special_token_kwargs(tokenizer),
                max_position_embeddings=preset.max_position_embeddings, rope_theta=preset.rope_theta)


def build_ar_baseline(preset: Preset, tokenizer, **overrides) -> LlamaForCausalLM:
    """The matched autoregressive baseline: transformers' own `LlamaForCausalLM` with the
    preset's dimensions (RMSNorm, SwiGLU, RoPE, GQA — the same core as our families)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**backbone_config_kwargs(preset, tokenizer), **overrides}))


def build_plm(preset: Preset, tokenizer, **overrides) -> PLMForCausalLM:
    """Parallel Language Model on the same backbone dimensions as the AR baseline."""
    from .modeling import PLMConfig, PLMForCausalLM

    return PLMForCausalLM(PLMConfig(**{**backbone_config_kwargs(preset, tokenizer), **overrides}))


def init_plm(source, **overrides) -> PLMForCausalLM:
    """A PLM whose encoder is the pretrained Llama-architecture causal LM `source` at step 0."""
    from .modeling import PLMForCausalLM

    return PLMForCausalLM.from_causal_lm(source, **overrides)


def build_calm_autoencoder(preset: Preset, tokenizer, **overrides) -> CALMAutoencoder:
    """CALM's chunk autoencoder (K tokens <-> one latent); its size comes from the family's preset overrides."""
    from .modeling import CALMAutoencoder, CALMAutoencoderConfig

    return CALMAutoencoder(CALMAutoencoderConfig(vocab_size=len(tokenizer), **special_token_kwargs(tokenizer),
                                                 **overrides))


def build_calm(preset: Preset, tokenizer, autoencoder: CALMAutoencoder, **overrides) -> CALMForCausalLM:
    """CALM on the preset's backbone around a trained autoencoder, which is frozen and copied into the model."""
    from .modeling import CALMForCausalLM

    return CALMForCausalLM.from_autoencoder(autoencoder, **{**backbone_config_kwargs(preset, tokenizer), **overrides})


def build_cola_vae(preset: Preset, tokenizer, **overrides) -> ColaTextVAE:
    """Cola DLM's causal text VAE; its size comes from the family's preset overrides."""
    from .modeling import ColaTextVAE, ColaVAEConfig

    return ColaTextVAE(ColaVAEConfig(**{**component_config_kwargs(preset, tokenizer), **overrides}))


def build_cola(preset: Preset, tokenizer, vae: ColaTextVAE, **overrides) -> ColaForCausalLM:
    """Cola DLM: a DiT on the preset's backbone around a trained VAE, which is copied in (and trained jointly)."""
    from .modeling import ColaForCausalLM

    return ColaForCausalLM.from_vae(vae, **{**backbone_config_kwargs(preset, tokenizer), **overrides})


def build_aurora_autoencoder(preset: Preset, tokenizer, **overrides) -> AuroraAutoencoder:
    """AURORA-LM's query autoencoder; its size comes from the family's preset overrides."""
    from .modeling import AuroraAutoencoder, AuroraAutoencoderConfig

    return AuroraAutoencoder(AuroraAutoencoderConfig(**{**component_config_kwargs(preset, tokenizer), **overrides}))


def build_aurora(preset: Preset, tokenizer, autoencoder: AuroraAutoencoder, **overrides) -> AuroraForCausalLM:
    """AURORA-LM: a denoiser on the preset's backbone around a trained autoencoder, which is frozen and copied in."""
    from .modeling import AuroraForCausalLM

    return AuroraForCausalLM.from_autoencoder(autoencoder, **{**backbone_config_kwargs(preset, tokenizer), **overrides})


register_family(FamilySpec(name="ar", build=build_ar_baseline, model_card=f"{CARDS}:AR_CARD"))

register_family(FamilySpec(
    name="plm", build=build_plm, config_class=f"{MODELING}:PLMConfig", model_class=f"{MODELING}:PLMForCausalLM",
    lora_target_modules=BACKBONE_LORA_TARGETS, speed_variants={"nucleus acceptance": {"acceptance": "nucleus"}},
    rollout_options={"acceptance": "exact"}, init_from=init_plm,
    response_scorer=f"{SCORERS}:PLMResponseScorer", model_card=f"{CARDS}:PLM_CARD",
    bench_decodings={"epsilon acceptance": {"acceptance": "epsilon"}, "nucleus acceptance": {"acceptance": "nucleus"}},
    bench_measurements=f"{BENCH}:plm_measurements",
    # The paper's N_aux = 512 / M = 128 (the config defaults, used by `base`) cost several AR steps per CPU
    # training step; the CPU presets use 128 / 32 (results/plm_second_pass/).
    preset_overrides={
        "tiny": {"block_size": 4, "k_pred": 4, "num_auxiliaries": 128, "auxiliary_top_m": 32},
        "small": {"block_size": 8, "k_pred": 4, "num_auxiliaries": 128, "auxiliary_top_m": 32},
        "base": {"block_size": 16, "k_pred": 6},
    },
))

register_family(FamilySpec(
    name="calm-ae", build=build_calm_autoencoder, config_class=f"{MODELING}:CALMAutoencoderConfig",
    model_class=f"{MODELING}:CALMAutoencoder",
    language_model=False, training_report=f"{COMPONENT_REPORTS}:calm_autoencoder_report",
    # `base` is the supplement's reference (hidden 512, intermediate 1280); `small` halves the width so an epoch of
    # the embedded corpus takes minutes on 2 CPU cores. K = 4 and l = 128 throughout.
    preset_overrides={
        "tiny": {"hidden_size": 64, "intermediate_size": 128, "latent_size": 32, "num_encoder_layers": 1,
                 "num_decoder_layers": 1},
        "small": {"hidden_size": 256, "intermediate_size": 640, "latent_size": 128},
        "base": {"hidden_size": 512, "intermediate_size": 1280, "latent_size": 128},
    },
))

register_family(FamilySpec(
    name="calm", build=build_calm, config_class=f"{MODELING}:CALMConfig", model_class=f"{MODELING}:CALMForCausalLM",
    components={"autoencoder": "calm-ae"}, lora_target_modules=BACKBONE_LORA_TARGETS,
    response_scorer=f"{SCORERS}:CALMResponseScorer", model_card=f"{CARDS}:CALM_CARD",
    # Lower temperature through the pool approximation: on a model this small two draws almost never decode to the
    # same chunk (`two_draws_agree_per_chunk`), so the exact sampler would spend its whole retry budget.
    bench_decodings={"T=1/2 pool": {"temperature": 0.5, "temperature_sampler": "pool"}},
    bench_measurements=f"{BENCH}:calm_measurements",
))

register_family(FamilySpec(
    name="cola-vae", build=build_cola_vae, config_class=f"{MODELING}:ColaVAEConfig",
    model_class=f"{MODELING}:ColaTextVAE",
    language_model=False, training_report=f"{COMPONENT_REPORTS}:cola_vae_report",
    # The paper's VAE has 4 + 4 blocks of width 1536 and d_z = 16; `small` keeps d_z = 16 and the code's VAE block of
    # 4 at the width of the `small` backbone, with 2 + 2 blocks, so that a VAE epoch takes minutes on 2 CPU cores.
    preset_overrides={
        "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "latent_size": 8, "vae_block_size": 2},
        "small": {"hidden_size": 256, "intermediate_size": 672, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "latent_size": 16, "vae_block_size": 4},
        "base": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 12,
                 "num_key_value_heads": 4, "latent_size": 16, "vae_block_size": 4},
    },
))

register_family(FamilySpec(
    name="cola", build=build_cola, config_class=f"{MODELING}:ColaConfig", model_class=f"{MODELING}:ColaForCausalLM",
    components={"vae": "cola-vae"}, lora_target_modules=BACKBONE_LORA_TARGETS,
    response_scorer=f"{SCORERS}:ColaResponseScorer", model_card=f"{CARDS}:COLA_CARD",
    bench_decodings={"no guidance": {"guidance_scale": 1.0}}, bench_measurements=f"{BENCH}:cola_measurements",
    # `small` trains with the logit-normal at loc 0.5 and decodes at w = 2 (the paper: loc 1, w = 7), the best
    # recipe at a small budget (results/cola_small_budget/).
    preset_overrides={"tiny": {"block_size": 4}, "small": {"block_size": 16, "time_loc": 0.5, "cfg_scale": 2.0},
                      "base": {"block_size": 16}},
))

register_family(FamilySpec(
    name="aurora-ae", build=build_aurora_autoencoder, config_class=f"{MODELING}:AuroraAutoencoderConfig",
    model_class=f"{MODELING}:AuroraAutoencoder", language_model=False,
    training_report=f"{COMPONENT_REPORTS}:aurora_autoencoder_report",
    # The paper's S autoencoder has 6 + 6 blocks of width D = 768; `small` keeps the query design at D = 128 with
    # 2 + 2 blocks. At these widths the paper's shared query does not learn to copy and the residual copy path
    # (`query_residual`) does (results/aurora_small_budget/), so `tiny` and `small` use it with the lighter
    # dropouts; `base` keeps the paper's form and dropouts.
    preset_overrides={
        "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "token_dropout": 0.1, "latent_dropout": 0.2, "query_residual": True},
        "small": {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "token_dropout": 0.1, "latent_dropout": 0.2, "query_residual": True},
        "base": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 12,
                 "num_key_value_heads": 4},
    },
))

register_family(FamilySpec(
    name="aurora", build=build_aurora, config_class=f"{MODELING}:AuroraConfig",
    model_class=f"{MODELING}:AuroraForCausalLM",
    components={"autoencoder": "aurora-ae"},
    response_scorer=f"{SCORERS}:AuroraResponseScorer", model_card=f"{CARDS}:AURORA_CARD",
    bench_decodings={"no SC-CFG": {"self_condition_guidance": 1.0},
                     "no guidance": {"self_condition_guidance": 1.0, "guidance_scale": 1.0}},
    bench_measurements=f"{BENCH}:aurora_measurements",
    lora_target_modules=r"model\.denoiser\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)",
    # D_b scales with the latent width (paper: 128 of 768); λ_ct ramps over the first half of a `small` run (paper:
    # 10k steps of the S model's run). `small` decodes without SC-CFG (w_sc = 1), better than the paper's w_sc = 4 at
    # a small budget (results/aurora_small_budget/); `base` keeps the paper's 4.
    preset_overrides={
        "tiny": {"block_size": 4, "noisy_input_rank": 16, "consistency_warmup_steps": 10},
        "small": {"block_size": 16, "noisy_input_rank": 64, "consistency_warmup_steps": 300,
                  "self_condition_guidance": 1.0},
        "base": {"block_size": 16, "noisy_input_rank": 128, "consistency_warmup_steps": 10000},
    },
))
