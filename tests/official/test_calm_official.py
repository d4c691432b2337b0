"""Official CALM checkpoints (shaochenze/calm) converted by `hf-latentlm convert calm`: the official code's outputs
reproduced within 1e-5, bad checkpoints refused by name (the family contract: test_converted_contract.py).

The fixtures under tests/fixtures/official/ were written by the official code (scripts/checks/
official_reference_calm.py in an environment with transformers 4.43; `calm/` is ../shared/reference/calm): perturbed
weights, so a wrong mapping of any tensor shows."""

import inspect
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import official_checkpoints
from hf_latentlm.modeling.configuration_calm import CALMConfig
from hf_latentlm.modeling.modeling_calm import CALMForCausalLM, ReplayedDraws
from hf_latentlm.official.calm import calm_from_official, calm_parity, official_calm_config
from hf_latentlm.official.convert import read_official_weights

FIXTURES = Path(__file__).parents[1] / "fixtures" / "official"
# The fixture -> what its reference holds beyond the shared reference's keys.
CASES = {"calm": [], "calm_tools": ["energy_loss", "generate_t05_tokens", "generate_t1_tokens"],
         "calm_heldout": ["energy_loss", "generate_t05_tokens", "generate_t1_tokens"]}
SHARED = ["ae_mean", "ae_log_std", "ae_logits", "calm_hidden", "head_samples"]


def official(name: str):
    folder = FIXTURES / name
    config = json.loads((folder / "calm" / "config.json").read_text())
    state = read_official_weights(folder / "calm", "--model")
    return config, state


def convert(run_cli, name: str, output: Path, *extra: str) -> Path:
    argv = ["convert", "calm", "--model", str(FIXTURES / name / "calm"), "--output-dir", str(output), *extra]
    if (FIXTURES / name / "autoencoder").is_dir():
        argv += ["--autoencoder", str(FIXTURES / name / "autoencoder")]
    code, out, err = run_cli(*argv)
    assert code == 0, err
    assert "ignored ae_path" in out and f"converted to {output}" in out
    return output


@pytest.mark.parametrize("name", sorted(CASES))
def test_converted_checkpoint_reproduces_the_official_outputs(tmp_path, run_cli, name):
    folder = convert(run_cli, name, tmp_path / "converted")
    code, diffs, err = official_checkpoints.run_parity("calm", folder,
                                                       FIXTURES / name / "reference_outputs.safetensors")
    assert code == 0, err
    assert sorted(diffs) == sorted(SHARED + CASES[name])
    assert all(diff <= 1e-5 for diff in diffs.values()), diffs


def test_parity_check_fails_on_a_wrong_tensor(tmp_path, run_cli):
    folder = convert(run_cli, "calm_heldout", tmp_path / "converted")
    model = CALMForCausalLM.from_pretrained(folder)
    with torch.no_grad():  # two energy-head blocks swapped: same shapes, different function
        first, second = model.energy_head.blocks[0], model.energy_head.blocks[1]
        first.fuse.weight, second.fuse.weight = second.fuse.weight, first.fuse.weight
    model.save_pretrained(tmp_path / "wrong")
    code, diffs, err = official_checkpoints.run_parity(
        "calm", tmp_path / "wrong", FIXTURES / "calm_heldout" / "reference_outputs.safetensors")
    assert code == 1 and "head_samples" in err
    assert diffs["head_samples"] > 1e-5 and diffs["ae_mean"] == 0


def test_generate_parity_depends_on_the_replayed_draws():
    """The token comparison is not vacuous: the same draws given to other rows change the tokens."""
    model, _ = calm_from_official(*official("calm_tools"))
    reference = load_file(FIXTURES / "calm_tools" / "reference_outputs.safetensors")
    assert calm_parity(model, reference)["generate_t1_tokens"] == 0
    rolled = {k: (v.roll(1, dims=0) if k.startswith("generate_t1_draw_") else v) for k, v in reference.items()}
    assert calm_parity(model, rolled)["generate_t1_tokens"] > 0


def test_replayed_draws_refuse_to_run_out_or_change_shape():
    draws = ReplayedDraws([torch.rand(2, 1, 3)])
    with pytest.raises(ValueError, match=r"shape \(2, 1, 3\); decoding asked for rows \[0, 1\] of shape \(5, 3\)"):
        draws.uniform([0, 1], (5, 3))
    draws.draws.append(torch.rand(2, 1, 3))
    assert draws.uniform([1], (1, 3)).shape == (1, 1, 3)
    with pytest.raises(ValueError, match="ran out of recorded draws"):
        draws.uniform([0], (1, 3))


def test_converted_folder_is_an_ordinary_model_folder(tmp_path, run_cli, tokenizer):
    folder = convert(run_cli, "calm_tools", tmp_path / "converted", "--tokenizer",
                     str(Path(inspect.getfile(CALMConfig)).parents[1] / "data" / "tokenizer"))
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_calm.CALMForCausalLM"
    assert (config["energy_head_type"], config["input_norm"], config["layer_norm_eps"]) == ("reference", "layer", 1e-6)
    assert config["autoencoder_config"]["projection_bias"] and config["autoencoder_config"]["log_std_min"] is None
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["do_sample"], generation["temperature"]) == (True, 0.5)  # the official generate()'s default
    card = (folder / "README.md").read_text()
    assert "license: mit" in card and "shaochenze/calm" in card and "1e-5" in card
    assert not list(folder.glob("*.bin")) and (folder / "model.safetensors").is_file()
    assert (folder / "tokenizer.json").is_file()


