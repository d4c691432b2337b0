"""`hf-latentlm` command line: train, generate, eval, bench, sft, dpo, grpo, report, push, serve, lm-eval, convert.

`train`'s options are `TrainConfig`'s fields and `sft` / `dpo` / `grpo`'s those of `PostTrainingArguments`, built by
TRL's dataclass parser, which imports neither torch nor transformers: `--help` and argument errors answer at once.
Every user mistake (bad argument, missing folder, empty prompt, unknown preset or family) ends with ONE line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from trl import TrlParser

from .families import FAMILIES, check_components, check_init_from, component_names, get_family
from .presets import get_preset
from .training.config import REPORT_TO_HELP, TrainConfig, check_output_dir


class CommandParser(TrlParser):
    """TRL's dataclass parser (each option's default shown in its help) whose errors are one line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


@dataclass
class PostTrainingArguments:
    """`sft`, `dpo` and `grpo`: the arguments of `recipes.run_sft` / `run_dpo` / `run_grpo`."""

    model: str = field(metadata={"help": "model folder written by train (dpo, grpo: by sft)"})
    output_dir: str = field(metadata={"help": "where checkpoints and the tuned model go"})
    task: str | None = field(default=None, metadata={
        "help": "task of hf_latentlm.training.tasks (None: its DEFAULT_TASK)"})
    max_steps: int | None = field(default=None, metadata={"help": "optimizer steps (None: one epoch)"})
    lora: bool = field(default=False, metadata={"help": "train a LoRA adapter, then save the merged model"})
    learning_rate: float | None = field(default=None, metadata={
        "help": "None: 1e-4 (sft) / 5e-6 (dpo) / 1e-5 (grpo), 10x with --lora"})
    batch_size: int = field(default=8, metadata={
        "help": "pairs (dpo), examples (sft) or completions (grpo) per device"})
    train_size: int | None = field(default=None, metadata={
        "help": "training examples drawn from the task (None: the task's)"})
    seed: int = field(default=0, metadata={"help": "data order, sampling and initialisation"})
    save_every: int = field(default=100, metadata={
        "help": "optimizer steps between resumable checkpoints (output-dir/checkpoint-<step>, the newest 2 kept; "
                "also saved at the last step)"})
    resume: bool = field(default=False, metadata={
        "help": "continue from the newest checkpoint in --output-dir (give the interrupted run's options)"})
    report_to: str = field(default="none", metadata={"help": REPORT_TO_HELP})


@dataclass
class SFTArguments(PostTrainingArguments):
    model: str | None = field(default=None, kw_only=True, metadata={
        "help": "model folder written by train (or give --init-from)"})
    init_from: str | None = field(default=None, metadata={
        "help": "instead of --model: a fresh --family model started from this causal LM, a folder or Hub id (as "
                "`train --init-from`, e.g. an `ar` run after its own post-training)"})
    family: str | None = field(default=None, metadata={"help": "with --init-from: the family to start (None: plm)"})
    preset: str | None = field(default=None, metadata={
        "help": "with --init-from: the preset of the family's own fields (None: small)"})
    encoder_kl_weight: float = field(default=0.0, metadata=TrainConfig.__dataclass_fields__["encoder_kl_weight"].metadata)


@dataclass
class DPOArguments(PostTrainingArguments):
    policy_rejections: bool = field(default=False, metadata={
        "help": "reject the model's own wrong answers (sampled once, before training) instead of the task's "
                "made-up ones, wherever the model answers wrong"})


@dataclass
class GRPOArguments(PostTrainingArguments):
    batch_size: int = field(default=16, metadata={"help": "completions per device"})
    num_generations: int = field(default=8, metadata={
        "help": "completions per prompt (a group); --batch-size must be a multiple of it"})
    beta: float = field(default=0.0, metadata={
        "help": "weight of the KL to the reference (TRL's default 0: no reference model)"})
    num_score_draws: int = field(default=2, metadata={
        "help": "CALM, Cola, AURORA: draw sets per response in the likelihood surrogate"})


POST_TRAINING = {
    "sft": (SFTArguments, "supervised fine-tuning of a trained model (or of one started from a causal LM) on an "
                          "instruction task"),
    "dpo": (DPOArguments, "preference optimisation (DPO) of a fine-tuned model on an instruction task"),
    "grpo": (GRPOArguments, "reinforcement learning (GRPO) of a fine-tuned model on an instruction task, rewarded "
                            "by exact match plus partial credit"),
}


