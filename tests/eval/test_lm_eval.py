"""The lm-evaluation-harness adapter (`hf_latentlm.eval.lm_eval`, lm-eval model "hf-latentlm") on tiny saved
checkpoints of every family, with the offline tasks of tests/eval/lm_eval_tasks/.

References: lm-eval's own `hf` model (`HFLM`) on the same AR checkpoint; for PLM, log-softmax of its forward's
logits computed here; for generation, each family's own `generate()` on each prompt alone with the request's seed,
cut at the first stop string. lm-eval's command line runs in a subprocess started before the other tests (its
start-up indexes the ~14.7k task files lm-eval ships, about 10 s here), so that it overlaps them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from family_contract import build_tiny  # noqa: E402
from official_checkpoints import CONVERTED, convert_fixture  # noqa: E402
from lm_eval import utils as lm_eval_utils  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from hf_latentlm.eval.lm_eval import LM_EVAL_TORCH_SEED, HFLatentLM, StopStringCriteria  # noqa: E402
from hf_latentlm.training.checkpoint import save_tokenizer  # noqa: E402
from hf_latentlm.training.scorers import stable_int  # noqa: E402

TASKS = Path(__file__).parent / "lm_eval_tasks"
FAMILIES = ("ar", "plm", "calm", "cola", "aurora")
LATENT = ("calm", "cola", "aurora")
MODELS = FAMILIES + CONVERTED  # and the official CALM and Cola weights, converted
CLI_FAMILY = "cola"
SAMPLED = {"do_sample": True, "temperature": 1.0}  # what the sampled local task sets, accepted by every family
PROMPTS = ["ROMEO.\nBut soft, what light", "HAMLET.\nTo be", "KING.\nNow is the winter of our discontent"]
PAIRS = [("ROMEO.\nBut soft, what light", " through yonder window"), ("HAMLET.", "\nTo be, or not"),
         ("", "KING.\nNow is the winter")]  # an empty context is conditioned on the prefix token (BOS)
# Sums of float32 log-probabilities (tens of nats) batched or padded differently: a few float32 roundings of the
# sum, whose size depends on the machine's kernels, against the 1e-2 or more that a wrong token or offset moves it.
LOGLIKELIHOOD_TOLERANCE = {"rel": 2e-6, "abs": 1e-5}
SHORT_CONTEXT = 8  # max_length that splits PASSAGE into several rolling windows
PASSAGE = "ROMEO.\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun."


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("lm_eval_models")
    saved = {}
    for family in FAMILIES:
        saved[family] = root / family
        model = build_tiny(family, tokenizer)
        if hasattr(model.config, "num_inference_steps"):  # Cola, AURORA: 2 ODE steps a block instead of 16 (speed)
            model.config.num_inference_steps = 2
        model.save_pretrained(saved[family])
        save_tokenizer(tokenizer, saved[family])
    for name in CONVERTED:
        saved[name] = convert_fixture(name, root / name)
    return saved


@pytest.fixture(scope="module", autouse=True)
def cli_run(folders, tmp_path_factory):
    """`python -m hf_latentlm.eval.lm_eval` (lm-eval's CLI) on the sampled local task, started first; yields the
    running process and its output folder (stdout / stderr in files there)."""
    out = tmp_path_factory.mktemp("lm_eval_cli")
    command = [sys.executable, "-m", "hf_latentlm.eval.lm_eval", "--model", "hf-latentlm", "--model_args",
               f"pretrained={folders[CLI_FAMILY]}", "--tasks", "latentlm_continuation", "--include_path", str(TASKS),
               "--batch_size", "2", "--device", "cpu", "--output_path", str(out / "results"), "--log_samples"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env)
    yield process, out
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def adapters(folders):
    return {family: HFLatentLM(pretrained=str(folders[family]), batch_size=2, device="cpu") for family in MODELS}


@pytest.fixture(scope="module")
def hf_reference(folders):
    """lm-eval's own `hf` model on the AR checkpoint, at another batch size."""
    return HFLM(pretrained=str(folders["ar"]), device="cpu", batch_size=3)


def instances(request_type: str, arguments: list[tuple], task: str = "t") -> list[Instance]:
    return [Instance(request_type, {}, args, idx=0, metadata=(task, doc_id, 1)) for doc_id, args in enumerate(arguments)]


@torch.no_grad()
def hand_loglikelihood(model, ids: list[int], num_scored: int) -> tuple[float, bool]:
    """Σ log p of the last `num_scored` ids of `ids` (one forward on ids[:-1], log-softmax taken here)."""
    log_probs = torch.log_softmax(model(input_ids=torch.tensor([ids[:-1]])).logits[0].float(), -1)[-num_scored:]
    targets = torch.tensor(ids[-num_scored:])
    return float(log_probs.gather(1, targets[:, None]).sum()), bool((log_probs.argmax(-1) == targets).all())


def pair_ids(tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's split of a (context, continuation) pair without trailing spaces: the whole text's ids (BOS first for
    an empty context) and the continuation's number of ids."""
    if not context:
        tail = tokenizer.encode(continuation)
        return [tokenizer.bos_token_id, *tail], len(tail)
    whole = tokenizer.encode(context + continuation)
    return whole, len(whole) - len(tokenizer.encode(context))


def greedy_pair(model, tokenizer, context: str) -> tuple[str, str]:
    """(context, the text of the model's most likely next token), so that one pair is greedy (a context without
    trailing whitespace, which lm-eval would move into the continuation)."""
    with torch.no_grad():
        token = int(model(input_ids=torch.tensor([tokenizer.encode(context)])).logits[0, -1].argmax())
    continuation = tokenizer.decode([token])
    assert tokenizer.encode(context + continuation) == tokenizer.encode(context) + [token]
    return context, continuation


def generated_alone(model, tokenizer, prompt: str, seed: int, options: dict, max_new_tokens: int) -> str:
    """The decoded new tokens of the family's own generate() on `prompt` alone, with `seed` as its row seed."""
    ids = torch.tensor([tokenizer.encode(prompt)])
    option = getattr(model, "row_seeds_option", None)  # AR (transformers' generate): none
    seeds = {option: [seed]} if option else {}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         pad_token_id=tokenizer.pad_token_id, **options, **seeds)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def cut(text: str, stops: list[str]) -> str:
    for stop in stops:
        text = text.split(stop)[0]
    return text


def test_stop_strings_finish_each_row_on_its_own_new_tokens(tokenizer):
    prompt = tokenizer.encode("But soft")
    new = [tokenizer.encode(" what light"), tokenizer.encode(" through yonder")]
    width = max(map(len, new))
    sequences = torch.tensor([prompt + n + [tokenizer.pad_token_id] * (width - len(n)) for n in new])
    # "soft" is in the prompts only; "light" in row 0's new tokens; "yonder" in row 1's, but past its count.
    criteria = StopStringCriteria(tokenizer, ["soft", "light", "yonder"], len(prompt))
    counts = torch.tensor([len(new[0]), 1])
    assert criteria(sequences, None, num_new_tokens=counts).tolist() == [True, False]
    assert criteria(sequences, None).tolist() == [True, True], "without counts (transformers): every new column"
    again = StopStringCriteria(tokenizer, ["soft"], len(prompt))
    assert again(sequences, None).tolist() == [False, False]


def test_stop_strings_are_found_step_by_step_as_in_the_whole_text(tokenizer, validation_stream):
    """Fed one more token per call over a long row, the criterion (which decodes only the new tokens and a short
    lookback) flags the row at exactly the call where decoding the whole row first shows the stop string."""
    row = validation_stream[:400].tolist()
    text = tokenizer.decode(row)
    stop = text[-40:-34]  # near the end: far beyond the lookback from the start
    assert stop.strip() and text.index(stop) > 200
    first = next(n for n in range(1, len(row) + 1) if stop in tokenizer.decode(row[:n]))
    criteria = StopStringCriteria(tokenizer, [stop], prompt_width=1)
    sequences = torch.tensor([[tokenizer.bos_token_id] + row])
    flagged = [bool(criteria(sequences, None, num_new_tokens=torch.tensor([n]))[0]) for n in range(1, len(row) + 1)]
    assert flagged.index(True) + 1 == first and all(flagged[first - 1:])


def test_sampling_leaves_the_seeds_of_later_calls_alone(adapters):
    """AR draws from the global RNG inside a fork: a second identical call gives the same texts."""
    lm = adapters["ar"]
    requests = instances("generate_until", [(p, {**SAMPLED, "until": ["\n\n"], "max_gen_toks": 6})
                                            for p in PROMPTS])
    before = torch.initial_seed()
    first = lm.generate_until(requests)
    assert torch.initial_seed() == before
    assert lm.generate_until(requests) == first


def test_ar_samples_each_request_alike_at_any_batch_size(folders, adapters):
    """AR has no per-row seeds of its own: the adapter samples each row from its request's generator
    (`modeling.sampling.RowSampler`), so batch 3 gives the texts that batch 1 gives."""
    requests = instances("generate_until", [(p, {**SAMPLED, "until": ["\n\n"], "max_gen_toks": 8})
                                            for p in PROMPTS])
    alone = HFLatentLM(pretrained=str(folders["ar"]), batch_size=1, device="cpu")
    together = HFLatentLM(pretrained=str(folders["ar"]), batch_size=3, device="cpu")
    texts = together.generate_until(requests)
    assert alone.generate_until(requests) == texts
    other_seed = HFLatentLM(pretrained=str(folders["ar"]), batch_size=3, device="cpu", seed=12345)
    assert other_seed.generate_until(requests) != texts  # the texts are draws, not a fixed decoding


def test_ar_loglikelihoods_equal_lm_evals_own_hf_model(folders, adapters, hf_reference, tokenizer):
    ar = adapters["ar"]
    pairs = [*PAIRS, ("To be, or not to ", "be"), greedy_pair(ar.model, tokenizer, "ROMEO.")]
    requests = instances("loglikelihood", pairs)
    ours, theirs = ar.loglikelihood(requests), hf_reference.loglikelihood(requests)
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs] == [False] * 4 + [True]
    assert [value for value, _ in ours] == pytest.approx([value for value, _ in theirs], **LOGLIKELIHOOD_TOLERANCE)

    # A passage longer than the context: several rolling windows, in both models.
    short_ours = HFLatentLM(pretrained=str(folders["ar"]), batch_size=2, device="cpu", max_length=SHORT_CONTEXT)
    short_theirs = HFLM(pretrained=str(folders["ar"]), device="cpu", batch_size=2, max_length=SHORT_CONTEXT)
    assert len(tokenizer.encode(PASSAGE)) > 2 * SHORT_CONTEXT
    rolling = instances("loglikelihood_rolling", [(PASSAGE,), ("HAMLET.",)])
    assert short_ours.loglikelihood_rolling(rolling) == pytest.approx(short_theirs.loglikelihood_rolling(rolling),
                                                                      **LOGLIKELIHOOD_TOLERANCE)


