"""The papers' ablations, measured on a generated language where the optimum is known.

Findings (results/generated_findings/):

- `plm`: auxiliaries none < quantile < Voronoi in R (reconstructed tokens of the objective on validation rows), and
  R as the block stride falls (paper 002, Tables 4-5); each decodable variant also as tokens per call (exact
  acceptance) and BrierLM-2 gap closed.
- `calm`: chunk size K = 2 against K = 4 at equal training FLOPs of the language model (the autoencoders trained
  alike beforehand).
- `aurora`: self-trajectory consistency on/off at 4 and 8 sampling steps, x0 against velocity loss space.
- `cola` (a trained model, `--cola-model DIR`): CFG scale w and Euler steps, decoding only.
- `cola-recipe`: the small-budget recipe at equal steps: the paper's (LogitNormal loc 1, VAE trained jointly,
  weight decay 0.1) against one change each (loc 0.5; VAE frozen; VAE frozen for the first 100 steps; weight decay
  0.01), each decoded at w ∈ {1, 2, 3, 7}.
- `aurora-sc` (a trained model, `--aurora-model DIR`): SC-CFG w_sc ∈ {1, 2, 4} with the next step's draft guided or
  unguided (prompt CFG off), decoding only.

Every training run is `tiny` on `--level` (default easy) unless `--preset` says otherwise; `--seeds` repeats each
(training and evaluation seed alike). One process; JSON to `--output`, a Markdown table printed per finding.

    python scripts/experiments/generated_paper_findings.py --finding plm --seeds 0,1
    python scripts/experiments/generated_paper_findings.py --finding cola --cola-model runs/generated-medium/cola-x1 \
        --level medium --positions 2000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hf_latentlm.data.generated import GeneratedLanguage
from hf_latentlm.eval.bench import markdown_table
from hf_latentlm.eval.flops import training_flops_per_token
from hf_latentlm.eval.optimum import evaluate_against_optimum, evaluation_stream, percent_interval
from hf_latentlm.eval.plm import reconstruction, tokens_per_call
from hf_latentlm.families import build_model, get_family
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.training.loop import TrainConfig, train

NO_GUIDANCE = {"aurora": {"self_condition_guidance": 1.0, "guidance_scale": 1.0}, "cola": {"guidance_scale": 1.0}}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--finding", required=True, choices=["plm", "calm", "aurora", "cola", "cola-recipe", "aurora-sc"])
    p.add_argument("--level", default="easy")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps of each trained variant")
    p.add_argument("--component-steps", type=int, default=100)
    p.add_argument("--seeds", default="0")
    p.add_argument("--positions", type=int, default=2000)
    p.add_argument("--context-len", type=int, default=32)
    p.add_argument("--cola-model", help="--finding cola: the trained Cola folder to decode")
    p.add_argument("--aurora-model", help="--finding aurora-sc: the trained AURORA folder to decode")
    p.add_argument("--output", default="runs/generated-findings")
    return p.parse_args()


def trained(family: str, folder: Path, args, seed: int, steps: int, components: dict | None = None,
            training: dict | None = None, **overrides):
    """Train once (kept in `folder`), return the folder. `training`: TrainConfig overrides; the rest: the model's."""
    if not (folder / "model.safetensors").is_file():
        train(TrainConfig(family=family, preset=args.preset, output_dir=str(folder), max_steps=steps, eval_every=0,
                          save_every=steps, keep_checkpoints=1, corpus=f"generated:{args.level}", seed=seed,
                          progress_bar=False, components=components or {}, model_kwargs=overrides,
                          **(training or {})))
    return str(folder)


def gap(model, language, args, seed: int, **options) -> dict:
    result = evaluate_against_optimum(model.eval(), language, args.positions, args.context_len, seed=seed, pairs=2,
                                      generate_kwargs=options or None, likelihood=False)
    return {"brierlm_2": result["gap_closed"]["brierlm_2"], "brier_1": result["gap_closed"]["brier_1"],
            "model_brierlm_2": result["model"]["brierlm_2"]["value"]}


