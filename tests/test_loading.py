"""`load_model_and_tokenizer` on damaged model folders: one line on stderr and exit 2 from the CLI."""

import json
import shutil

import pytest
import torch

from hf_latentlm.families import build_model
from hf_latentlm.folders import check_model_folder
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.training.checkpoint import save_tokenizer


@pytest.fixture(scope="module")
def saved_plm(tmp_path_factory, tokenizer):
    """An untrained tiny PLM saved the way training saves it (model + tokenizer)."""
    folder = tmp_path_factory.mktemp("loading") / "plm"
    torch.manual_seed(0)
    build_model("plm", "tiny", tokenizer).save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return folder


def truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep(len(data))])


def damage_config(folder):
    (folder / "config.json").write_text('{"model_type": "plm", "hidden_size": ')


def config_without_model_type(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "model_type"}))


def remove_weights(folder):
    (folder / "model.safetensors").unlink()


def truncate_weights(folder):
    truncate(folder / "model.safetensors", lambda n: n // 2)


def truncate_weights_header(folder):
    truncate(folder / "model.safetensors", lambda n: 20)


def damage_tokenizer_json(folder):
    truncate(folder / "tokenizer.json", lambda n: n // 3)


def tokenizer_json_of_no_known_model(folder):
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "Telepathy"}}))


def config_of_a_model_type_not_loaded_here(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))


def damage_tokenizer_config(folder):
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "TokenizersBack')


DAMAGES = [
    (damage_config, "config.json is not valid JSON"),
    (config_without_model_type, "config.json has no model_type"),
    (config_of_a_model_type_not_loaded_here, "holds a 'bert' model, which hf-latentlm does not load; it loads llama, plm"),
    (remove_weights, "has no weights (model.safetensors)"),
    (truncate_weights, "model.safetensors is damaged or truncated"),
    (truncate_weights_header, "model.safetensors is damaged or truncated"),
    (damage_tokenizer_json, "tokenizer.json is not valid JSON"),
    (tokenizer_json_of_no_known_model, "tokenizer.json is not a valid tokenizer"),
    (damage_tokenizer_config, "tokenizer_config.json is not valid JSON"),
]


@pytest.mark.parametrize("damage,needle", DAMAGES, ids=[d.__name__ for d, _ in DAMAGES])
@pytest.mark.parametrize("command", ["generate", "eval"])
def test_damaged_model_folder_is_one_line_and_exit_2(saved_plm, tmp_path, run_cli, damage, needle, command):
    folder = tmp_path / "model"
    shutil.copytree(saved_plm, folder)
    damage(folder)
    extra = ["--prompt", "HAMLET."] if command == "generate" else ["--num-positions", "8"]
    code, out, err = run_cli(command, "--model", str(folder), *extra)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"hf-latentlm {command}: error: model folder {str(folder)!r}") and needle in err, err


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_the_weights_file_instead_of_its_folder_is_one_line_naming_the_folder(saved_plm, run_cli, command):
    weights = saved_plm / "model.safetensors"
    extra = ["--prompt", "HAMLET."] if command == "generate" else ["--num-positions", "8"]
    code, out, err = run_cli(command, "--model", str(weights), *extra)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"is a file, not a model folder: pass the folder that holds it ({saved_plm})" in err


def test_intact_and_sharded_folders_still_load(saved_plm, tmp_path, run_cli, tokenizer):
    code, out, _ = run_cli("generate", "--model", str(saved_plm), "--prompt", "HAMLET.", "--max-new-tokens", "3")
    assert code == 0 and out.startswith("HAMLET.")

    sharded = tmp_path / "sharded"
    model, _ = load_model_and_tokenizer(str(saved_plm))
    model.save_pretrained(sharded, max_shard_size="500KB")
    save_tokenizer(tokenizer, sharded)
    assert not (sharded / "model.safetensors").exists() and len(list(sharded.glob("model-*.safetensors"))) > 1
    again, _ = load_model_and_tokenizer(str(sharded))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))

    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    truncate(shard, lambda n: n - 10)
    with pytest.raises(ValueError, match=f"{shard.name} is damaged or truncated"):
        check_model_folder(sharded)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"names missing shards \\['{shard.name}'\\]"):
        check_model_folder(sharded)