def test_plm_loglikelihoods_are_its_encoders_next_token_log_probabilities(folders, adapters, tokenizer):
    plm = adapters["plm"]
    pairs = [*PAIRS, greedy_pair(plm.model, tokenizer, "HAMLET. To be")]
    expected = [hand_loglikelihood(plm.model, *pair_ids(tokenizer, *pair)) for pair in pairs]
    got = plm.loglikelihood(instances("loglikelihood", pairs))  # batch 2: right padding in the first batch
    assert [greedy for _, greedy in got] == [greedy for _, greedy in expected] == [False] * 3 + [True]
    assert [value for value, _ in got] == pytest.approx([value for value, _ in expected], **LOGLIKELIHOOD_TOLERANCE)

    # Rolling: one window (BOS + the passage) at the full context; lm-eval's disjoint windows of SHORT_CONTEXT tokens.
    tokens = tokenizer.encode(PASSAGE)
    assert plm.loglikelihood_rolling(instances("loglikelihood_rolling", [(PASSAGE,)])) == pytest.approx(
        [hand_loglikelihood(plm.model, [tokenizer.bos_token_id, *tokens], len(tokens))[0]], **LOGLIKELIHOOD_TOLERANCE)
    windows = [lm_eval_utils.make_disjoint_window(w) for w in
               lm_eval_utils.get_rolling_token_windows(tokens, tokenizer.bos_token_id, max_seq_len=SHORT_CONTEXT,
                                                                 context_len=1)]
    assert len(windows) > 2
    by_hand = sum(hand_loglikelihood(plm.model, context + continuation, len(continuation))[0]
                  for context, continuation in windows)
    short = HFLatentLM(pretrained=str(folders["plm"]), batch_size=2, device="cpu", max_length=SHORT_CONTEXT)
    assert short.loglikelihood_rolling(instances("loglikelihood_rolling", [(PASSAGE,)])) == pytest.approx(
        [by_hand], **LOGLIKELIHOOD_TOLERANCE)