def build_parser() -> argparse.ArgumentParser:
    # The commands listed from the table itself, so the top-level --help names every one.
    parser = CommandParser(prog="hf-latentlm", description=f"`hf-latentlm` command line: {', '.join(COMMANDS)}.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    add_train_command(sub)
    add_model_commands(sub)
    add_comparison_commands(sub)
    for name, (arguments, help_text) in POST_TRAINING.items():
        sub.add_parser(name, dataclass_types=[arguments], help=help_text)
    add_push_and_serve_commands(sub)
    add_convert_command(sub)
    return parser


CONTEXT_LEN_HELP = ("tokens of context before each scored window (default: the largest up to 128 that keeps every "
                    "window inside the positions the model was trained at)")


def add_train_command(sub) -> None:
    t = sub.add_parser("train", dataclass_types=[TrainConfig],
                       help="train a model on the embedded corpus (or your text files)")
    for name in component_names():  # one option per trained component a family needs (e.g. --autoencoder)
        users = {s.name: s.components[name] for s in FAMILIES.values() if name in s.components}
        t.add_argument(f"--{name}", help="; ".join(f"--family {user}: folder of a trained {name} (from --family "
                                                   f"{source})" for user, source in users.items()))
    t.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field of the family's config (repeatable); VALUE is read as JSON "
                        "(64, 0.5, null, true, \"x0\") or else taken as a string, e.g. --config loss_space=velocity")
    t.add_argument("--sample-prompt", help="prompt of the summary's sample (default: 'ROMEO.\\n', or a generated "
                                           "language's first validation words)")
    t.add_argument("--no-summary", "--no-sample", dest="no_summary", action="store_true",
                   help="train and save only: no summary after training (speed against a fresh AR baseline, the "
                        "optimum of a generated language, the family's own report, a sample); --no-sample is its "
                        "older name")


def add_model_commands(sub) -> None:
    g = sub.add_parser("generate", help="continue a prompt with a trained model")
    g.add_argument("--model", required=True, help="model folder written by train")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=100)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--greedy", action="store_true")

    e = sub.add_parser("eval", help="Brier-n / BrierLM / BrierLM-2 (+ NLL, MAUVE) as JSON")
    e.add_argument("--model", required=True)
    e.add_argument("--split", default="validation", choices=["validation", "test"])
    e.add_argument("--text-file", action="extend", nargs=1, metavar="FILE", help="evaluate on your own texts instead "
                   "of the embedded corpus (repeatable): a text file is one document, a JSON-lines file one per line")
    e.add_argument("--num-positions", type=int, default=20000)
    e.add_argument("--context-len", type=int, help=CONTEXT_LEN_HELP)
    e.add_argument("--batch-size", type=int, default=64)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--mauve", action="store_true", help="also MAUVE (needs `pip install hf-latentlm[eval]`)")

    # Every argument after `lm-eval` is lm-eval's own (no prefix character here, so none is parsed as an option).
    le = sub.add_parser("lm-eval", add_help=False, prefix_chars="+", help="lm-evaluation-harness's command line "
                        "with the hf-latentlm model registered; pip install 'hf-latentlm[eval]' (docs/lm_eval.md)")
    le.add_argument("lm_eval_args", nargs=argparse.REMAINDER)


