"""`AutoModel` on a causal-LM checkpoint of every family: the backbone, loaded quietly (no "UNEXPECTED" load report
for the head's own parts), with the same weights the causal LM holds."""

import pytest
import torch
from transformers import AutoModel

from hf_latentlm.families import FAMILIES, build_model

def components(family, tokenizer, root):
    folders = {}
    for name, source in FAMILIES[family].components.items():
        torch.manual_seed(0)
        build_model(source, "tiny", tokenizer).save_pretrained(root / source)
        folders[name] = str(root / source)
    return folders


@pytest.mark.parametrize("family", ["plm", "calm", "cola", "aurora"])
def test_automodel_on_a_causal_lm_checkpoint_loads_the_backbone_without_a_load_report(tmp_path, tokenizer, family,
                                                                                      capfd):
    torch.manual_seed(0)
    model = build_model(family, "tiny", tokenizer, **components(family, tokenizer, tmp_path))
    model.save_pretrained(tmp_path / "model")
    capfd.readouterr()
    backbone, info = AutoModel.from_pretrained(tmp_path / "model", output_loading_info=True)
    printed = "".join(capfd.readouterr())
    assert type(backbone).__name__ == type(model.base_model).__name__
    assert not info["unexpected_keys"] and not info["missing_keys"] and not info["mismatched_keys"], info
    assert "UNEXPECTED" not in printed and "LOAD REPORT" not in printed, printed
    expected = model.base_model.state_dict()
    for name, value in backbone.state_dict().items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0, msg=name)
