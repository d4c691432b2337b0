"""The package's tools on a converted official CALM and Cola DLM (the vocab-4096 official-format fixtures):
transformers' pipeline, training steps of the loop, `hf-latentlm sft --lora`, and `push` to the loopback Hub.
lm-eval and the server run them next to the families (tests/eval/test_lm_eval.py, tests/serving/test_serving_app.py);
batched left-padded generate() and the streamer are in the family contract (test_calm_official.py,
test_cola_official.py)."""

import json
import math

import pytest
import torch
from fake_hub import fake_hub, hub_env  # noqa: F401  (fake_hub is a fixture)
from official_checkpoints import convert_calm_fixture, convert_cola_fixture

from hf_latentlm.modeling.modeling_calm import CALMForCausalLM
from hf_latentlm.modeling.modeling_cola import ColaForCausalLM
from hf_latentlm.training.config import TrainConfig
from hf_latentlm.training.loop import train


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return convert_calm_fixture(tmp_path_factory.mktemp("converted") / "calm-official")


# Each generation config carries the official sampling defaults: CALM T = 1/2; Cola DLM greedy read-out, guidance 7,
# 16 steps a block, repetition penalty 1.1. The pipeline must use them; the changed setting shows that it matters.
PIPELINE_CASES = {
    "calm": (CALMForCausalLM, {"do_sample": True, "temperature": 0.5}, {"temperature": 1.0}),
    "cola": (ColaForCausalLM, {"temperature": 0.0, "guidance_scale": 7.0, "num_inference_steps": 16,
                               "repetition_penalty": 1.1}, {"guidance_scale": 1.0}),
}


@pytest.mark.parametrize("family", sorted(PIPELINE_CASES))
def test_pipeline_generates_what_generate_does_with_the_official_defaults(family, request, tokenizer):
    from transformers import pipeline

    folder = request.getfixturevalue({"calm": "converted", "cola": "converted_cola"}[family])
    model_class, official, changed = PIPELINE_CASES[family]
    generator = pipeline("text-generation", model=str(folder), trust_remote_code=True)
    text = generator("ROMEO.\nWhat light", max_new_tokens=8, noise_seeds=[5], return_full_text=False)[0]
    model = model_class.from_pretrained(folder)
    model.generation_config = type(model.generation_config)()  # the call's options only
    ids = tokenizer("ROMEO.\nWhat light", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, noise_seeds=[5], **official)
    assert text["generated_text"] == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    other = model.generate(ids, max_new_tokens=8, noise_seeds=[5], **{**official, **changed})
    assert not torch.equal(out, other)


def test_training_steps_move_the_official_form_and_keep_its_autoencoder(converted, tokenizer, tiny_rows, tmp_path):
    model = CALMForCausalLM.from_pretrained(converted)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = TrainConfig(family="calm", preset="tiny", output_dir=str(tmp_path / "run"), max_steps=2, batch_size=4,
                      seq_len=32, eval_every=0, save_every=2, log_every=1, progress_bar=False)
    metrics = train(cfg, model=model, tokenizer=tokenizer, train_rows=tiny_rows[:16, :32], val_rows=tiny_rows[16:20, :32])
    assert math.isfinite(metrics["loss"])
    trained = CALMForCausalLM.from_pretrained(tmp_path / "run")
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["input_norm"], config["energy_head_type"]) == ("layer", "reference")  # the official form stays
    moved = {n for n, p in trained.named_parameters() if not torch.equal(p, before[n])}
    assert any(n.startswith("model.layers.") for n in moved) and any(n.startswith("energy_head.") for n in moved)
    assert "model.compress_norm.bias" in moved  # the official LayerNorm's bias trains too
    assert not any(n.startswith("autoencoder.") for n in moved)  # frozen


def test_sft_with_lora_runs_on_the_converted_model(converted, run_cli, tmp_path):
    code, out, err = run_cli("sft", "--model", str(converted), "--output-dir", str(tmp_path / "sft"), "--lora",
                             "--max-steps", "2", "--batch-size", "4", "--train-size", "16")
    assert code == 0, err
    tuned = CALMForCausalLM.from_pretrained(tmp_path / "sft")
    base = CALMForCausalLM.from_pretrained(converted)
    changed = [n for n, p in tuned.named_parameters() if not torch.equal(p, base.state_dict()[n])]
    assert changed and all(n.startswith("model.layers.") for n in changed), changed  # LoRA merged into the backbone
    assert json.loads((tmp_path / "sft" / "post_training.json").read_text())["lora"] is True


@pytest.mark.parametrize("family,license,source", [("calm", "mit", "shaochenze/calm"),
                                                    ("cola", "apache-2.0", "ByteDance-Seed/Cola-DLM")])
def test_push_names_the_official_source_and_its_license(family, license, source, request, tmp_path, fake_hub):
    import subprocess
    import sys

    folder = request.getfixturevalue({"calm": "converted", "cola": "converted_cola"}[family])
    endpoint, hub = fake_hub
    push = "import sys; from hf_latentlm.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", push, "push", "--model", str(folder), "--repo-id",
                           f"someone/{family}-official"], env=hub_env(endpoint, tmp_path / "home"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    files = hub.repos[f"someone/{family}-official"]["main"]
    assert files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert "conversion.json" not in files and "tokenizer.json" in files
    card = files["README.md"].decode()
    assert f"license: {license}" in card and source in card and "hf-latentlm convert" in card
    assert "trained on a small corpus" not in card  # the CPU-scale caveat is for models trained here


# The same tools on a converted official Cola DLM (the vocab-4096 official-format fixture).
@pytest.fixture(scope="module")
def converted_cola(tmp_path_factory):
    return convert_cola_fixture(tmp_path_factory.mktemp("converted") / "cola-official")


def test_sft_with_lora_runs_on_the_converted_cola(converted_cola, run_cli, tmp_path):
    code, out, err = run_cli("sft", "--model", str(converted_cola), "--output-dir", str(tmp_path / "sft"), "--lora",
                             "--max-steps", "2", "--batch-size", "4", "--train-size", "16")
    assert code == 0, err
    tuned = ColaForCausalLM.from_pretrained(tmp_path / "sft")
    base = ColaForCausalLM.from_pretrained(converted_cola).state_dict()
    changed = [n for n, p in tuned.named_parameters() if not torch.equal(p, base[n])]
    assert changed and not any(".vae." in n or n.startswith("vae.") for n in changed), changed
