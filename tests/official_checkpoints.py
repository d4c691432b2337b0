"""The converted official checkpoints that the tool tests (lm-eval, serving, push, pipeline, sft) run next to the
registry's families: official-format fixtures written by the official code, converted by `hf-latentlm convert`."""

from pathlib import Path

import hf_latentlm
from hf_latentlm.official.convert import convert_calm, convert_cola

FIXTURES = Path(__file__).parent / "fixtures" / "official"
PACKAGE_TOKENIZER = Path(hf_latentlm.__file__).parent / "data" / "tokenizer"
#: The names converted models go by next to the families: the vocab-4096 fixtures, with the package's tokenizer.
CONVERTED_CALM, CONVERTED_COLA = "calm-official", "cola-official"
CONVERTED = (CONVERTED_CALM, CONVERTED_COLA)


def convert_calm_fixture(folder: Path, fixture: str = "calm_tools") -> Path:
    """The official-format CALM `fixture` converted into `folder`, with the package's tokenizer."""
    convert_calm(str(FIXTURES / fixture / "calm"), str(folder), tokenizer=str(PACKAGE_TOKENIZER))
    return folder


def convert_cola_fixture(folder: Path, fixture: str = "cola_tools") -> Path:
    """The official-format Cola DLM `fixture` converted into `folder`, with the package's tokenizer."""
    convert_cola(str(FIXTURES / fixture / "cola_vae"), str(FIXTURES / fixture / "cola_dit"), str(folder),
                 tokenizer=str(PACKAGE_TOKENIZER))
    return folder


def convert_fixture(name: str, folder: Path) -> Path:
    """The converted model `name` (one of CONVERTED) written into `folder`."""
    return {CONVERTED_CALM: convert_calm_fixture, CONVERTED_COLA: convert_cola_fixture}[name](folder)
