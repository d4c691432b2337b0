"""`hf-latentlm train --family plm --init-from SRC` (and `sft --init-from SRC`): the source's weights, vocabulary and
tokenizer, exact resume, the refusals, and the encoder KL term to the frozen source (`--encoder-kl-weight`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_latentlm.families import build_model
from hf_latentlm.hub import post_training_origin
from hf_latentlm.modeling import PLMForCausalLM
from hf_latentlm.training.checkpoint import save_tokenizer
from hf_latentlm.training.encoder_kl import EncoderKL, token_kl
from hf_latentlm.training.loop import TrainConfig, train

TINY_PLM = dict(block_size=4, k_pred=4, num_auxiliaries=128, auxiliary_top_m=32)


@pytest.fixture(scope="module")
def ar_folder(tmp_path_factory, tokenizer):
    """A saved `ar` tiny model with its tokenizer, as `train --family ar` writes it."""
    folder = tmp_path_factory.mktemp("ar-tiny")
    torch.manual_seed(0)
    model = build_model("ar", "tiny", tokenizer)
    model.save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return str(folder)


def train_args(ar_folder, output_dir, *extra):
    return ["train", "--family", "plm", "--preset", "tiny", "--init-from", ar_folder, "--output-dir", str(output_dir),
            "--max-steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-every", "0", "--save-every", "1",
            "--no-progress-bar", "--no-summary", *extra]


def test_init_from_then_resume_ends_as_the_straight_run(run_cli, ar_folder, tmp_path):
    code, _, err = run_cli(*train_args(ar_folder, tmp_path / "straight"))
    assert code == 0, err
    code, _, err = run_cli(*train_args(ar_folder, tmp_path / "resumed", "--stop-at-step", "1"))
    assert code == 0, err
    code, out, err = run_cli(*train_args(ar_folder, tmp_path / "resumed", "--resume"))
    assert code == 0, err
    assert "resumed from" in out
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], atol=0, rtol=0)
    config = json.loads((tmp_path / "straight" / "config.json").read_text())
    source = json.loads((Path(ar_folder) / "config.json").read_text())
    assert config["model_type"] == "plm" and config["vocab_size"] == source["vocab_size"]
    assert (tmp_path / "straight" / "tokenizer.json").is_file()


def test_the_registry_builds_from_the_source_with_the_presets_plm_fields(ar_folder, tokenizer):
    plm = build_model("plm", "small", tokenizer, init_from=ar_folder)
    # Sizes and vocabulary from the source (a tiny model), PLM's own fields from the preset asked for.
    assert plm.config.hidden_size == 64 and plm.config.vocab_size == len(tokenizer)
    assert plm.config.block_size == 8 and plm.config.num_auxiliaries == 128
    with pytest.raises(ValueError, match="--init-from only applies to --family plm"):
        build_model("ar", "tiny", tokenizer, init_from=ar_folder)


@pytest.mark.parametrize("argv,needle", [
    (["train", "--family", "ar", "--preset", "tiny", "--init-from", "somewhere"], "--init-from only applies to "
                                                                                  "--family plm, not 'ar'"),
    (["train", "--family", "plm", "--preset", "tiny", "--encoder-kl-weight", "0.5"], "--encoder-kl-weight needs "
                                                                                     "--init-from"),
    (["train", "--family", "plm", "--preset", "tiny", "--init-from", "./no/such/folder"], "no such folder"),
])
def test_bad_init_from_options_are_refused_in_one_line(run_cli, tmp_path, argv, needle):
    code, _, err = run_cli(*argv, "--output-dir", str(tmp_path / "run"))
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_tokenizer_with_init_from_is_refused(ar_folder, tmp_path):
    with pytest.raises(ValueError, match="brings its own tokenizer"):
        TrainConfig(family="plm", preset="tiny", init_from=ar_folder, tokenizer=ar_folder,
                    output_dir=str(tmp_path)).resolved()


def test_encoder_kl_is_zero_at_step_0_and_adds_its_weight_times_the_kl(ar_folder, tiny_rows):
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(ar_folder)
    plm = PLMForCausalLM.from_causal_lm(source, **TINY_PLM)
    rows = tiny_rows[:2, :32]
    term = EncoderKL(source, weight=0.5)
    torch.manual_seed(0)
    output = plm(input_ids=rows, labels=rows)
    loss, parts = term.add_to(output, rows)
    assert parts["encoder_kl"].abs() < 1e-6 and torch.allclose(loss, output.loss)

    with torch.no_grad():  # the encoder moves away from the source, as training moves it
        plm.model.layers[0].mlp.down_proj.weight.add_(0.05 * torch.randn_like(plm.model.layers[0].mlp.down_proj.weight))
    torch.manual_seed(0)
    output = plm(input_ids=rows, labels=rows)
    loss, parts = term.add_to(output, rows)
    kl = parts["encoder_kl"]
    assert kl > 1e-4
    torch.testing.assert_close(loss, output.loss + 0.5 * kl)
    loss.backward()  # the KL's gradient reaches the PLM, never the frozen source
    assert plm.model.layers[0].mlp.down_proj.weight.grad is not None
    assert all(p.grad is None and not p.requires_grad for p in source.parameters())


def test_training_logs_the_encoder_kl(ar_folder, tokenizer, tiny_rows, tmp_path):
    cfg = TrainConfig(family="plm", preset="tiny", init_from=ar_folder, encoder_kl_weight=1.0,
                      output_dir=str(tmp_path / "kl"), max_steps=2, batch_size=2, seq_len=32, eval_every=0,
                      save_every=2, log_every=1, progress_bar=False, model_kwargs=TINY_PLM)
    logged = {}
    train(cfg, train_rows=tiny_rows[:64, :32], on_step=lambda step, metrics: logged.update({step: metrics}))
    # Step 1's forward runs on the source's weights; step 2's on weights one update away from them.
    assert logged[1]["encoder_kl"] < 1e-6 < logged[2]["encoder_kl"]


@pytest.mark.parametrize("worker", ["ddp_worker.py", "fsdp_worker.py"], ids=["ddp", "fsdp"])
def test_encoder_kl_trains_under_two_process_data_parallel(ar_folder, tiny_rows, tmp_path, worker):
    """`--init-from` with `--encoder-kl-weight` under torchrun with 2 CPU processes (DDP, and FSDP2 as
    configs/accelerate/fsdp.yaml shards): with the frozen source held beside the wrapped model, the ranks end with
    identical parameters, the encoder moves, and the KL is logged, 0 at step 1 and positive after."""
    rows_file = tmp_path / "rows.pt"
    torch.save(tiny_rows[:16].clone(), rows_file)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).with_name(worker)), str(tmp_path / "run"), str(rows_file), "2", "--family", "plm",
           "--max-steps", "2", "--init-from", ar_folder, "--encoder-kl-weight", "1"]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = (load_file(tmp_path / "run" / f"rank{r}.safetensors") for r in range(2))
    for name, value in rank0.items():
        torch.testing.assert_close(value, rank1[name], atol=0, rtol=0, msg=f"ranks differ at {name}")
    source = load_file(Path(ar_folder) / "model.safetensors")
    moved = rank0["model.layers.0.mlp.down_proj.weight"] - source["model.layers.0.mlp.down_proj.weight"]
    assert moved.abs().max() > 1e-4
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kl = {record["step"]: record["encoder_kl"] for record in logged if "encoder_kl" in record}
    assert kl[1] < 1e-6 < kl[2]


def test_token_kl_with_a_mask_is_the_mean_over_the_attended_positions_by_hand():
    torch.manual_seed(0)
    logits, reference = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    p, q = reference.softmax(-1), logits.softmax(-1)
    per_position = (p * (p.log() - q.log())).sum(-1)  # KL(reference ‖ model) at each position
    expected = (per_position[0, 0] + per_position[0, 1] + per_position[1, 0]) / 3
    torch.testing.assert_close(token_kl(logits, reference, mask), expected)
    torch.testing.assert_close(token_kl(logits, reference), per_position.mean())
    logits[0, 2], logits[1, 1:] = 50.0, float("nan")  # what padding holds does not count, even NaN
    reference[1, 2] = float("-inf")
    logits.requires_grad_(True)
    kl = token_kl(logits, reference, mask)
    torch.testing.assert_close(kl, expected)
    kl.backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[0, 2] == 0).all() and (logits.grad[1, 1:] == 0).all()


def test_sft_from_a_causal_lm_adds_the_masked_encoder_kl_to_the_loss(ar_folder, tmp_path):
    """`LatentSFTTrainer(encoder_kl=...)` on a right-padded SFT batch: the loss is the PLM objective plus the
    weight times the KL to the source over the attended positions (by hand), and the KL is logged."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_latentlm.training.post_training import LatentSFTTrainer, sft_config

    source = AutoModelForCausalLM.from_pretrained(ar_folder)
    tokenizer = AutoTokenizer.from_pretrained(ar_folder)
    plm = PLMForCausalLM.from_causal_lm(source, **TINY_PLM)
    with torch.no_grad():  # the encoder one update away from its source, so the KL is not zero
        plm.model.layers[0].mlp.down_proj.weight.add_(0.05 * torch.randn_like(plm.model.layers[0].mlp.down_proj.weight))
    rows = [{"prompt": "Count from 1 to 4:", "completion": " 1 2 3 4"},
            {"prompt": "Count from 21 to 30, one number at a time:", "completion": " 21 22 23 24 25 26 27 28 29 30"}]
    trainer = LatentSFTTrainer(model=plm, args=sft_config(str(tmp_path / "sft"), batch_size=2, max_steps=1),
                               train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                               encoder_kl=EncoderKL(source, weight=0.5))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert (batch["attention_mask"] == 0).any(), "the batch has padding"
    torch.manual_seed(0)
    loss = trainer.compute_loss(plm, batch)
    torch.manual_seed(0)
    inputs = trainer.model_inputs(batch)
    own = plm(**inputs)
    with torch.no_grad():
        reference = source(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    kl = token_kl(own.logits, reference, batch["attention_mask"])
    assert kl > 1e-4
    torch.testing.assert_close(loss, own.loss + 0.5 * kl)
    assert trainer._metrics["train"]["encoder_kl"][-1] == pytest.approx(kl.item(), rel=1e-5)


def test_cli_sft_init_from_trains_a_plm_from_the_source_and_records_it(run_cli, ar_folder, tmp_path):
    code, out, err = run_cli("sft", "--init-from", ar_folder, "--family", "plm", "--preset", "tiny",
                             "--encoder-kl-weight", "1", "--task", "count-tens", "--max-steps", "2",
                             "--batch-size", "2", "--train-size", "8", "--output-dir", str(tmp_path / "sft"))
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["family"] == "plm"
    config = json.loads((tmp_path / "sft" / "config.json").read_text())
    source = json.loads((Path(ar_folder) / "config.json").read_text())
    assert config["model_type"] == "plm" and config["hidden_size"] == source["hidden_size"]
    assert config["block_size"] == 4, "the tiny preset's PLM fields"
    record = json.loads((tmp_path / "sft" / "post_training.json").read_text())
    assert record["base_model"] == ar_folder and record["init_from"] == {"family": "plm", "encoder_kl_weight": 1.0}
    # The model card says what the model is: a PLM started from the (pushed) source, then SFT.
    base, text = post_training_origin(tmp_path / "sft", base_model="someone/ar-tiny")
    assert base == "someone/ar-tiny" and text.startswith("a plm model started from its weights (`--init-from`), then SFT")
    trained = load_file(tmp_path / "sft" / "model.safetensors")
    start = load_file(Path(ar_folder) / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    assert (trained[name] - start[name]).abs().max() > 0, "the shared weights trained"


@pytest.mark.parametrize("argv,needle", [
    ([], "give exactly one of --model"),
    (["--model", "x", "--init-from", "y"], "give exactly one of --model"),
    (["--model", "x", "--encoder-kl-weight", "1"], "--encoder-kl-weight needs --init-from"),
    (["--init-from", "y", "--family", "ar"], "--init-from only applies to --family plm, not 'ar'"),
    (["--init-from", "y", "--preset", "huge"], "unknown preset 'huge'"),
    (["--model", "x", "--family", "plm"], "--family and --preset need --init-from"),
    (["--init-from", "y", "--encoder-kl-weight", "-1"], "--encoder-kl-weight must be >= 0"),
    (["--init-from", "y", "--lora"], "--lora applies to --model only"),
])
def test_bad_sft_start_options_are_refused_in_one_line(run_cli, tmp_path, argv, needle):
    code, _, err = run_cli("sft", *argv, "--output-dir", str(tmp_path / "run"))
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_sft_from_a_causal_lm_resumes_to_the_straight_runs_weights(ar_folder, tmp_path):
    """A resumed `sft --init-from` run rebuilds the PLM from the source (PLM's own parts drawn from the seed), then
    loads the checkpoint over it: after 2 + 2 steps its weights are those of 4 straight steps. The interrupted run
    starts after the straight one, from another global RNG state, so the seed must fix the drawn parts."""
    from transformers import TrainerCallback

    from hf_latentlm.recipes import run_sft

    class StopAtTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 2

    common = dict(task="count-tens", train_size=8, max_steps=4, batch_size=2, learning_rate=1e-2, save_every=2,
                  init_from=ar_folder, family="plm", preset="tiny", encoder_kl_weight=1.0)
    run_sft(None, tmp_path / "straight", **common)
    assert run_sft(None, tmp_path / "resumed", callbacks=[StopAtTwo()], **common)["steps"] == 2
    assert run_sft(None, tmp_path / "resumed", resume=True, **common)["steps"] == 4
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    start = load_file(Path(ar_folder) / "model.safetensors")
    assert (straight["model.embed_tokens.weight"] - start["model.embed_tokens.weight"]).abs().max() > 0
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], atol=1e-6, rtol=1e-5, msg=name)
