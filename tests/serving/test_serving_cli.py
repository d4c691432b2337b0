"""`hf-latentlm serve` refuses what it cannot run with one line: the missing `[serve]` extra, bad arguments and
folders, before anything heavy is imported."""

import importlib.util

import pytest

from hf_latentlm.serving import model_names


def test_without_the_serve_extra_the_error_names_the_install_command(run_cli, monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvicorn" else real_find_spec(name, *a))
    code, _, err = run_cli("serve", "--model", str(tmp_path))
    assert code == 2 and err.count("\n") == 1
    assert "needs uvicorn" in err and "pip install 'hf-latentlm[serve]'" in err


@pytest.mark.parametrize("argv, message", [
    (["--max-batch-size", "0"], "--max-batch-size and --max-queue must be at least 1"),
    (["--batch-wait-ms", "-1"], "--batch-wait-ms must be >= 0"),
    ([], "does not exist"),
])
def test_bad_arguments_and_folders_are_one_line_errors(run_cli, tmp_path, argv, message):
    code, _, err = run_cli("serve", "--model", f"m={tmp_path / 'missing'}", *argv)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_models_are_named_by_folder_or_by_name(tmp_path):
    assert model_names([str(tmp_path / "ar-x1"), "plm=runs/plm"]) == {"ar-x1": str(tmp_path / "ar-x1"),
                                                                       "plm": "runs/plm"}
    with pytest.raises(ValueError, match="given twice"):
        model_names(["a=x", "a=y"])
    with pytest.raises(ValueError, match="DIR or NAME=DIR"):
        model_names(["=x"])


def test_a_port_in_use_is_refused_before_any_model_loads(run_cli, tmp_path, tokenizer, monkeypatch):
    import socket

    from hf_latentlm import loading
    from hf_latentlm.families import build_model
    from hf_latentlm.training.checkpoint import save_tokenizer

    folder = tmp_path / "ar"
    build_model("ar", "tiny", tokenizer).save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    loads = []
    monkeypatch.setattr(loading, "load_model_and_tokenizer", lambda *a, **k: loads.append(a) or 1 / 0)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, _, err = run_cli("serve", "--model", str(folder), "--port", str(port))
    assert code == 2 and err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in err, err
    assert "choose another --port" in err and loads == []
