"""The contract every multi-token language-model family of the registry must honour, written once.

Each `check_*` function takes a family name; `tests/test_family_contract.py` runs them for every registered family
(so a new family gets them by registering), and `tests/test_adding_a_family.py` runs them for a throwaway toy family
built by following docs/adding_a_family.md.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from hf_latentlm.families import FAMILIES, build_fresh_model, get_family
from hf_latentlm.modeling.generation import MultiTokenGenerationMixin


def multi_token_families() -> list[str]:
    return [name for name, spec in FAMILIES.items()
            if spec.language_model and isinstance(spec.model_class, type)
            and issubclass(spec.model_class, MultiTokenGenerationMixin)]


def build_tiny(family: str, tokenizer, seed: int = 0):
    """A fresh `tiny` model of `family` around fresh tiny components (`build_fresh_model`), sampling varied tokens."""
    model = build_fresh_model(family, "tiny", tokenizer, seed)
    # Zero-initialised output layers (CALM's energy head) make every draw of an untrained model identical; small
    # random weights there make it sample varied tokens, which the EOS and batching checks need.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and not param.any():
                param.normal_(0.0, 0.02)
    return model


def seeded(model, seeds: list[int]) -> dict:
    """The generate() option that gives each row its own RNG seed."""
    assert model.row_seeds_option, f"{type(model).__name__} must name its per-row seed option"
    return {model.row_seeds_option: seeds}


def prompts(rows, lengths):
    return [rows[1600 + i, :n] for i, n in enumerate(lengths)]


def check_batched_rows_match_running_each_alone(model, rows, tokenizer, left_pad):
    batch = prompts(rows, (3, 17, 9))
    ids, mask = left_pad(batch, tokenizer.pad_token_id)
    seeds = [7, 8, 9]
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None, **seeded(model, seeds))
    assert batched.shape == (3, ids.shape[1] + 10)
    for b, p in enumerate(batch):
        alone = model.generate(p[None], max_new_tokens=10, eos_token_id=None, **seeded(model, [seeds[b]]))
        assert batched[b, ids.shape[1]:].tolist() == alone[0, p.numel():].tolist(), b


def check_eos_stops_a_row_and_pads_it(model, rows, tokenizer):
    prompt = rows[1600:1602, :8]
    free = model.generate(prompt, max_new_tokens=20, eos_token_id=None, **seeded(model, [1, 2]))[:, 8:]
    # The first token that did not occur before in a row, at index >= 5, becomes that row's end-of-sequence (the
    # first row that has one: an untrained latent model's read-out can repeat one token for a whole row).
    row, first = next((r, i) for r in range(2) for i in range(5, 20) if free[r, i] not in free[r, :i])
    stop = int(free[row, first])
    out = model.generate(prompt, max_new_tokens=20, eos_token_id=stop, pad_token_id=tokenizer.pad_token_id,
                         return_dict_in_generate=True, **seeded(model, [1, 2]))
    assert type(out).__name__ == "GenerateOutput"  # by name: a remote-code or copied family has its own class
    assert out.num_new_tokens[row].item() == first + 1
    assert out.sequences[row, 8:8 + first + 1].tolist() == free[row, :first + 1].tolist()
    assert (out.sequences[row, 8 + first + 1:] == tokenizer.pad_token_id).all()
    assert out.model_calls.shape == (2,) and (out.model_calls >= 1).all()
    # min_new_tokens: the same EOS does not stop the row before that many tokens.
    later = model.generate(prompt, max_new_tokens=20, eos_token_id=stop, min_new_tokens=first + 2,
                           return_dict_in_generate=True, **seeded(model, [1, 2]))
    assert later.num_new_tokens[row].item() >= first + 2
    assert later.sequences[row, 8:8 + first + 2].tolist() == free[row, :first + 2].tolist()


def check_streamer_receives_prompt_then_every_new_token(model, rows, streamer):
    prompt = rows[1600, :6][None]
    out = model.generate(prompt, max_new_tokens=10, eos_token_id=None, streamer=streamer, **seeded(model, [4]))
    assert streamer.ended and streamer.chunks[0] == prompt[0].tolist()
    assert sum(streamer.chunks[1:], []) == out[0, 6:].tolist()


class StopRowAfter(StoppingCriteria):
    """Flags `row` once it has at least `tokens` new tokens (every row with `row=None`), and records what it saw."""

    def __init__(self, row: int | None, tokens: int):
        self.row, self.tokens, self.seen = row, tokens, []

    def __call__(self, input_ids, scores, num_new_tokens=None, **kwargs):
        self.seen.append((input_ids.clone(), num_new_tokens.clone()))
        reached = num_new_tokens >= self.tokens
        return reached if self.row is None else reached & (torch.arange(len(reached)) == self.row)


def check_stopping_criteria_finish_the_rows_they_flag(model, rows):
    prompt = rows[1600:1602, :8]
    options = dict(max_new_tokens=14, eos_token_id=None, return_dict_in_generate=True, **seeded(model, [3, 4]))
    free = model.generate(prompt, **options).sequences[:, 8:]
    stop_first = StopRowAfter(row=0, tokens=4)
    out = model.generate(prompt, stopping_criteria=StoppingCriteriaList([stop_first]), **options)
    # The row is flagged at the first step after which it has >= 4 tokens; that step's tokens are kept.
    flagged_at = next(int(n[0]) for _, n in stop_first.seen if n[0] >= 4)
    assert out.num_new_tokens.tolist() == [flagged_at, 14]
    assert out.sequences[0, 8:8 + flagged_at].tolist() == free[0, :flagged_at].tolist()
    assert out.sequences[1, 8:].tolist() == free[1].tolist()  # the other row is untouched
    # What a criterion sees: the prompt, each row's tokens so far (shorter rows padded), each row's count.
    for sequences, counts in stop_first.seen:
        for b in range(2):
            assert sequences[b, 8:8 + counts[b]].tolist() == free[b, :counts[b]].tolist()
    # Flagging every row ends generate early: fewer calls than the free run.
    stop_all = StopRowAfter(row=None, tokens=1)
    early = model.generate(prompt, stopping_criteria=[stop_all], **options)  # a plain list, as transformers takes
    assert len(stop_all.seen) == 1 and early.num_new_tokens.tolist() == stop_all.seen[0][1].tolist()
    assert int(early.model_calls.max()) < int(model.generate(prompt, **options).model_calls.max())


def check_generation_config_sampling_fields_are_honoured(model, rows):
    prompt = rows[1600, :5][None]
    with pytest.raises(ValueError, match="top_k"):  # no family filters tokens by rank: the config's top_k reaches
        model.generate(prompt, max_new_tokens=3, generation_config=GenerationConfig(top_k=5))  # the refusal
    # A call's own value wins over the generation config's, as in transformers.
    out = model.generate(prompt, max_new_tokens=3, eos_token_id=None, top_k=0,
                         generation_config=GenerationConfig(top_k=5), **seeded(model, [2]))
    assert out.shape == (1, 8)


def check_loaded_generation_config_carries_the_family_sampling_defaults(model, tmp_path):
    from transformers import AutoModelForCausalLM

    model.save_pretrained(tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    defaults = model.generation_options_class.sampling_defaults(model.config)
    assert defaults["do_sample"] is True
    # Set, so that the text-generation pipeline does not fill them with its own (temperature 0.7).
    assert {name: getattr(loaded.generation_config, name) for name in defaults} == defaults


def check_lengths_follow_transformers_defaults(model, rows):
    prompt = rows[1600, :5][None]
    assert model.generate(prompt, eos_token_id=None).shape == (1, 20)  # transformers' default max_length
    assert model.generate(prompt, max_length=12, eos_token_id=None).shape == (1, 12)
    assert model.generate(prompt, max_new_tokens=7, max_length=9, eos_token_id=None).shape == (1, 12)
    with pytest.raises(ValueError, match="max_length"):
        model.generate(rows[1600, :25][None])


def check_bad_input_is_named(model, rows):
    prompt = rows[1600, :5][None]
    limit = model.config.max_position_embeddings
    for kwargs, needle in ((dict(num_beams=2), "num_beams"), (dict(frobnicate=True), "frobnicate"),
                           (dict(max_new_tokens=0), "max_new_tokens"),
                           (dict(max_new_tokens=limit), "max_position_embeddings"),
                           (seeded(model, [1, 2]), model.row_seeds_option)):
        with pytest.raises(ValueError, match=needle):
            model.generate(prompt, **{"max_new_tokens": 4, **kwargs})
    for empty in (torch.zeros(0, 3, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match="empty"):
            model.generate(empty, max_new_tokens=3)
    ids = rows[1600:1602, :5]
    right_padded = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="left padding"):
        model.generate(ids, attention_mask=right_padded, max_new_tokens=3)
    with pytest.raises(ValueError, match="streamer"):
        model.generate(ids, max_new_tokens=3, streamer=object())


def check_harness_counts_model_calls(model, rows):
    from hf_latentlm.eval.sampling import sample_continuations
    from hf_latentlm.eval.speed import measure_generation_speed

    assert sample_continuations(model, rows[1600:1604, :16], 6, seed=0).shape == (4, 6)
    batch = rows[1600:1602, :16]
    speed = measure_generation_speed(model, batch, max_new_tokens=12, repeats=1, seed=0)
    torch.manual_seed(0)  # the harness seeds the global RNG, from which per-row seeds are drawn by default
    own = model.generate(batch, max_new_tokens=12, eos_token_id=None, return_dict_in_generate=True)
    # The harness counts forward calls with a hook; the family reports them per row: a batch makes max(row) calls.
    assert speed["new_tokens_per_row"] == 12
    assert speed["model_calls_per_token"] == pytest.approx(own.model_calls.max().item() / 12)


def check_compiled_decoding_gives_the_same_tokens(model, rows, tokenizer, left_pad):
    from transformers import CompileConfig

    graphs = []

    def recording_backend(graph, example_inputs):  # runs each captured graph as it is: only dynamo is under test
        graphs.append(graph)
        return graph.forward

    config = CompileConfig(backend=recording_backend, mode="default")
    ids, mask = left_pad(prompts(rows, (5, 11)), tokenizer.pad_token_id)
    options = dict(attention_mask=mask, max_new_tokens=9, eos_token_id=None, **seeded(model, [3, 4]))
    eager = model.generate(ids, **options)
    compiled = model.generate(ids, compile_config=config, **options)
    assert compiled.tolist() == eager.tolist()
    # Every network the decoding runs went through torch.compile, and the modules run their own methods afterwards.
    methods = model.compiled_methods()
    assert len(graphs) >= len(methods), (len(graphs), methods)
    assert not any(name in vars(module) for module, name in methods)
    # The graphs live on each method's own entry point, none on a decorator's code: transformers' `deprecate_kwarg`
    # gives every forward it decorates one shared code object, where graphs would count against one limit.
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from hf_latentlm.modeling.generation import compile_entry_point

    for module, name in methods:
        method = getattr(type(module), name)
        if hasattr(method, "__wrapped__"):
            assert not _debug_get_cache_entry_list(method.__code__), (type(module).__name__, name)
        # and each listed method did run compiled (e.g. PLM's Voronoi fit, outside every network)
        assert _debug_get_cache_entry_list(compile_entry_point(type(module), name).__code__), (type(module), name)
    # A second call reuses the graphs (kept on the entry point's code, made once per class and method).
    captured = len(graphs)
    assert model.generate(ids, compile_config=config, **options).tolist() == eager.tolist()
    assert len(graphs) == captured
    with pytest.raises(TypeError, match="compile_config must be a transformers.CompileConfig"):
        model.generate(ids, compile_config={"backend": "inductor"}, **options)
    assert not any(name in vars(module) for module, name in methods)


def sibling_modules(modeling_file: Path) -> set[str]:
    """Every flat sibling module `modeling_file` needs, following `from .x import` recursively."""
    seen, todo = set(), [modeling_file]
    while todo:
        path = todo.pop()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module not in seen:
                seen.add(node.module)
                todo.append(path.with_name(f"{node.module}.py"))
    return seen


def check_checkpoint_loads_without_the_package(model, tokenizer, tmp_path, isolated_generate):
    import sys

    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    source = Path(sys.modules[type(model).__module__].__file__)
    assert {source.name, "model.safetensors"} | {f"{m}.py" for m in sibling_modules(source)} <= files
    auto_map = json.loads((tmp_path / "ckpt" / "config.json").read_text())["auto_map"]
    assert set(auto_map) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    prompt = [[5, 60, 700, 42, 9, 31, 17, 8]]
    options = {"eos_token_id": None, **seeded(model, [11])}
    expected = model.generate(torch.tensor(prompt), max_new_tokens=12, **options)[0, 8:].tolist()
    result = isolated_generate(tmp_path / "ckpt", "AutoModelForCausalLM", prompt, 12, options, tmp_path / "hf_home")
    assert result["tokens"] == expected
    # AutoModel gives the backbone where the family has one (`base_model_class`), as for transformers' own models.
    result = isolated_generate(tmp_path / "ckpt", "AutoModel", prompt, 12, options, tmp_path / "hf_home")
    if getattr(model, "base_model_class", None) is None:
        assert result["tokens"] == expected
        return
    assert result["class"] == model.base_model_class.__name__
    with torch.no_grad():
        hidden = model.base_model(input_ids=torch.tensor(prompt)).last_hidden_state
    torch.testing.assert_close(torch.tensor(result["hidden"]), hidden, atol=1e-5, rtol=1e-5)


def train_with_cli(family: str, root: Path, run_cli) -> Path:
    """`hf-latentlm train --family <family> --preset tiny` for 2 steps, after training its components the same
    way; returns the output folder."""
    spec = get_family(family)
    argv = ["train", "--family", family, "--preset", "tiny", "--output-dir", str(root / family), "--max-steps", "2",
            "--eval-every", "2", "--batch-size", "2"]
    for name, source in spec.components.items():
        argv += [f"--{name}", str(train_with_cli(source, root, run_cli))]
    code, stdout, err = run_cli(*argv)
    assert code == 0, err
    config = json.loads((root / family / "config.json").read_text())
    assert config["model_type"] == (spec.model_type or config["model_type"])
    if spec.language_model:
        assert f"{family}:" in stdout and "tokens per model call" in stdout and "baseline of the same size (tiny)" in stdout
    return root / family


def check_cli_round_trip(family: str, tmp_path, run_cli):
    folder = train_with_cli(family, tmp_path, run_cli)
    code, stdout, err = run_cli("generate", "--model", str(folder), "--prompt", "HAMLET.\n", "--max-new-tokens", "9",
                                "--seed", "3")
    assert code == 0, err
    assert stdout.startswith("HAMLET.\n") and stdout == run_cli("generate", "--model", str(folder), "--prompt",
                                                                "HAMLET.\n", "--max-new-tokens", "9", "--seed",
                                                                "3")[1]
    code, _, err = run_cli("generate", "--model", str(folder), "--prompt", "   ")
    assert code == 2 and "prompt is empty" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------------------------------
# The transformers contract (issue 9): outputs, return_dict, the deprecated cache name, base models, kwargs
# ---------------------------------------------------------------------------------------------------------------------

def eager_copy(model):
    """The same weights with attn_implementation="eager" (a deep copy: the original keeps SDPA)."""
    import copy

    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    assert eager.config._attn_implementation == "eager" and model.config._attn_implementation == "sdpa"
    return eager


def check_hidden_states_and_attentions(model, rows):
    """Llama's conventions: num_layers + 1 hidden states (embeddings first, the normed last state last), one
    attention map per layer from the eager path, which matches SDPA."""
    ids = rows[1600:1602, :16]
    layers = model.config.num_hidden_layers
    base = model.base_model
    out = base(input_ids=ids, output_hidden_states=True)
    assert len(out.hidden_states) == layers + 1
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state)
    assert out.hidden_states[0].shape == out.last_hidden_state.shape
    assert not any(torch.equal(out.hidden_states[i], out.hidden_states[i + 1]) for i in range(layers))
    assert base(input_ids=ids).hidden_states is None  # only when asked
    # Under SDPA, as Llama: one warning, an empty tuple of attentions and the same outputs (no error).
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    logging.get_logger("transformers").warning_once.cache_clear()  # "once" per process: start this check afresh
    with CaptureLogger(logging.get_logger("hf_latentlm")) as first:
        sdpa_out = base(input_ids=ids, output_attentions=True)
    with CaptureLogger(logging.get_logger("hf_latentlm")) as second:
        model(input_ids=ids, output_attentions=True)
    assert "attn_implementation='eager'" in first.out and second.out == "", (first.out, second.out)
    assert sdpa_out.attentions == ()
    torch.testing.assert_close(sdpa_out.last_hidden_state, out.last_hidden_state)

    eager = eager_copy(model)
    eager_out = eager.base_model(input_ids=ids, output_attentions=True, output_hidden_states=True)
    torch.testing.assert_close(eager_out.last_hidden_state, out.last_hidden_state, atol=1e-5, rtol=1e-5)
    assert len(eager_out.attentions) == layers
    probs = eager_out.attentions[0]
    length = probs.shape[-1]
    assert probs.shape == (2, model.config.num_attention_heads, length, length)
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)))
    # Causal, or block-causal for a backbone that declares `attention_block_size` (Cola's DiT): no weight on a
    # later block.
    block = getattr(base, "attention_block_size", 1)
    position = torch.arange(length)
    later_block = position[None, :] // block > position[:, None] // block
    assert (probs[..., later_block] == 0).all(), "no weight on later positions (blocks)"
    if block > 1:
        assert (probs[..., position[None, :] > position[:, None]] > 0).any(), "bidirectional inside a block"
    # The causal LM passes them through too.
    lm_out = eager(input_ids=ids, output_attentions=True, output_hidden_states=True)
    assert len(lm_out.attentions) == layers and len(lm_out.hidden_states) == layers + 1


def check_inputs_embeds_are_token_embeddings(model, rows):
    """transformers' meaning in every family: `inputs_embeds = get_input_embeddings()(input_ids)` gives what
    `input_ids` gives (PEFT prompt tuning and NEFTune rely on it), in the base model and the causal LM, also with a
    padding mask; a tensor of another width is refused by name. Perturbed embeddings must change the result (so the
    argument is read, not ignored)."""
    ids = rows[1600:1602, :16]
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    embeds = model.get_input_embeddings()(ids)
    for module in (model.base_model, model):
        # [0]: the first output, the hidden states of a base model or a latent LM, PLM's logits
        by_ids = module(input_ids=ids, attention_mask=mask)[0]
        by_embeds = module(inputs_embeds=embeds, attention_mask=mask)[0]
        torch.testing.assert_close(by_embeds, by_ids)
        moved = module(inputs_embeds=embeds + 0.5 * torch.randn_like(embeds), attention_mask=mask)[0]
        assert not torch.allclose(moved, by_ids, atol=1e-3)
    with pytest.raises(ValueError, match="inputs_embeds must be token embeddings"):
        model(inputs_embeds=embeds[..., :3])
    with pytest.raises(ValueError, match="exactly one of"):
        model.base_model(input_ids=ids, inputs_embeds=embeds)


def check_eval_loss_is_deterministic_and_per_row(model, rows):
    """An eval-mode loss (Trainer's `eval_loss`, early stopping) is the same for the same batch, leaves the global
    RNG alone, and a row's loss does not depend on the rest of the batch: the batch [a, b] (equal lengths, every
    position scored) averages the losses of [a] and [b]. Training mode still draws afresh from the global RNG."""
    a, b = rows[1600:1601, :32], rows[1601:1602, :32]
    both = torch.cat([a, b])
    assert not model.training
    with torch.no_grad():
        state = torch.get_rng_state()
        first = model(input_ids=both, labels=both).loss
        assert torch.equal(torch.get_rng_state(), state), "the eval loss drew from the global RNG"
        again = model(input_ids=both, labels=both).loss
        alone = [model(input_ids=x, labels=x).loss for x in (a, b)]
        model.train()
        try:
            torch.manual_seed(0)
            trained = [model(input_ids=both, labels=both).loss for _ in range(2)]
            torch.manual_seed(0)
            replayed = model(input_ids=both, labels=both).loss
        finally:
            model.eval()
    assert torch.equal(first, again)
    torch.testing.assert_close(first, (alone[0] + alone[1]) / 2, atol=1e-5, rtol=1e-5)
    assert not torch.equal(alone[0], alone[1])
    assert not torch.equal(trained[0], trained[1]) and torch.equal(trained[0], replayed)


def check_return_dict_false_gives_tuples(model, rows):
    ids = rows[1600:1602, :16]
    as_dict = model(input_ids=ids)
    as_tuple = model(input_ids=ids, return_dict=False)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], as_dict.to_tuple()[0])
    base = model.base_model(input_ids=ids, return_dict=False)
    assert isinstance(base, tuple)
    torch.testing.assert_close(base[0], model.base_model(input_ids=ids).last_hidden_state)


def check_past_key_values_is_a_deprecated_alias_of_cache(model, rows):
    from transformers.cache_utils import DynamicCache

    ids = rows[1600:1601, :16]
    prefix, rest = ids[:, :8], ids[:, 8:]
    new = model.base_model(input_ids=prefix, cache=DynamicCache(config=model.config)).cache
    with pytest.warns(FutureWarning, match="past_key_values"):
        old = model.base_model(input_ids=prefix, past_key_values=DynamicCache(config=model.config)).cache
    with pytest.warns(FutureWarning, match="past_key_values"):
        lm_cache = model(input_ids=prefix, past_key_values=DynamicCache(config=model.config)).cache
    assert lm_cache.get_seq_length() == old.get_seq_length()
    assert old is not None and old.get_seq_length() == new.get_seq_length() > 0
    with pytest.warns(FutureWarning):
        via_old = model.base_model(input_ids=rest, past_key_values=old).last_hidden_state
    via_new = model.base_model(input_ids=rest, cache=new).last_hidden_state
    torch.testing.assert_close(via_old, via_new)
    whole = model.base_model(input_ids=ids).last_hidden_state[:, -via_new.shape[1]:]
    torch.testing.assert_close(via_new, whole, atol=1e-5, rtol=1e-4)


def check_base_model_takes_input_ids_and_padding(model, rows, left_pad):
    """The backbone alone (what transformers' utilities and TRL's fused head call): `input_ids` + a 2-D left-padding
    mask give each row what it gets unpadded."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    short, long = rows[1600, :8], rows[1601, :16]
    ids, mask = left_pad([short, long], 1)
    out = model.base_model(input_ids=ids, attention_mask=mask)
    assert isinstance(out, BaseModelOutputWithPast)
    alone = model.base_model(input_ids=short[None]).last_hidden_state
    torch.testing.assert_close(out.last_hidden_state[0, -alone.shape[1]:], alone[0], atol=1e-5, rtol=1e-4)


def check_unknown_forward_arguments_are_refused(model, rows):
    with pytest.raises(TypeError, match="foo"):
        model(input_ids=rows[1600:1601, :8], foo=3)
