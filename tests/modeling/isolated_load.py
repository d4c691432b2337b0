"""Run with `python -S`: load a checkpoint through an Auto class with `hf_latentlm` NOT importable, generate (or,
for a backbone from `AutoModel`, run it), and print {"module": ..., "tokens": [...]} (or "hidden": the last hidden
state) as JSON.

argv: purelib platlib checkpoint auto_class prompt_json max_new_tokens generate_options_json
"""

import json
import sys

from without_package import assert_package_not_loaded, block_package

purelib, platlib, checkpoint, auto_class, prompt, max_new, options = sys.argv[1:8]
block_package(purelib, platlib)

import torch  # noqa: E402
import transformers  # noqa: E402

model = getattr(transformers, auto_class).from_pretrained(checkpoint, trust_remote_code=True).eval()
assert_package_not_loaded()
ids = torch.tensor(json.loads(prompt))
if model.can_generate():
    tokens = model.generate(ids, max_new_tokens=int(max_new), **json.loads(options))
    print(json.dumps({"module": type(model).__module__, "tokens": tokens[0, ids.shape[1]:].tolist()}))
else:
    with torch.no_grad():
        hidden = model(input_ids=ids).last_hidden_state
    print(json.dumps({"module": type(model).__module__, "class": type(model).__name__, "hidden": hidden.tolist()}))