def add_comparison_commands(sub) -> None:
    b = sub.add_parser("bench", help="several models side by side in one run, ratios to a baseline")
    b.add_argument("--model", action="append", required=True, metavar="NAME=DIR",
                   help="a model to measure (repeatable)")
    b.add_argument("--baseline", help="NAME of the baseline (default: the first model)")
    b.add_argument("--num-positions", type=int, default=20000)
    b.add_argument("--context-len", type=int, help=CONTEXT_LEN_HELP)
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--mauve", action="store_true")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--output", default="results/bench/benchmarks.json", help="the JSON record")
    b.add_argument("--markdown", default="results/bench/benchmarks_table.md", help="the table")
    # Extras: each model measured further, next to the baseline, after the table.
    b.add_argument("--extras", action="store_true", help="each model's family decoding settings and own "
                   "measurements (the registry's bench_decodings / bench_measurements)")
    b.add_argument("--sweep", action="append", default=[], metavar="NAME:KEY=V1,V2,...",
                   help="also measure model NAME with generate() option KEY at each value, e.g. "
                        "cola:num_inference_steps=2,4,8 (repeatable)")
    b.add_argument("--sweep-positions", type=int, default=500, help="BrierLM-2 positions of each extra decoding")
    b.add_argument("--train-steps", type=int, default=0, help="time this many training steps of a copy of each model")
    b.add_argument("--train-preset", default="small", help="batch size and row length of the timed training steps")
    b.add_argument("--profile", action="store_true", help="cProfile of one batch-1 generate() of each model")
    b.add_argument("--compile", action="store_true", help="each model's decoding eager and compiled at batch 1 and 8 "
                   "(generate(compile_config=...); the AR baseline with transformers' static cache + compile)")

    r = sub.add_parser("report", help="every model and decoding setting against the AR baseline in one run: "
                                      "Markdown table, JSON and a speed-versus-quality plot")
    r.add_argument("--model", action="append", required=True, metavar="NAME=DIR",
                   help="a model to report (repeatable); one must be ar=DIR, the baseline")
    r.add_argument("--output", default="results/report", help="folder for report.md, report.json, speed_quality.png")
    r.add_argument("--num-positions", type=int, default=2000, help="BrierLM-2 positions per entry")
    r.add_argument("--context-len", type=int, help=CONTEXT_LEN_HELP)
    r.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per timed generate()")
    r.add_argument("--repeats", type=int, default=3, help="timed runs per speed (median)")
    r.add_argument("--mauve-samples", type=int, default=400, help="continuations per entry for MAUVE")
    r.add_argument("--no-mauve", action="store_true", help="skip MAUVE")
    r.add_argument("--seed", type=int, default=0)


def add_push_and_serve_commands(sub) -> None:
    h = sub.add_parser("push", help="upload a model folder (weights, config, remote code, tokenizer) with a model "
                                    "card to the Hugging Face Hub")
    h.add_argument("--model", required=True, help="model folder written by train / sft / dpo")
    h.add_argument("--repo-id", required=True, metavar="OWNER/NAME")
    h.add_argument("--private", action="store_true", help="create the repository as private")
    h.add_argument("--revision", help="branch to push to (created if missing; default: main)")
    h.add_argument("--license", help="license in the model card (default: a converted checkpoint's own, else "
                                     "apache-2.0)")
    h.add_argument("--eval-results", metavar="FILE",
                   help="the model's `hf-latentlm eval` JSON, for the card's results and model-index (default: "
                        "eval_results.json in the model folder, if there is one)")
    h.add_argument("--baseline-eval", metavar="FILE",
                   help="the AR baseline's `hf-latentlm eval` JSON, measured the same way: the card compares them")
    h.add_argument("--base-model", metavar="OWNER/NAME",
                   help="Hub repository of the model an sft/dpo output was trained from (default: its record, "
                        "post_training.json, when that names a Hub repository)")
    h.add_argument("--dataset", action="append", metavar="ID", help="a Hub dataset trained on (repeatable)")

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming) batching "
                                     "concurrent requests; pip install 'hf-latentlm[serve]' (docs/serving.md)")
    s.add_argument("--model", action="append", required=True, metavar="DIR|NAME=DIR",
                   help="a model folder to serve (repeatable); requests name it by NAME (default: the folder's name)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (this machine only by default)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--max-batch-size", type=int, default=8, help="requests per generate() call")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting per model before the server answers 429")
    s.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long a batch waits for more requests after its first")
    s.add_argument("--seed", type=int, default=0, help="first seed of the requests that give none (each takes the next)")
    s.add_argument("--device", help="torch device for the models (default: where they load, the CPU)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")


def add_convert_command(sub) -> None:
    c = sub.add_parser("convert", help="an official CALM or Cola DLM checkpoint (folder or Hub id) -> an hf_latentlm "
                                       "model folder (docs/checkpoints.md)")
    kinds = c.add_subparsers(dest="official_family", required=True, parser_class=CommandParser)
    calm = kinds.add_parser("calm", help="shaochenze/calm: an EnergyTransformer checkpoint and its autoencoder")
    calm.add_argument("--model", required=True, metavar="SRC", help="the CALM checkpoint: folder or Hub id")
    calm.add_argument("--autoencoder", metavar="SRC",
                      help="the official autoencoder (default: the ae_model.* tensors inside --model)")
    cola = kinds.add_parser("cola", help="ByteDance-Seed/Cola-DLM: the text VAE and the DiT")
    cola.add_argument("--vae", required=True, metavar="SRC", help="the text VAE: folder or Hub id")
    cola.add_argument("--dit", required=True, metavar="SRC", help="the DiT: folder or Hub id")
    for kind in (calm, cola):
        kind.add_argument("--tokenizer", metavar="SRC",
                          help="tokenizer folder or Hub id saved with the model (default: none; pass token ids)")
        kind.add_argument("--output-dir", required=True, help="the new model folder")
        kind.add_argument("--overwrite-output-dir", action="store_true", help="replace a non-empty --output-dir")