@pytest.mark.parametrize("family", LATENT + CONVERTED)
def test_latent_families_refuse_token_likelihoods_by_name(adapters, family):
    lm = adapters[family]
    with pytest.raises(NotImplementedError, match=rf"the {family.removesuffix('-official')} family has no token likelihood.*generate_until"):
        lm.loglikelihood(instances("loglikelihood", PAIRS[:1]))
    with pytest.raises(NotImplementedError, match=rf"the {family.removesuffix('-official')} family has no token likelihood.*generate_until"):
        lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(PASSAGE,)]))


@pytest.mark.parametrize("family", MODELS)
def test_generate_until_is_the_familys_own_generate_cut_at_the_first_stop_string(adapters, family, tokenizer,
                                                                                  monkeypatch):
    lm, max_new = adapters[family], 16
    # AR's generate has no per-row seeds (sampled rows depend on their batch): its greedy decoding is compared.
    options = dict(SAMPLED) if getattr(lm.model, "row_seeds_option", None) else {"do_sample": False}
    seeds = lm.request_seeds(instances("generate_until", [(p, {}) for p in PROMPTS]))
    full = [generated_alone(lm.model, tokenizer, p, s, options, max_new) for p, s in zip(PROMPTS, seeds)]
    # A stop string that the first row really generates, a quarter of the way into its text.
    quarter = len(full[0]) // 4
    stop = full[0][quarter:quarter + 2]
    expected = [cut(text, [stop, "<|endoftext|>"]) for text in full]
    assert len(expected[0]) < len(full[0])
    requests = instances("generate_until", [(p, {**options, "until": [stop], "max_gen_toks": max_new})
                                            for p in PROMPTS])
    assert lm.request_seeds(requests) == seeds, "seeds depend on the task, document and index only"
    assert lm.generate_until(requests) == expected  # batch 2: the two longest prompts together, left padded

    # The stop string also ends generation: the first request alone makes fewer than max_gen_toks tokens.
    new_widths, generate = [], lm.model.generate

    def measured(**kwargs):
        out = generate(**kwargs)
        new_widths.append(out.shape[1] - kwargs["input_ids"].shape[1])
        return out

    monkeypatch.setattr(lm.model, "generate", measured)
    assert lm.generate_until(requests[:1]) == expected[:1]
    assert new_widths[0] < max_new


