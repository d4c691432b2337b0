"""The converted official checkpoints that the tool tests (lm-eval, serving, push, pipeline, sft) run next to the
registry's families: official-format fixtures written by the official code, converted by `hf-latentlm convert`."""

from pathlib import Path

import hf_latentlm
from hf_latentlm.official.convert import convert_calm

FIXTURES = Path(__file__).parent / "fixtures" / "official"
PACKAGE_TOKENIZER = Path(hf_latentlm.__file__).parent / "data" / "tokenizer"
#: The name a converted CALM goes by next to the families: the vocab-4096 fixture, with the package's tokenizer.
CONVERTED_CALM = "calm-official"


def convert_calm_fixture(folder: Path, fixture: str = "calm_tools") -> Path:
    """The official-format CALM `fixture` converted into `folder`, with the package's tokenizer."""
    convert_calm(str(FIXTURES / fixture / "calm"), str(folder), tokenizer=str(PACKAGE_TOKENIZER))
    return folder