def validation_rows(language, length: int = 64, count: int = 64):
    return evaluation_stream(language)[: count * length].view(count, length)


def trained_variants(family: str, variants: dict, args, seed: int, out: Path, folder_name):
    """(label, trained model) for each variant (label -> overrides of `trained`) of a one-component family, all
    around one component trained once for the seed; run folders `out/FAMILY-<folder_name(label)>-s<seed>`."""
    (name, source), = get_family(family).components.items()
    component = trained(source, out / f"{source}-s{seed}", args, seed, args.component_steps)
    for label, overrides in variants.items():
        folder = trained(family, out / f"{family}-{folder_name(label)}-s{seed}", args, seed, args.steps,
                         components={name: component}, **overrides)
        yield label, load_model_and_tokenizer(folder)[0]


def decoding_table(title: str, rows: dict) -> str:
    return markdown_table([title, "gap closed BrierLM-2", "gap closed Brier-1", "BrierLM-2"],
                          [[k, percent_interval(v["brierlm_2"]), percent_interval(v["brier_1"]), f"{v['model_brierlm_2']:.2f}"]
                           for k, v in rows.items()])


def given_model(folder: str | None, missing: str):
    if not folder:
        raise SystemExit(missing)
    return load_model_and_tokenizer(folder)[0]


def plm_finding(args, language, seeds, out):
    variants = {"none": {"auxiliary_type": "none"}, "quantile": {"auxiliary_type": "quantile"},
                "voronoi": {"auxiliary_type": "voronoi"},
                "voronoi, stride 2": {"auxiliary_type": "voronoi", "block_stride": 2},
                "voronoi, stride 1": {"auxiliary_type": "voronoi", "block_stride": 1}}
    rows = {}
    for seed in seeds:
        for label, overrides in variants.items():
            folder = out / f"plm-{label.replace(', ', '-').replace(' ', '')}-s{seed}"
            model, _ = load_model_and_tokenizer(trained("plm", folder, args, seed, args.steps, **overrides))
            row = reconstruction(model.eval(), validation_rows(language))
            if overrides["auxiliary_type"] != "none":  # without auxiliaries there is no sampler to decode with
                prompts = validation_rows(language, args.context_len, 8)
                row.update(tokens_per_call=tokens_per_call(model, prompts, 32, seed=seed, acceptance="exact"),
                           **gap(model, language, args, seed))
            rows[f"{label} (seed {seed})"] = row
    table = markdown_table(["PLM variant", "R (reconstructed tokens)", "decoder NLL", "tokens per call (exact)",
                            "gap closed BrierLM-2"],
                           [[k, f"{v['reconstructed_tokens']:.3f}", f"{v['decoder_nll']:.3f}",
                             f"{v['tokens_per_call']:.3f}" if "tokens_per_call" in v else "—",
                             percent_interval(v["brierlm_2"]) if "brierlm_2" in v else "—"] for k, v in rows.items()])
    return rows, table


def calm_finding(args, language, seeds, out):
    tokenizer = language.tokenizer()
    rows = {}
    for seed in seeds:
        budget = None
        for k in (4, 2):
            ae = trained("calm-ae", out / f"calm-ae-k{k}-s{seed}", args, seed, args.component_steps, chunk_size=k)
            flops = training_flops_per_token(build_model("calm", args.preset, tokenizer, autoencoder=ae),
                                             64)["per_token"]  # the tiny preset's rows
            budget = budget or flops * args.steps  # K = 4 at --steps sets the FLOPs both get
            steps = max(1, round(budget / flops))
            model, _ = load_model_and_tokenizer(trained("calm", out / f"calm-k{k}-s{seed}", args, seed, steps,
                                                        components={"autoencoder": ae}))
            rows[f"K = {k} (seed {seed})"] = {"steps": steps, "flops_per_token": flops,
                                             **gap(model, language, args, seed)}
    table = markdown_table(["CALM", "steps at equal FLOPs", "gap closed BrierLM-2", "gap closed Brier-1"],
                           [[k, v["steps"], percent_interval(v["brierlm_2"]), percent_interval(v["brier_1"])] for k, v in rows.items()])
    return rows, table