def resolve_context_len(context_len: int | None, configs: list[dict]) -> int:
    """The given context, or the default: the largest up to 128 whose Brier windows stay inside the positions every
    model of `configs` (config.json dicts) was trained at. The results record the context used."""
    if context_len is not None:
        return context_len
    from .eval.brier import MAX_N
    from .eval.sampling import fitting_context_len

    return fitting_context_len(configs, MAX_N)


def model_configs(models: dict[str, str]) -> list[dict]:
    """The config.json of each `--model NAME=DIR` folder; a damaged folder is refused before torch loads."""
    from .folders import check_model_folder

    return [check_model_folder(folder, f"--model {name}={folder}") for name, folder in models.items()]


def check_at_least_one(args, *names: str) -> None:
    """ValueError naming the first of the integer options `names` set below 1."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def config_overrides(items: list[str]) -> dict:
    """`--config KEY=VALUE` items -> {key: value}, each value parsed as JSON when it parses, else kept as a string."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--config {item!r}: expected KEY=VALUE")
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value
    return overrides


def check_config_keys(spec, overrides: dict) -> None:
    """ValueError naming a `--config` key the family's config does not have (transformers' configs would keep an
    unknown key silently, so a typo would train the default)."""
    from transformers import LlamaConfig

    known = (spec.config_class or LlamaConfig)()
    unknown = sorted(key for key in overrides if not hasattr(known, key))
    if unknown:
        raise ValueError(f"--config: the {spec.name} family's config has no field(s) {unknown}")


def train_config(args) -> TrainConfig:
    """The resolved `TrainConfig` of `train`'s arguments (the component options and `--config` items merged in),
    checked without torch up to the family's config keys."""
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    cfg.components.update({name: getattr(args, name) for name in component_names() if getattr(args, name)})
    cfg.model_kwargs.update(config_overrides(args.config))
    spec = get_family(cfg.family)
    get_preset(cfg.preset)
    check_components(cfg.family, cfg.components)
    for name, folder in cfg.components.items():  # (the registry checks the folder's contents when it loads it)
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"--{name} {folder!r} does not exist: not a saved {name} folder")
    cfg = cfg.resolved()  # fail on bad values before loading any data
    earlier_checkpoints = check_output_dir(cfg)
    check_config_keys(spec, cfg.model_kwargs)  # the config classes come with torch
    for folder in earlier_checkpoints:  # --overwrite-output-dir, once every check has passed
        shutil.rmtree(folder)
    return cfg


def cmd_train(args) -> int:
    """Train and save; then, on the main process of a finished run, the eval layer's summary."""
    cfg = train_config(args)
    args.output_dir = cfg.output_dir  # resolved: the Ctrl-C hint names its checkpoints
    from .training.loop import train

    metrics = train(cfg)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}))
    finished = cfg.stop_at_step is None or cfg.stop_at_step == cfg.max_steps
    if finished and int(os.environ.get("RANK", "0")) == 0:
        if not args.no_summary:
            from .eval.summary import print_training_summary

            print_training_summary(cfg, args.sample_prompt)
        print(next_commands(cfg))
    return 0


def next_commands(cfg) -> str:
    """Where a finished run was saved and what to run on it next: a language model generates and is evaluated; a
    component is what its families train on (the registry's `components`)."""
    import shlex

    folder = shlex.quote(str(cfg.output_dir))
    if get_family(cfg.family).language_model:
        commands = [f"hf-latentlm generate --model {folder} --prompt 'ROMEO.'", f"hf-latentlm eval --model {folder}"]
    else:
        commands = [f"hf-latentlm train --family {spec.name} --{name.replace('_', '-')} {folder} --output-dir DIR"
                    for spec in FAMILIES.values() for name, source in spec.components.items() if source == cfg.family]
    return f"saved to {cfg.output_dir}; next:\n" + "\n".join(f"  {command}" for command in commands)


