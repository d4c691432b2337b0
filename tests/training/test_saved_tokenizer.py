"""Folders written by training name a tokenizer class transformers has itself, so `AutoTokenizer` loads
them without remote code for the tokenizer and without an interactive [y/N] prompt."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_latentlm.training.checkpoint import latest_checkpoint, save_tokenizer
from hf_latentlm.training.corpus import default_tokenizer_path, load_corpus_documents
from hf_latentlm.training.loop import TrainConfig, train

PASSAGE = "HAMLET.\nTo be, or not to be, that is the question:\n\u2014Zo\u00eb, \u65e5\u672c\t  end<|endoftext|>"

# Loads each folder's tokenizer in one fresh process and prints, per folder, its class's module and the ids
# of PASSAGE. "package": hf_latentlm's model classes are registered, so config.json needs no remote code and
# every remote-code decision is the tokenizer's own; "readme": the README's form, without the package imported.
LOADERS = {
    "package": "import hf_latentlm.modeling\n"
               "from transformers import AutoTokenizer\n"
               "load = lambda folder: AutoTokenizer.from_pretrained(folder)\n",
    "readme": "from transformers import AutoTokenizer\n"
              "load = lambda folder: AutoTokenizer.from_pretrained(folder, trust_remote_code=True)\n",
}


def load_in_fresh_process(folders, loader: str, home) -> list[dict]:
    """[{"module", "ids"}] of each folder's tokenizer loaded by LOADERS[loader], with stdin closed: a [y/N]
    prompt would read EOF and fail, and its text would show in the output."""
    code = ("import json, sys\n" + LOADERS[loader] +
            "for folder in sys.argv[2:]:\n"
            "    tok = load(folder)\n"
            "    print(json.dumps({'module': type(tok).__module__, 'ids': tok(sys.argv[1])['input_ids']}))\n")
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code, PASSAGE, *map(str, folders)], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=env, timeout=300)
    assert "[y/N]" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(folders):]]


def assert_resolves_without_remote_code(folders, tokenizer, home):
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    for folder in folders:
        config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
        assert "auto_map" not in config
        assert tokenizer_class_from_name(config["tokenizer_class"]).__module__.startswith("transformers.")
    for loader in LOADERS:
        for loaded in load_in_fresh_process(folders, loader, home):
            assert loaded["module"].startswith("transformers."), (loader, loaded["module"])
            assert loaded["ids"] == tokenizer(PASSAGE)["input_ids"], loader


CUSTOM_TOKENIZERS = '''
from transformers import TokenizersBackend


class ShakespeareTokenizer(TokenizersBackend):
    """A custom class that changes nothing: tokenizer.json holds its whole pipeline."""


class ShoutingTokenizer(TokenizersBackend):
    """A custom class whose own code changes the tokenization."""

    def __call__(self, text, *args, **kwargs):
        return super().__call__(text.upper() if isinstance(text, str) else text, *args, **kwargs)
'''


def train_tiny_plm(output_dir, tokenizer, rows):
    cfg = TrainConfig(family="plm", preset="tiny", output_dir=str(output_dir), max_steps=2, batch_size=2,
                      seq_len=64, eval_every=0, save_every=1, keep_checkpoints=0, log_every=1, progress_bar=False)
    train(cfg, tokenizer=tokenizer, train_rows=rows[:32])
    return [Path(output_dir), latest_checkpoint(output_dir)]


@pytest.fixture
def custom_tokenizers(tmp_path, monkeypatch):
    """A module of custom tokenizer classes, importable under a name unique to this test."""
    name = f"tokenization_custom_{tmp_path.name.replace('-', '_')}"
    code = tmp_path / "code"
    code.mkdir()
    (code / f"{name}.py").write_text(CUSTOM_TOKENIZERS)
    monkeypatch.syspath_prepend(str(code))
    yield importlib.import_module(name)
    sys.modules.pop(name, None)


def test_embedded_tokenizer_saved_by_training_loads_without_prompt(tmp_path, tokenizer, tiny_rows):
    folders = train_tiny_plm(tmp_path / "run", tokenizer, tiny_rows)
    for folder in folders:
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert_resolves_without_remote_code(folders, tokenizer, tmp_path / "hf")


def test_custom_class_tokenizer_saved_by_training_resolves_to_its_transformers_base(tmp_path, tiny_rows,
                                                                                     custom_tokenizers):
    # A tokenizer whose class came with remote code (here: defined outside transformers, registered for the Auto
    # classes, as a Hub repository's tokenization file is): saved as is, AutoTokenizer asks [y/N].
    cls = custom_tokenizers.ShakespeareTokenizer
    cls.register_for_auto_class()
    custom = cls.from_pretrained(default_tokenizer_path())
    folders = train_tiny_plm(tmp_path / "run", custom, tiny_rows)
    for folder in folders:
        assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    assert_resolves_without_remote_code(folders, custom, tmp_path / "hf")


def test_custom_class_that_changes_tokenization_keeps_its_class(tmp_path, custom_tokenizers):
    cls = custom_tokenizers.ShoutingTokenizer
    cls.register_for_auto_class()
    shouting = cls.from_pretrained(default_tokenizer_path())
    save_tokenizer(shouting, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    # TokenizersBackend would tokenize differently: the folder keeps the class that needs its code.
    assert config["tokenizer_class"] == "ShoutingTokenizer" and "AutoTokenizer" in config["auto_map"]


def write_user_tokenizer(folder: Path, tokenizer_class: str) -> Path:
    """A user's tokenizer folder: the embedded BPE's files under another class name (e.g. a GPT-2 style one)."""
    folder.mkdir()
    source = Path(default_tokenizer_path())
    (folder / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    config = json.loads((source / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, tokenizer_class=tokenizer_class)))
    return folder


def test_users_own_tokenizer_saved_by_cli_training_resolves(tmp_path, run_cli):
    from transformers import AutoTokenizer

    user = write_user_tokenizer(tmp_path / "user-tokenizer", "GPT2Tokenizer")
    text = tmp_path / "plays.txt"
    text.write_text("\n\n".join(load_corpus_documents("test")[:1]))
    out = tmp_path / "run"
    code, _, err = run_cli("train", "--family", "plm", "--preset", "tiny", "--output-dir", str(out), "--tokenizer",
                           str(user), "--train-file", str(text), "--validation-file", str(text), "--max-steps", "1",
                           "--eval-every", "0", "--batch-size", "2", "--no-sample")
    assert code == 0, err
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "GPT2Tokenizer"
    assert_resolves_without_remote_code([out], AutoTokenizer.from_pretrained(str(user)), tmp_path / "hf")


def test_cli_refuses_a_tokenizer_that_needs_remote_code_without_prompt_or_output(tmp_path, run_cli,
                                                                                 custom_tokenizers):
    cls = custom_tokenizers.ShakespeareTokenizer
    cls.register_for_auto_class()
    cls.from_pretrained(default_tokenizer_path()).save_pretrained(tmp_path / "remote-code-tokenizer")
    out = tmp_path / "runs" / "plm"
    code, _, err = run_cli("train", "--family", "plm", "--preset", "tiny", "--output-dir", str(out),
                           "--tokenizer", str(tmp_path / "remote-code-tokenizer"), "--max-steps", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--tokenizer" in err and "trust_remote_code" in err
    assert not out.exists() and not out.parent.exists()


# ---------------------------------------------------------------------------------------------------------------------
# The packaged chat template (issue 31): the post-training format of hf_latentlm.training.tasks
# ---------------------------------------------------------------------------------------------------------------------

CONVERSATIONS = [("Repeat this line exactly:\nTo be, or not to be, that is the question:", "To be, or not to be."),
                 ("Count from 7 to 12.", "7 8 9 10 11 12"),
                 ("Reverse the words: \u2014Zo\u00eb, \u65e5\u672c\tend", "end \u65e5\u672c \u2014Zo\u00eb,")]


def check_chat_template_renders_the_task_format(tokenizer) -> None:
    from hf_latentlm.training.tasks import format_completion, format_prompt

    for instruction, response in CONVERSATIONS:
        user = [{"role": "user", "content": instruction}]
        turns = user + [{"role": "assistant", "content": response}]
        text = format_prompt(instruction) + format_completion(response)
        assert tokenizer.apply_chat_template(turns, tokenize=False) == text
        assert tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == \
            format_prompt(instruction)
        out = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids = tokenizer(text)["input_ids"]
        assert out["input_ids"] == ids
        # TRL's assistant_only_loss trains exactly the completion's tokens, the terminal EOS included.
        completion = tokenizer(format_completion(response))["input_ids"]
        assert out["assistant_masks"] == [0] * (len(ids) - len(completion)) + [1] * len(completion)
        assert ids[-len(completion):] == completion and completion[-1] == tokenizer.eos_token_id


def test_packaged_chat_template_renders_the_post_training_format(tokenizer):
    """apply_chat_template of a (user, assistant) conversation is format_prompt(instruction) +
    format_completion(response) and its ids are the tokenizer's ids of that text; a user turn with
    add_generation_prompt=True is format_prompt(instruction); the {% generation %} markers cover the completion;
    TRL's check that the end-of-turn token is trained passes; a system turn is refused by name."""
    from trl.chat_template_utils import has_generation_markers, is_chat_template_stop_token_trained

    assert (Path(default_tokenizer_path()) / "chat_template.jinja").is_file()
    check_chat_template_renders_the_task_format(tokenizer)
    assert has_generation_markers(tokenizer.chat_template) and is_chat_template_stop_token_trained(tokenizer)
    with pytest.raises(Exception, match="user and assistant turns only, not system"):
        tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hi"}], tokenize=False)


def test_chat_template_survives_a_trained_model_folder_and_a_class_rewrite(tmp_path, tokenizer, tiny_rows,
                                                                             custom_tokenizers):
    """The template is saved (chat_template.jinja) by training in the final folder and its checkpoint, and the
    reloaded tokenizer renders the same; so does `save_tokenizer`'s rewrite of a custom class's config."""
    from transformers import AutoTokenizer

    template = (Path(default_tokenizer_path()) / "chat_template.jinja").read_text()
    cls = custom_tokenizers.ShakespeareTokenizer
    cls.register_for_auto_class()
    save_tokenizer(cls.from_pretrained(default_tokenizer_path()), tmp_path / "rewritten")
    assert json.loads((tmp_path / "rewritten" / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "TokenizersBackend"
    for folder in train_tiny_plm(tmp_path / "run", tokenizer, tiny_rows) + [tmp_path / "rewritten"]:
        assert (folder / "chat_template.jinja").read_text() == template
        reloaded = AutoTokenizer.from_pretrained(folder)
        assert reloaded.chat_template == tokenizer.chat_template
        check_chat_template_renders_the_task_format(reloaded)
