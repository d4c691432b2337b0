"""`train --corpus generated:LEVEL`: rows drawn from the language's seeded documents, disjoint across ranks and
training seeds, resumed exactly, the language recorded for `eval`."""

import json

import pytest
import torch

from hf_latentlm.cli import main
from hf_latentlm.data.generated import LANGUAGE_RECORD, GeneratedLanguage
from hf_latentlm.families import build_model
from hf_latentlm.training.data import GeneratedRows
from hf_latentlm.training.loop import TrainConfig, train


@pytest.fixture(scope="module")
def easy():
    return GeneratedLanguage.from_level("easy")


@pytest.fixture(scope="module")
def word_tokenizer(easy):
    return easy.tokenizer()


def test_rows_pack_the_seeded_documents_and_ranks_read_every_world_th(easy, word_tokenizer):
    whole = [tok for i in range(60) for tok in easy.document("train", 3, i)]
    rows = GeneratedRows(easy, "train", 3, word_tokenizer, 32).take(20)
    assert torch.equal(rows.flatten(), torch.tensor(whole[:640]))
    for rank in (0, 1):
        mine = [tok for i in range(rank, 120, 2) for tok in easy.document("train", 3, i)]
        rank_rows = GeneratedRows(easy, "train", 3, word_tokenizer, 32, rank=rank, world=2).take(10)
        assert torch.equal(rank_rows.flatten(), torch.tensor(mine[:320]))
    other_seed = GeneratedRows(easy, "train", 4, word_tokenizer, 32).take(20)
    validation = GeneratedRows(easy, "validation", 0, word_tokenizer, 32).take(20)
    assert not torch.equal(rows, other_seed) and not torch.equal(rows, validation)


def test_a_resumed_stream_jumps_to_the_rows_the_uninterrupted_one_reads(easy, word_tokenizer):
    straight = GeneratedRows(easy, "train", 0, word_tokenizer, 48, rank=1, world=3).take(30)
    for cut in (1, 7, 19):
        first = GeneratedRows(easy, "train", 0, word_tokenizer, 48, rank=1, world=3)
        first.take(cut)
        resumed = GeneratedRows(easy, "train", 0, word_tokenizer, 48, rank=1, world=3)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint stores it
        assert torch.equal(resumed.take(30 - cut), straight[cut:]), f"cut after {cut} rows"
        assert resumed.epoch == 0


def test_training_resumes_on_the_same_rows_and_records_the_language(tmp_path, easy, word_tokenizer):
    def run(out, **kw):
        cfg = TrainConfig(family="ar", preset="tiny", output_dir=str(tmp_path / out), max_steps=6, batch_size=4,
                          seq_len=32, eval_every=3, eval_batches=1, save_every=3, progress_bar=False, seed=2,
                          corpus="generated:easy", **kw)
        torch.manual_seed(2)
        model = build_model("ar", "tiny", word_tokenizer)
        seen = []
        model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].clone())
                                        if module.training else None, with_kwargs=True)
        return seen, train(cfg, model=model)

    straight, metrics = run("a")
    first, _ = run("b", stop_at_step=3)
    resumed, resumed_metrics = run("b", resume=True)
    assert len(straight) == 6 and all(torch.equal(a, b) for a, b in zip(straight, first + resumed))
    expected = GeneratedRows(easy, "train", 2, word_tokenizer, 32).take(24)
    assert torch.equal(torch.cat(straight), expected)
    assert resumed_metrics["val_loss"] == pytest.approx(metrics["val_loss"], abs=1e-5)
    record = json.loads((tmp_path / "a" / LANGUAGE_RECORD).read_text())
    assert record["level"] == "easy" and record["train_stream"] == 2
    assert GeneratedLanguage.from_folder(tmp_path / "a").spec == easy.spec


