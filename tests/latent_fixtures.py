"""Helpers shared by the latent families' tests (Cola and AURORA-LM: tests/modeling/test_cola.py, test_aurora.py,
tests/training/test_cola_training.py, test_aurora_training.py). Imported by name: tests/ is on sys.path (the
rootdir conftest's folder), as for family_contract.py.

Modeling: random ids, left padding, forward-call counting and recording, the check that a sampled read-out gives each
row in a batch what it gives alone. Training: fixtures of a saved tiny
component folder and of short rows, the tiny-preset training config, logged steps, and a 2-process CPU DDP run of
tests/training/ddp_worker.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from hf_latentlm.families import build_model
from hf_latentlm.training.loop import TrainConfig

DDP_WORKER = Path(__file__).parent / "training" / "ddp_worker.py"


# ====================================================================================================================
# Modeling
# ====================================================================================================================

def random_tokens(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """[batch, length] ids in [2, vocab) (0 and 1 left out), from their own generator."""
    return torch.randint(2, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padded(rows: list[torch.Tensor], pad: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.numel() for r in rows)
    ids, mask = torch.full((len(rows), width), pad), torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - r.numel():], mask[b, width - r.numel():] = r, 1
    return ids, mask


@contextmanager
def forward_calls_counted(modules: dict):
    """Counts the forward calls of each module of `modules` (name -> module) while the block runs; yields the counts
    (name -> calls), which the block's calls keep up to date."""
    counted = dict.fromkeys(modules, 0)
    handles = [module.register_forward_pre_hook(lambda *_, name=name: counted.__setitem__(name, counted[name] + 1))
               for name, module in modules.items()]
    try:
        yield counted
    finally:
        for handle in handles:
            handle.remove()


def assert_calls_match(out, max_new: int, expected: dict[str, int], counted: dict[str, int]) -> None:
    """A one-row `generate(return_dict_in_generate=True)` made `max_new` tokens, and its calls per network (reported
    and counted by hooks) and in all are the `expected` hand count."""
    assert out.num_new_tokens.tolist() == [max_new]
    assert {k: v.tolist() for k, v in out.calls_by_network.items()} == {k: [v] for k, v in expected.items()}
    assert counted == expected
    assert out.model_calls.tolist() == [sum(expected.values())]


@contextmanager
def first_inputs_recorded(module):
    """Yields a list that gets a clone of the first positional input of each forward call of `module` while the block
    runs."""
    seen = []
    hook = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    try:
        yield seen
    finally:
        hook.remove()


def assert_sampled_rows_as_alone(model, rows: list[torch.Tensor]) -> SimpleNamespace:
    """temperature 1: the rows (1-D prompts, three of them), left padded, give in a batch exactly what each gives alone
    with its own noise seed; the read-out does sample (other seeds, and greedy, give other tokens). Returns the batch
    (ids, mask, seeds, kwargs) and its sampled (batched) and greedy sequences."""
    ids, mask = left_padded(rows)
    seeds = [11, 12, 13]
    kwargs = dict(max_new_tokens=6, eos_token_id=None, num_inference_steps=2)
    batched = model.generate(ids, attention_mask=mask, temperature=1.0, noise_seeds=seeds, **kwargs)
    for b, row in enumerate(rows):
        alone = model.generate(row[None], temperature=1.0, noise_seeds=[seeds[b]], **kwargs)
        assert batched[b, ids.shape[1]:].tolist() == alone[0, row.numel():].tolist(), b
    other_seeds = model.generate(ids, attention_mask=mask, temperature=1.0, noise_seeds=[21, 22, 23], **kwargs)
    greedy = model.generate(ids, attention_mask=mask, temperature=0.0, noise_seeds=seeds, **kwargs)
    assert not torch.equal(batched, other_seeds) and not torch.equal(batched, greedy)
    return SimpleNamespace(ids=ids, mask=mask, seeds=seeds, kwargs=kwargs, batched=batched, greedy=greedy)


# ====================================================================================================================
# Training
# ====================================================================================================================

def component_folder_fixture(family: str):
    """A module-scoped fixture: the folder of a tiny `family` model (built from seed 0) saved once per test module."""

    @pytest.fixture(scope="module")
    def folder(tokenizer, tmp_path_factory) -> str:
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(family)
        build_model(family, "tiny", tokenizer).save_pretrained(path)
        return str(path)

    return folder


def short_rows_fixture(length: int):
    """A module-scoped fixture: the first 40 tiny rows cut to `length` tokens."""

    @pytest.fixture(scope="module")
    def short_rows(tiny_rows) -> torch.Tensor:
        return tiny_rows[:40, :length].clone()

    return short_rows


def tiny_train_config(family: str, out, row_length: int, components: dict, model_kwargs: dict,
                      **overrides) -> TrainConfig:
    """4 steps of batch 2 of `row_length`-token rows, a checkpoint every 2 steps, metrics every step, seed 5."""
    values = dict(family=family, preset="tiny", output_dir=str(out), max_steps=4, batch_size=2, seq_len=row_length,
                  eval_every=0, save_every=2, log_every=1, progress_bar=False, seed=5, components=components,
                  model_kwargs=model_kwargs)
    values.update(overrides)
    return TrainConfig(**values)


def logged_steps(folder: Path) -> list[dict]:
    return [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def two_process_ddp(tmp_path: Path, rows: torch.Tensor, tokenizer, family: str, component: str,
                    folder: str) -> tuple[list[dict], dict]:
    """torchrun, 2 CPU processes, 2 steps of tests/training/ddp_worker.py on the first 16 `rows`, the tiny `family`
    model built around the `component` folder. Asserts that the run succeeded, that the ranks saved the parameters of
    the model as the worker builds it and identical values; returns (each rank's final state, the initial state)."""
    rows_file = tmp_path / "rows.pt"
    torch.save(rows[:16].clone(), rows_file)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(DDP_WORKER),
           str(tmp_path / "ddp"), str(rows_file), "2", "--family", family, "--max-steps", "2",
           f"--component={component}={folder}"]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [load_file(tmp_path / "ddp" / f"rank{r}.safetensors") for r in range(2)]
    torch.manual_seed(0)  # as the worker builds it
    initial = build_model(family, "tiny", tokenizer, **{component: folder}).state_dict()
    assert set(ranks[0]) == set(initial)
    for name, value in ranks[0].items():
        assert torch.equal(value, ranks[1][name]), f"ranks differ at {name}"
    return ranks, initial