@pytest.mark.parametrize("family", MODELS)
def test_greedy_generation_runs_on_every_family_as_its_own_greedy_generate(adapters, family, tokenizer):
    """The greedy task as written (do_sample false), and lm-eval's default for a task that sets no decoding: every
    family runs them, giving what its own generate(do_sample=False) gives on the prompt alone."""
    lm, max_new = adapters[family], 8
    seed = lm.request_seeds(instances("generate_until", [("ROMEO.", {})], task="latentlm_continuation_greedy"))[0]
    expected = cut(generated_alone(lm.model, tokenizer, "ROMEO.", seed, {"do_sample": False}, max_new), ["\n"])
    for gen_kwargs in ({"until": ["\n"], "do_sample": False}, {"until": ["\n"]}):
        requests = instances("generate_until", [("ROMEO.", {**gen_kwargs, "max_gen_toks": max_new})],
                             task="latentlm_continuation_greedy")
        assert lm.generate_until(requests) == [expected], gen_kwargs


def test_model_args_are_checked_by_name(folders):
    with pytest.raises(ValueError, match=r"unknown model_args \['revison'\]"):
        HFLatentLM(pretrained=str(folders["ar"]), revison="main")
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 'auto'"):
        HFLatentLM(pretrained=str(folders["ar"]), batch_size="auto")


@pytest.fixture(scope="module")
def manager():
    return TaskManager(include_path=str(TASKS), include_defaults=False)