def aurora_finding(args, language, seeds, out):
    variants = {"x0, STC": {}, "x0, no STC": {"consistency_weight": 0.0}, "velocity, STC": {"loss_space": "velocity"}}
    rows = {}
    for seed in seeds:
        for label, model in trained_variants("aurora", variants, args, seed, out,
                                             lambda label: label.replace(", ", "-").replace(" ", "")):
            for steps in (4, 8):
                rows[f"{label}, {steps} steps (seed {seed})"] = gap(model, language, args, seed, num_inference_steps=steps,
                                                                   **NO_GUIDANCE["aurora"])
    table = markdown_table(["AURORA variant (no guidance)", "gap closed BrierLM-2", "gap closed Brier-1"],
                           [[k, percent_interval(v["brierlm_2"]), percent_interval(v["brier_1"])] for k, v in rows.items()])
    return rows, table


def cola_finding(args, language, seeds, out):
    model = given_model(args.cola_model, "--finding cola needs --cola-model DIR")
    rows = {}
    for seed in seeds:
        for w in (0.0, 1.0, 3.0, 7.0, 10.0, 20.0):
            rows[f"w = {w:g}, 16 steps (seed {seed})"] = gap(model, language, args, seed, guidance_scale=w)
        for steps in (2, 4, 8, 16, 32):
            rows[f"w = 1, {steps} steps (seed {seed})"] = gap(model, language, args, seed, guidance_scale=1.0,
                                                              num_inference_steps=steps)
    return rows, decoding_table("Cola decoding", rows)


def cola_recipe_finding(args, language, seeds, out):
    variants = {"paper (loc 1, joint VAE, wd 0.1)": {}, "loc 0.5": {"time_loc": 0.5},
                "VAE frozen": {"vae_learning_rate_ratio": 0.0}, "VAE frozen for 100 steps": {"vae_frozen_steps": 100},
                "wd 0.01": {"training": {"weight_decay": 0.01}}}
    rows = {}
    for seed in seeds:
        for label, model in trained_variants("cola", variants, args, seed, out,
                                             lambda label: "recipe-" + label.split(" (")[0].replace(" ", "-")
                                             .replace(".", "")):
            for w in (1.0, 2.0, 3.0, 7.0):
                rows[f"{label}, w = {w:g} (seed {seed})"] = gap(model, language, args, seed, guidance_scale=w)
    return rows, decoding_table("Cola recipe", rows)


def aurora_sc_finding(args, language, seeds, out):
    model = given_model(args.aurora_model, "--finding aurora-sc needs --aurora-model DIR")
    rows = {}
    for seed in seeds:
        for w_sc, draft in ((1.0, "guided"), (2.0, "guided"), (2.0, "unguided"), (4.0, "guided"), (4.0, "unguided")):
            label = "w_sc = 1 (off)" if w_sc == 1 else f"w_sc = {w_sc:g}, {draft} draft"
            rows[f"{label} (seed {seed})"] = gap(model, language, args, seed, guidance_scale=1.0,
                                                 self_condition_guidance=w_sc, self_condition_draft=draft)
    return rows, decoding_table("AURORA SC-CFG (prompt CFG off)", rows)


def main():
    args = parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    language = GeneratedLanguage.from_level(args.level)
    seeds = [int(s) for s in args.seeds.split(",")]
    start = time.perf_counter()
    finding = {"plm": plm_finding, "calm": calm_finding, "aurora": aurora_finding, "cola": cola_finding,
               "cola-recipe": cola_recipe_finding, "aurora-sc": aurora_sc_finding}[args.finding]
    rows, table = finding(args, language, seeds, out)
    record = {"finding": args.finding, "settings": vars(args), "seconds": time.perf_counter() - start, "rows": rows}
    (out / f"{args.finding}-{args.level}.json").write_text(json.dumps(record, indent=1))
    print(table)


if __name__ == "__main__":
    main()
