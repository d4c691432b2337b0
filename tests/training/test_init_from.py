"""`hf-latentlm train --family plm --init-from SRC`: the source's weights, vocabulary and tokenizer, exact resume, the
refusals, and the encoder KL term to the frozen source (`--encoder-kl-weight`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_latentlm.families import build_model
from hf_latentlm.modeling import PLMForCausalLM
from hf_latentlm.training.checkpoint import save_tokenizer
from hf_latentlm.training.encoder_kl import EncoderKL
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