def test_converted_folder_without_tokenizer_says_so(tmp_path, run_cli):
    folder = convert(run_cli, "calm", tmp_path / "converted")
    assert "No tokenizer was given" in (folder / "README.md").read_text()


def test_converted_model_loads_without_the_package(tmp_path, run_cli, isolated_generate):
    folder = convert(run_cli, "calm_tools", tmp_path / "converted")
    prompt = [[5, 6, 7, 8, 9, 10, 11, 12]]
    options = {"noise_seeds": [3], "temperature": 1.0}
    isolated = isolated_generate(folder, "AutoModelForCausalLM", prompt, 8, options, tmp_path / "home")
    local = CALMForCausalLM.from_pretrained(folder).generate(torch.tensor(prompt), max_new_tokens=8, **options)
    assert isolated["tokens"] == local[0, 8:].tolist()


# ---------------------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------------------

def edited(edit):
    config, state = official("calm")
    edit(config, state)
    return config, state


@pytest.mark.parametrize("edit,message", [
    (lambda c, s: [s.pop(k) for k in ("mlp_generator.final_layer.linears.2.bias",
                                       "generative_head.final_layer.linears.2.bias")],
     r"missing tensor\(s\) \['energy_head.out.bias'\]"),
    (lambda c, s: s.update({"transformer.extra.weight": torch.zeros(2)}),
     r"unexpected tensor transformer.extra.weight \(2,\)"),
    (lambda c, s: s.update({"transformer.norm.weight": torch.ones(31)}),
     r"tensor for model.norm.weight has shape \(31,\), the config gives \(32,\)"),
    (lambda c, s: s.update({"generative_head.noise_embd.bias": torch.zeros(32)}),
     r"generative_head.noise_embd.bias should be the same tensor as mlp_generator.noise_embd.bias"),
    (lambda c, s: c.update(beta=1.5), r"the official CALM config.beta = 1.5 is not supported"),
    (lambda c, s: c.update(attention_bias=True), r"the official CALM config.attention_bias = True is not supported"),
    (lambda c, s: c.update(patch_size=2), r"the official CALM config.patch_size = 2 disagrees with its autoencoder"),
    (lambda c, s: [s.pop(k) for k in [k for k in s if k.startswith("ae_model.")]],
     r"holds no ae_model.\* tensors: pass the official autoencoder too \(--autoencoder\)"),
])
def test_bad_official_checkpoint_is_refused_by_name(edit, message):
    with pytest.raises(ValueError, match=message):
        calm_from_official(*edited(edit))


def test_odd_autoencoder_layer_count_is_refused():
    config, state = official("calm_heldout")
    ae_config = json.loads((FIXTURES / "calm_heldout" / "autoencoder" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"num_encoder_layers = 3 is odd: the official code runs"):
        calm_from_official(config, state, {**ae_config, "num_encoder_layers": 3})


def test_autoencoder_inside_and_given_must_agree():
    config, state = official("calm_heldout")
    ae_config = json.loads((FIXTURES / "calm_heldout" / "autoencoder" / "config.json").read_text())
    ae_state = read_official_weights(FIXTURES / "calm_heldout" / "autoencoder", "--autoencoder")
    ae_state["encoder.norm.weight"] = ae_state["encoder.norm.weight"] + 1
    with pytest.raises(ValueError, match=r"ae_model.encoder.norm.weight differs from the given autoencoder's"):
        calm_from_official(config, state, ae_config, ae_state)


def test_bin_file_holding_more_than_tensors_is_refused(tmp_path, run_cli):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text((FIXTURES / "calm" / "calm" / "config.json").read_text())
    torch.save({"weight": torch.zeros(2), "step": Path("x")}, tmp_path / "src" / "pytorch_model.bin")
    code, _, err = run_cli("convert", "calm", "--model", str(tmp_path / "src"), "--output-dir", str(tmp_path / "out"))
    assert code == 2 and "holds more than tensors" in err and "only weights are read from a .bin file" in err


@pytest.mark.parametrize("case,needle", [
    ("offline hub id", "could not fetch --model someone/CALM-M from the Hub"),
    ("missing folder", "./no/such/folder: no such folder"),
    ("not empty", "is not empty; pass --overwrite-output-dir to replace it"),
    ("wrong tokenizer", "has 4096 tokens, more than the model's vocabulary (67)"),
])
def test_convert_refuses_with_one_line(tmp_path, run_cli, monkeypatch, case, needle):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    model = {"offline hub id": "someone/CALM-M", "missing folder": "./no/such/folder"}.get(
        case, str(FIXTURES / "calm" / "calm"))
    output = tmp_path / "out"
    extra = []
    if case == "not empty":
        output.mkdir()
        (output / "keep.txt").write_text("x")
    if case == "wrong tokenizer":
        extra = ["--tokenizer", str(Path(inspect.getfile(CALMConfig)).parents[1] / "data" / "tokenizer")]
    code, _, err = run_cli("convert", "calm", "--model", model, "--output-dir", str(output), *extra)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    if case == "not empty":
        assert (output / "keep.txt").is_file()


def test_calm_m_at_its_official_size_has_the_official_parameter_counts():
    # The official code's counts for CALM-M (README: 371M) and its autoencoder (75M), built on the meta device.
    with torch.device("meta"):
        model = CALMForCausalLM(official_calm_config("calm-m"))
    autoencoder = sum(p.numel() for p in model.autoencoder.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert (total - autoencoder, autoencoder) == (371_731_584, 75_831_552)
    assert model.config.vocab_size == 128256 and model.config.chunk_size == 4


def test_unknown_official_calm_size_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown official CALM size 'calm-xxl'.*\['calm-m'\]"):
        official_calm_config("calm-xxl")