def cmd_generate(args) -> int:
    from .loading import load_model_and_tokenizer

    if not args.prompt.strip():
        raise ValueError("the prompt is empty")
    if args.temperature <= 0:
        raise ValueError(f"--temperature must be positive, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    model, tokenizer = load_model_and_tokenizer(args.model)  # a bad folder is refused before torch loads
    from .eval.summary import generate_text

    sampling = {"do_sample": False} if args.greedy else dict(temperature=args.temperature, top_k=args.top_k,
                                                             top_p=args.top_p)
    text, _ = generate_text(model, tokenizer, args.prompt, args.max_new_tokens, args.seed, **sampling)
    print(args.prompt + text)
    return 0


def cmd_eval(args) -> int:
    from .folders import check_model_folder

    check_at_least_one(args, "num_positions", "context_len")
    config = check_model_folder(args.model, f"model folder {args.model!r}")
    context_len = resolve_context_len(args.context_len, [config])
    from .data.generated import GeneratedLanguage
    from .eval.harness import evaluate_model  # torch: after every argument check
    from .eval.optimum import optimum_headline
    from .loading import load_model_and_tokenizer
    from .training.corpus import load_text_documents

    documents = load_text_documents(args.text_file) if args.text_file else None
    model, tokenizer = load_model_and_tokenizer(args.model)
    language = GeneratedLanguage.from_folder(args.model)  # None unless it was trained on a generated language
    if language is not None and documents is not None:
        raise ValueError(f"{args.model} was trained on generated:{language.name}; it is evaluated on that language's "
                         f"own texts, not on --text-file")
    result = evaluate_model(model, tokenizer, args.split, args.num_positions, context_len, args.batch_size,
                            args.seed, mauve=args.mauve, progress=True, language=language, documents=documents)
    result["model"] = args.model
    print(json.dumps(result, indent=1))
    if language is not None:
        print(f"against the optimum of generated:{language.name}: {optimum_headline(result['optimum'])}")
    return 0


def cmd_lm_eval(args) -> int:
    from .eval.lm_eval import main as lm_eval_main

    return lm_eval_main(args.lm_eval_args)


def cmd_bench(args) -> int:
    from .eval.arguments import named_models, parse_sweeps

    models = named_models(args.model)
    baseline = args.baseline or next(iter(models))
    sweeps = parse_sweeps(args.sweep, models)  # before the long run, not after it
    get_preset(args.train_preset)
    if baseline not in models:
        raise ValueError(f"--baseline {baseline!r} is none of the models {sorted(models)}")
    check_bench_baseline(baseline, models[baseline])
    check_at_least_one(args, "num_positions", "context_len", "max_new_tokens", "repeats")
    context_len = resolve_context_len(args.context_len, model_configs(models))
    from .eval.bench import bench_extras, benchmark_models, write_report  # torch: after every argument check

    report = benchmark_models(models, baseline, args.num_positions, context_len,
                              max_new_tokens=args.max_new_tokens, repeats=args.repeats, mauve=args.mauve,
                              seed=args.seed)
    if args.extras or sweeps or args.train_steps or args.profile or args.compile:
        report["extras"] = bench_extras(models, baseline, sweeps, args.extras, args.train_steps, args.train_preset,
                                        args.profile, args.sweep_positions, args.max_new_tokens, args.repeats,
                                        args.seed, compiled=args.compile)
    print(write_report(report, args.output, args.markdown))
    return 0


def check_bench_baseline(name: str, folder: str) -> None:
    """ValueError unless `bench`'s baseline is an autoregressive model: its table divides every model by it
    ("speed×AR"), so a latent model alone would print 1.00 against itself (the same refusal as `report`'s)."""
    from .families import BASELINE_FAMILY, family_of_model_type
    from .folders import check_model_folder

    model_type = check_model_folder(folder, f"--model {name}={folder}")["model_type"]
    spec = family_of_model_type(model_type)  # None: a model from outside the registry, e.g. the Llama baseline
    if spec is not None and spec.name != BASELINE_FAMILY:
        raise ValueError(f"bench divides every model by the AR baseline, and its baseline {name!r} is a {spec.name} "
                         f"model: add --model {BASELINE_FAMILY}=DIR (a model of `train --family {BASELINE_FAMILY}`) "
                         f"and --baseline {BASELINE_FAMILY}")


def cmd_report(args) -> int:
    import shlex

    from .eval.arguments import named_models

    models = named_models(args.model)
    check_at_least_one(args, "num_positions", "max_new_tokens", "repeats", "context_len")
    if not args.no_mauve and args.mauve_samples < 10:
        raise ValueError(f"--mauve-samples must be at least 10 (MAUVE's minimum), got {args.mauve_samples}")
    args.context_len = resolve_context_len(args.context_len, model_configs(models))
    from .eval.report import build_report, write_report  # torch: after every argument check
    # The command as run, every option spelled out, so that report.md says exactly how to rerun it.
    options = [*(("--model", m) for m in args.model), ("--output", args.output),
               ("--num-positions", args.num_positions), ("--context-len", args.context_len),
               ("--max-new-tokens", args.max_new_tokens), ("--repeats", args.repeats),
               ("--no-mauve",) if args.no_mauve else ("--mauve-samples", args.mauve_samples), ("--seed", args.seed)]
    command = shlex.join(["hf-latentlm", "report", *(str(part) for option in options for part in option)])
    report = build_report(models, args.num_positions, args.context_len, args.max_new_tokens, args.repeats,
                          mauve=not args.no_mauve, mauve_samples=args.mauve_samples, seed=args.seed, command=command)
    paths = write_report(report, args.output)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def cmd_post_train(args) -> int:
    """`sft`, `dpo` and `grpo`: TRL's stock trainers for the AR baseline, the hf_latentlm subclasses for the other
    families."""
    from .folders import POST_TRAINING_RECORD, check_model_folder
    from .training.config import parse_report_to
    from .training.tasks import TASKS

    options = {f.name: getattr(args, f.name) for f in fields(POST_TRAINING[args.command][0])}
    check_at_least_one(args, "max_steps", "batch_size", "train_size", "save_every", "num_generations",
                       "num_score_draws")
    if args.learning_rate is not None and args.learning_rate <= 0:
        raise ValueError(f"--learning-rate must be positive, got {args.learning_rate}")
    if args.task is not None and args.task not in TASKS:
        raise ValueError(f"unknown task {args.task!r}; known tasks: {', '.join(TASKS)}")
    options["report_to"] = parse_report_to(args.report_to)  # before the model folder is read
    if args.command == "grpo":
        if args.num_generations < 2 or args.batch_size % args.num_generations:
            raise ValueError(f"--num-generations must be at least 2 (advantages compare completions of one prompt) "
                             f"and divide --batch-size; got {args.num_generations} and {args.batch_size}")
        if args.beta < 0:
            raise ValueError(f"--beta must be >= 0, got {args.beta}")
    if args.command == "sft":
        check_sft_start(args)
    if args.model is not None:
        check_model_folder(args.model, f"model folder {args.model!r}")
    if args.command in ("dpo", "grpo") and not (Path(args.model) / POST_TRAINING_RECORD).is_file():
        # `sft` writes that record; DPO's reference is the model itself, so a model that never learnt the task's
        # answer format gives the preference loss little to work with. Allowed (a model may be tuned elsewhere).
        print(f"hf-latentlm {args.command}: warning: {args.model} was not fine-tuned by `hf-latentlm sft` (no "
              f"{POST_TRAINING_RECORD}); {args.command.upper()} is meant to start from an SFT model", file=sys.stderr)
    from . import recipes  # torch: after every argument check

    run = getattr(recipes, f"run_{args.command}")
    summary = run(options.pop("model"), options.pop("output_dir"), **options)
    if not summary.get("losses"):  # a run shorter than the Trainer's logging period logs none: no empty list
        summary.pop("losses", None)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}))
    return 0


