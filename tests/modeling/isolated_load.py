"""Run with `python -S`: load a checkpoint through an Auto class with `hf_latentlm` NOT importable, generate (or,
for a backbone from `AutoModel`, run it), and print {"module": ..., "tokens": [...]} (or "hidden": the last hidden
state) as JSON.

argv: purelib platlib checkpoint auto_class prompt_json max_new_tokens generate_options_json
"""

import importlib.abc
import json
import sys

purelib, platlib, checkpoint, auto_class, prompt, max_new, options = sys.argv[1:8]


class BlockPackage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "hf_latentlm" or name.startswith("hf_latentlm."):
            raise ImportError("hf_latentlm is deliberately not importable here")


sys.meta_path.insert(0, BlockPackage())
sys.path += [p for p in (purelib, platlib) if p not in sys.path]  # no .pth processing: no editable finder

import torch  # noqa: E402
import transformers  # noqa: E402

model = getattr(transformers, auto_class).from_pretrained(checkpoint, trust_remote_code=True).eval()
assert not [m for m in sys.modules if m.startswith("hf_latentlm")]
ids = torch.tensor(json.loads(prompt))
if model.can_generate():
    tokens = model.generate(ids, max_new_tokens=int(max_new), **json.loads(options))
    print(json.dumps({"module": type(model).__module__, "tokens": tokens[0, ids.shape[1]:].tolist()}))
else:
    with torch.no_grad():
        hidden = model(input_ids=ids).last_hidden_state
    print(json.dumps({"module": type(model).__module__, "class": type(model).__name__, "hidden": hidden.tolist()}))