def sample_texts(results: dict, task: str) -> list[str]:
    return [s["resps"][0][0] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module")
def latent_evaluation(folders, manager):
    return lm_eval.simple_evaluate(model="hf-latentlm", model_args=f"pretrained={folders[CLI_FAMILY]}",
                                   tasks=["latentlm_continuation"], task_manager=manager, batch_size=2, device="cpu",
                                   log_samples=True)


def test_simple_evaluate_runs_the_local_tasks_by_model_name(folders, adapters, hf_reference, manager,
                                                            latent_evaluation, tokenizer):
    docs = [json.loads(line) for line in (TASKS / "continuation.jsonl").read_text().splitlines()]
    # A latent family on the sampled task: each document's text is its generate() with the documented seed.
    model = adapters[CLI_FAMILY].model
    expected = [cut(generated_alone(model, tokenizer, doc["prompt"], stable_int(
        "lm_eval", LM_EVAL_TORCH_SEED, "latentlm_continuation", doc_id, 0, 0), SAMPLED, 8), ["\n", "<|endoftext|>"])
        for doc_id, doc in enumerate(docs)]
    assert sample_texts(latent_evaluation, "latentlm_continuation") == expected
    assert latent_evaluation["results"]["latentlm_continuation"]["exact_match,none"] == pytest.approx(
        sum(t == d["answer"] for t, d in zip(expected, docs)) / len(docs))

    # AR on the greedy task and the multiple-choice task.
    results = lm_eval.simple_evaluate(model="hf-latentlm", model_args=f"pretrained={folders['ar']}",
                                      tasks=["latentlm_continuation_greedy", "latentlm_choice"], task_manager=manager,
                                      batch_size=2, device="cpu", log_samples=True)
    greedy = [cut(generated_alone(adapters["ar"].model, tokenizer, d["prompt"], 0, {"do_sample": False}, 8),
                  ["\n", "<|endoftext|>"]) for d in docs]
    assert sample_texts(results, "latentlm_continuation_greedy") == greedy
    choices = [json.loads(line) for line in (TASKS / "choice.jsonl").read_text().splitlines()]
    correct = []
    for doc_id, doc in enumerate(choices):
        scores = [value for value, _ in hf_reference.loglikelihood(
            instances("loglikelihood", [(doc["question"], f" {choice}") for choice in doc["choices"]]))]
        logged = next(s for s in results["samples"]["latentlm_choice"] if s["doc_id"] == doc_id)
        assert [r[0][0] for r in logged["resps"]] == pytest.approx(scores, **LOGLIKELIHOOD_TOLERANCE)
        correct.append(max(range(len(scores)), key=scores.__getitem__) == doc["label"])
    assert results["results"]["latentlm_choice"]["acc,none"] == pytest.approx(sum(correct) / len(correct))


def test_lm_evals_command_line_gives_the_in_process_results(cli_run, latent_evaluation):
    process, out = cli_run
    process.wait(timeout=300)
    stderr = (out / "stderr").read_text()
    assert process.returncode == 0, stderr[-3000:]
    table = (out / "stdout").read_text()
    assert "|latentlm_continuation|" in table and "exact_match" in table
    (samples,) = (out / "results").rglob("samples_latentlm_continuation_*.jsonl")
    logged = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in logged] == sample_texts(latent_evaluation, "latentlm_continuation")


def test_hf_latentlm_lm_eval_passes_every_argument_to_lm_evals_command_line(run_cli, monkeypatch):
    seen = []
    monkeypatch.setattr("hf_latentlm.eval.lm_eval.main", lambda argv: seen.append(argv) or 0)
    argv = ["--model", "hf-latentlm", "--model_args", "pretrained=DIR", "--tasks", "t", "-h"]
    code, _, _ = run_cli("lm-eval", *argv)
    assert (code, seen) == (0, [argv])


@pytest.mark.parametrize("family", MODELS)
def test_repeats_of_one_request_draw_their_own_samples(adapters, family):
    """lm-eval runs a task with `repeats: N` by listing the same request object N times: each copy gets its own seed,
    so a sampled request's copies are independent draws, not one text N times."""
    lm = adapters[family]
    (request,) = instances("generate_until", [(PROMPTS[1], {**SAMPLED, "until": ["<|endoftext|>"], "max_gen_toks": 12})])
    first, second = lm.request_seeds([request, request])
    assert first != second
    texts = lm.generate_until([request, request])
    assert len(texts) == 2 and texts[0] != texts[1]
