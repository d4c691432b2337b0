"""The family-specific texts of a model card (`hf-latentlm push`, `hub.build_model_card`).

Each family's registry entry names its card (`FamilySpec.model_card`, "hf_latentlm.cards:PLM_CARD"); a family
without one gets `default_card`, built from its model class. Pure data: this module imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyCard:
    """The family-specific parts of a model card."""

    title: str
    about: str        # the family in two sentences
    generate: str     # the snippet's generate() call and what it prints, with the family's own options
    limitations: str  # beyond CPU_SCALE
    citation: str     # BibTeX of the family's paper ("" when there is none)


AR_CARD = FamilyCard(
    title="autoregressive baseline",
    about="The matched autoregressive baseline of hf-latentlm: transformers' `LlamaForCausalLM` built from the "
          "same preset table as the latent families, emitting one token per model call. Every speed and quality "
          "number of the other families is measured against it.",
    generate='out = model.generate(**ids, max_new_tokens=32, do_sample=True, top_p=0.95,\n'
             '                     pad_token_id=tok.pad_token_id)\n'
             'for row in out:\n'
             '    print(repr(tok.decode(row[ids.input_ids.shape[1]:], skip_special_tokens=True)))',
    limitations="One network call per generated token: it is the speed reference, not a fast model.",
    citation="")


PLM_CARD = FamilyCard(
    title="PLM (Parallel Language Model)",
    about="PLM is one weight-shared transformer with two modes: a causal encoder (an ordinary next-token LM) and "
          "a parallel decoder that reads auxiliary variables drawn from each target's Voronoi cell and predicts "
          "a block of K tokens in one call. Its `generate()` is quadratic decoding: every call verifies the "
          "proposed tokens against the encoder and proposes the next block, so several tokens can be accepted "
          "per call.",
    generate='out = model.generate(**ids, max_new_tokens=32, k_pred=4, acceptance="exact",  '
             '# or "epsilon" / "nucleus"\n'
             '                     auxiliary_seeds=[1, 2], return_dict_in_generate=True)\n'
             'for row in out.sequences:\n'
             '    print(repr(tok.decode(row[ids.input_ids.shape[1]:], skip_special_tokens=True)))\n'
             'print(out.model_calls.tolist())  # model calls per row, prompt prefill included',
    limitations='`acceptance="exact"` emits exactly the tokens of one-token-per-call Voronoi sampling, but that '
                "sampler is itself a truncation of the encoder's softmax: only the top-M candidates, with masses "
                "in units of 1/N_aux, can be drawn, so rare tokens are never sampled and the distribution differs "
                'from plain softmax sampling. `"epsilon"` and `"nucleus"` acceptance give more tokens per call '
                "and are not lossless.",
    citation="@article{plm,\n  title  = {Parallel Language Models via Variational Decoding},\n"
             "  note   = {see the paper for its authors}\n}")


CALM_CARD = FamilyCard(
    title="CALM (Continuous Autoregressive Language Model)",
    about="CALM compresses every chunk of K tokens into one continuous vector with an autoencoder, and a "
          "transformer predicts the next vector with a single-pass energy head trained with the energy score, "
          "so one backbone call yields K tokens. The autoencoder is frozen and its weights are stored inside "
          "this checkpoint.",
    generate='out = model.generate(**ids, max_new_tokens=32, temperature=0.5,  # T = 1 (default): one draw\n'
             '                     temperature_sampler="pool",              # or "exact" (any T in (0, 1])\n'
             '                     noise_seeds=[1, 2], return_dict_in_generate=True)\n'
             'for row in out.sequences:\n'
             '    print(repr(tok.decode(row[ids.input_ids.shape[1]:], skip_special_tokens=True)))\n'
             'print(out.model_calls.tolist())  # one backbone call per K tokens, prompt prefill included',
    limitations="Every chunk comes back through the autoencoder, whose reconstruction is not exact: a latent "
                "decodes to a wrong chunk with the autoencoder's error rate even when the prediction is right. "
                "There is no token likelihood (no NLL or perplexity; it is scored with Brier-n from samples). "
                'Temperature is obtained by rejection from head draws: `"exact"` (any T in (0, 1]: n = ⌊1/T⌋ '
                'identical decoded draws, then a Bernoulli-factory stage for the fraction) retries until it '
                'accepts and gives up after `exact_max_rounds`; `"pool"` decodes 200 draws per '
                "step; both cost many more draws and decodes than T = 1.",
    citation="@article{calm,\n  title  = {Continuous Autoregressive Language Models},\n"
             "  author = {Shao and others},\n  year   = {2025}\n}")


COLA_CARD = FamilyCard(
    title="Cola DLM (Continuous Latent Diffusion Language Model)",
    about="Cola DLM encodes text with a causal text VAE (one latent per token) and generates with a "
          "block-causal DiT prior that denoises one block of latents at a time by flow matching, conditioned on "
          "the clean blocks before it; the VAE decoder reads a finished block out in one pass. The VAE is "
          "trained jointly with the prior and stored inside this checkpoint.",
    generate='out = model.generate(**ids, max_new_tokens=32, num_inference_steps=16,  # ODE steps per block\n'
             '                     ode_solver="heun", guidance_scale=7.0, temperature=0.7,\n'
             '                     noise_seeds=[1, 2], return_dict_in_generate=True)\n'
             'for row in out.sequences:\n'
             '    print(repr(tok.decode(row[ids.input_ids.shape[1]:], skip_special_tokens=True)))\n'
             'print({name: calls.tolist() for name, calls in out.calls_by_network.items()})',
    limitations="At the `small` preset the samples are not yet text (BrierLM-2 near 0 in the package's benchmark, "
                "docs/families/cola.md). Each block costs `num_inference_steps` DiT evaluations, twice that with "
                "classifier-free guidance, so the default settings are slower than AR on a CPU. There is no "
                "token likelihood.",
    citation="@article{cola,\n  title  = {Cola DLM: Continuous Latent Diffusion Language Model},\n"
             "  journal = {arXiv preprint arXiv:2605.06548}\n}")


AURORA_CARD = FamilyCard(
    title="AURORA-LM",
    about="AURORA-LM maps text to a full-width latent sequence with a frozen query-based autoencoder and "
          "generates it block by block with a block-causal denoiser that predicts clean latents (x0), with "
          "self-conditioning and self-trajectory consistency. The autoencoder is frozen and stored inside this "
          "checkpoint.",
    generate='out = model.generate(**ids, max_new_tokens=32, num_inference_steps=16,  # Euler steps per block\n'
             '                     self_condition_guidance=4.0, guidance_scale=2.0,\n'
             '                     noise_seeds=[1, 2], return_dict_in_generate=True)\n'
             'for row in out.sequences:\n'
             '    print(repr(tok.decode(row[ids.input_ids.shape[1]:], skip_special_tokens=True)))\n'
             'print({name: calls.tolist() for name, calls in out.calls_by_network.items()})',
    limitations="At the `small` preset the samples are not yet text (BrierLM-2 near 0 in the package's benchmark, "
                "docs/families/aurora.md), and the autoencoder does not reconstruct every token. Each block costs "
                "one or two denoiser evaluations per Euler step, so the default settings are slower than AR on a "
                "CPU. There is no token likelihood.",
    citation="@article{aurora,\n  title  = {AURORA-LM: Autoencoding Unified Representation for Continuous-Latent "
             "Diffusion Language Modeling},\n  author = {Jiajun Liang and Yucheng Liao and Yukang Cao and Jiazhe "
             "Wei and Ken Li and Wende Tan and Jiankun Zhang and ZY Cui and Jingkang Yang and Liucheng Guo and "
             "Shiqi Yang and B. Yang and Caifeng Shan and Ziwei Liu and Chenyang Si}\n}")


GENERIC_GENERATE = ('out = model.generate(**ids, max_new_tokens=32, do_sample=True)\n'
                    'for row in out:\n'
                    '    print(repr(tok.decode(row[ids.input_ids.shape[1]:], skip_special_tokens=True)))')


def default_card(family: str, model_class: type) -> FamilyCard:
    """The card of a family whose registry entry names none: its model class's docstring, a plain sampling call."""
    doc = (model_class.__doc__ or "").strip().split("\n\n")[0]
    about = " ".join(doc.split()) or f"A model of the `{family}` family of hf-latentlm."
    return FamilyCard(title=f"{family} ({model_class.__name__})", about=about, generate=GENERIC_GENERATE,
                      limitations="", citation="")
