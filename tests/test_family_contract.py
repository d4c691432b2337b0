"""Every multi-token language-model family of the registry, held to one contract (tests/family_contract.py):
batched == alone, EOS and min_new_tokens, streamer, transformers' length defaults, bad input named, the harness's
call counting, a checkpoint that loads without the package, and the CLI round trip."""

import pytest

import family_contract as contract

FAMILY_NAMES = contract.multi_token_families()


def test_the_registry_has_multi_token_families():
    assert {"plm", "calm"} <= set(FAMILY_NAMES)


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(family, tokenizer):
    return contract.build_tiny(family, tokenizer).eval()


def test_batched_rows_match_running_each_alone(model, tiny_rows, tokenizer, left_pad):
    contract.check_batched_rows_match_running_each_alone(model, tiny_rows, tokenizer, left_pad)


def test_eos_stops_a_row_and_pads_it(model, tiny_rows, tokenizer):
    contract.check_eos_stops_a_row_and_pads_it(model, tiny_rows, tokenizer)


def test_streamer_receives_prompt_then_every_new_token(model, tiny_rows, streamer):
    contract.check_streamer_receives_prompt_then_every_new_token(model, tiny_rows, streamer)


def test_lengths_follow_transformers_defaults(model, tiny_rows):
    contract.check_lengths_follow_transformers_defaults(model, tiny_rows)


def test_bad_input_is_named(model, tiny_rows):
    contract.check_bad_input_is_named(model, tiny_rows)


def test_harness_counts_model_calls(model, tiny_rows):
    contract.check_harness_counts_model_calls(model, tiny_rows)


def test_checkpoint_loads_without_the_package(model, tokenizer, tmp_path, isolated_generate):
    contract.check_checkpoint_loads_without_the_package(model, tokenizer, tmp_path, isolated_generate)


def test_cli_round_trip(family, tmp_path, run_cli):
    contract.check_cli_round_trip(family, tmp_path, run_cli)


def test_hidden_states_and_attentions(model, tiny_rows):
    contract.check_hidden_states_and_attentions(model, tiny_rows)


def test_return_dict_false_gives_tuples(model, tiny_rows):
    contract.check_return_dict_false_gives_tuples(model, tiny_rows)


def test_past_key_values_is_a_deprecated_alias_of_cache(model, tiny_rows):
    contract.check_past_key_values_is_a_deprecated_alias_of_cache(model, tiny_rows)


def test_base_model_takes_input_ids_and_padding(model, tiny_rows, left_pad):
    contract.check_base_model_takes_input_ids_and_padding(model, tiny_rows, left_pad)


def test_unknown_forward_arguments_are_refused(model, tiny_rows):
    contract.check_unknown_forward_arguments_are_refused(model, tiny_rows)