def check_sft_start(args) -> None:
    """`sft` starts from exactly one of --model and --init-from; the --init-from options are checked here."""
    if (args.model is None) == (args.init_from is None):
        raise ValueError("give exactly one of --model (a trained model folder) and --init-from (a causal LM to "
                         "start a --family model from)")
    if args.init_from is None:
        if args.encoder_kl_weight:
            raise ValueError("--encoder-kl-weight needs --init-from (the frozen source the KL is taken to)")
        if args.family is not None or args.preset is not None:
            raise ValueError("--family and --preset need --init-from (a --model folder has its own)")
        return
    check_init_from(args.family or "plm")
    get_preset(args.preset or "small")
    if not args.encoder_kl_weight >= 0:
        raise ValueError(f"--encoder-kl-weight must be >= 0, got {args.encoder_kl_weight}")
    if args.lora:
        raise ValueError("--init-from trains every weight of the new model; --lora applies to --model only")


def cmd_convert(args) -> int:
    from .official.convert import convert_calm, convert_cola

    if args.official_family == "calm":
        folder, notes = convert_calm(args.model, args.output_dir, args.autoencoder, args.tokenizer,
                                     args.overwrite_output_dir)
    else:
        folder, notes = convert_cola(args.vae, args.dit, args.output_dir, args.tokenizer, args.overwrite_output_dir)
    for note in notes:
        print(f"note: {note}")
    print(f"converted to {folder}; next:\n  hf-latentlm generate --model {folder} --prompt ..."
          + ("" if args.tokenizer else " (no tokenizer: convert again with --tokenizer to generate from text)"))
    return 0