def test_cli_trains_and_evaluates_against_the_optimum(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--family", "ar", "--preset", "tiny", "--corpus", "generated:easy", "--output-dir", str(out),
                 "--max-steps", "40", "--eval-every", "40", "--save-every", "40"])
    assert code in (0, None)
    printed = capsys.readouterr().out
    assert "--- against the optimum of generated:easy (1000 validation windows, context 60;" in printed
    assert "BrierLM-2 gap closed" in printed and "NLL" in printed and "tokens/s" in printed
    assert len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]) == GeneratedLanguage.from_level(
        "easy").vocab_size
    assert main(["eval", "--model", str(out), "--num-positions", "300", "--context-len", "32"]) in (0, None)
    printed = capsys.readouterr().out
    result = json.loads(printed[:printed.rindex("}") + 1])
    assert result["optimum"]["language"]["level"] == "easy" and "likelihood" in result["optimum"]
    gap = result["optimum"]["gap_closed"]["brierlm_2"]
    assert gap["ci_low"] <= gap["value"] <= gap["ci_high"]
    assert "against the optimum of generated:easy: BrierLM-2 gap closed" in printed


@pytest.mark.parametrize("extra, match", [
    (["--corpus", "generated:nope"], "unknown generated-language level 'nope'"),
    (["--corpus", "wiki"], "unknown corpus 'wiki'"),
    (["--corpus", "generated:easy", "--tokenizer", "gpt2"], "drop tokenizer"),
])
def test_bad_corpus_options_are_refused_in_one_line(tmp_path, capsys, extra, match):
    code = main(["train", "--preset", "tiny", "--output-dir", str(tmp_path / "bad"), "--max-steps", "1", *extra])
    err = capsys.readouterr().err
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()


def test_bench_measures_models_of_one_language_against_its_optimum_and_refuses_a_mix(tmp_path, run_cli, tokenizer,
                                                                                     word_tokenizer):
    from hf_latentlm.families import build_model

    paths = {}
    for name, steps in (("ar", 30), ("plm", 30)):
        paths[name] = tmp_path / name
        train(TrainConfig(family=name, preset="tiny", output_dir=str(paths[name]), max_steps=steps, eval_every=0,
                          save_every=steps, corpus="generated:easy", progress_bar=False))
    code, stdout, err = run_cli("bench", "--model", f"ar={paths['ar']}", "--model", f"plm={paths['plm']}",
                                "--num-positions", "200", "--context-len", "32", "--repeats", "1",
                                "--max-new-tokens", "8", "--output", str(tmp_path / "b.json"),
                                "--markdown", str(tmp_path / "b.md"))
    assert code == 0, err
    report = json.loads((tmp_path / "b.json").read_text())
    for row in report["models"].values():
        assert row["optimum"]["language"]["level"] == "easy"
        assert row["brier"]["num_positions"] == row["optimum"]["true"]["num_positions"]
    assert "gap closed (BrierLM-2)" in (tmp_path / "b.md").read_text()
    shakespeare = tmp_path / "shakespeare"
    build_model("ar", "tiny", tokenizer).save_pretrained(shakespeare)
    tokenizer.save_pretrained(shakespeare)
    code, _, err = run_cli("bench", "--model", f"ar={paths['ar']}", "--model", f"s={shakespeare}",
                           "--num-positions", "8", "--context-len", "32", "--repeats", "1",
                           "--output", str(tmp_path / "c.json"))
    assert code == 2 and "trained on different corpora" in err and "s: the embedded corpus" in err


def test_a_component_reports_on_the_language_it_was_trained_on(tmp_path, run_cli, easy):
    """`train --family aurora-ae --corpus generated:easy` prints its reconstruction on the language's validation
    ids, not on the embedded corpus (which its word-level tokenizer would mostly read as <|unk|>)."""
    from hf_latentlm.eval.components import autoencoder_accuracy
    from hf_latentlm.eval.optimum import evaluation_stream
    from hf_latentlm.loading import load_model_and_tokenizer

    out = tmp_path / "ae"
    code, stdout, err = run_cli("train", "--family", "aurora-ae", "--preset", "tiny", "--corpus", "generated:easy",
                                "--output-dir", str(out), "--max-steps", "30", "--eval-every", "30")
    assert code == 0, err
    model, _ = load_model_and_tokenizer(str(out), language_model=False)
    expected = autoencoder_accuracy(model.eval(), evaluation_stream(easy))
    assert f"reconstruction accuracy {expected['accuracy']:.4%}" in stdout, stdout
    assert expected["accuracy"] > 0.5  # the residual copy path of the tiny preset copies within 30 steps