def cmd_push(args) -> int:
    from .hub import push_model

    print(push_model(args.model, args.repo_id, private=args.private, revision=args.revision, license=args.license,
                     eval_file=args.eval_results, baseline_file=args.baseline_eval, base_model=args.base_model,
                     datasets=args.dataset))
    return 0


def check_port_free(host: str, port: int) -> None:
    """ValueError naming the address when nothing could listen on it (taken, or not this machine's)."""
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as err:
        raise ValueError(f"cannot listen on {host}:{port} ({err.strerror or err}): is another server using it? "
                         f"choose another --port") from None


def cmd_serve(args) -> int:
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"hf-latentlm serve needs {' and '.join(missing)}: pip install 'hf-latentlm[serve]'")
    if args.max_batch_size < 1 or args.max_queue < 1:
        raise ValueError(f"--max-batch-size and --max-queue must be at least 1, got {args.max_batch_size} and "
                         f"{args.max_queue}")
    if args.batch_wait_ms < 0:
        raise ValueError(f"--batch-wait-ms must be >= 0, got {args.batch_wait_ms}")
    from .serving import model_names

    models = model_names(args.model)
    model_configs(models)  # a bad folder is refused before torch loads
    check_port_free(args.host, args.port)  # before the models load, not after
    from .serving.app import serve

    serve(models, host=args.host, port=args.port, max_batch_size=args.max_batch_size, max_queue=args.max_queue,
          batch_wait=args.batch_wait_ms / 1000, seed=args.seed, device=args.device, log_level=args.log_level)
    return 0


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "eval": cmd_eval, "bench": cmd_bench,
            "sft": cmd_post_train, "dpo": cmd_post_train, "grpo": cmd_post_train, "push": cmd_push, "report": cmd_report,
            "serve": cmd_serve, "lm-eval": cmd_lm_eval, "convert": cmd_convert}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        from datasets.utils.logging import disable_progress_bar
        from transformers.utils import logging as hf_logging

        # The CLI shows its own progress; per-map and weight-loading bars are noise here.
        disable_progress_bar()
        hf_logging.disable_progress_bar()
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, ImportError) as err:
        # One line, whatever the message: transformers' own messages span several.
        print(f"hf-latentlm {args.command}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: where the run stands, not a traceback; 130 is the shell's code for SIGINT
        if int(os.environ.get("RANK", "0")) == 0:  # every rank of a launch gets the signal; one line is enough
            print(f"\nhf-latentlm {args.command}: interrupted{resume_hint(args)}", file=sys.stderr)
        return 130
    finally:
        end_process_group()


def resume_hint(args) -> str:
    """For a command that writes resumable checkpoints: where the last complete one is and the flag that resumes."""
    if args.command not in ("train", "sft", "dpo", "grpo"):
        return ""
    from .training.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(args.output_dir)
    if checkpoint is None:
        return f"; no checkpoint in {args.output_dir} yet, so nothing to resume: rerun the command to start over"
    how = "the same command (it has --resume)" if args.resume else "the same command plus --resume"
    return f"; the last complete checkpoint is {checkpoint}: continue from it with {how}"


def end_process_group() -> None:
    """Destroy the process group a multi-process command joined (Accelerate's `end_training` step), after a barrier.
    Left to the interpreter's exit, or destroyed while another rank still talks to it, gloo's threads can be torn down
    while still joinable, and a rank then aborts (SIGABRT, "terminate called without an active exception") after its
    work is done."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.barrier()
        distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
