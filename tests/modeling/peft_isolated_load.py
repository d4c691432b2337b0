"""Run with `python -S`: reload a LoRA adapter with `peft.AutoPeftModelForCausalLM` (its base model is a checkpoint
folder with remote code) while `hf_latentlm` is NOT importable, merge it, and print as JSON the module of the merged
model, its output on the prompt (`logits` if the model has an LM head, else `last_hidden_state`) and the tokens it
generates.

argv: purelib platlib adapter_dir prompt_json max_new_tokens generate_options_json
"""

import json
import sys

from without_package import assert_package_not_loaded, block_package

purelib, platlib, adapter, prompt, max_new, options = sys.argv[1:7]
block_package(purelib, platlib)

import torch  # noqa: E402
from peft import AutoPeftModelForCausalLM  # noqa: E402

peft_model = AutoPeftModelForCausalLM.from_pretrained(adapter, trust_remote_code=True)
merged = peft_model.merge_and_unload().eval()
assert_package_not_loaded()
ids = torch.tensor(json.loads(prompt))
with torch.no_grad():
    out = merged(input_ids=ids)
name = "logits" if getattr(out, "logits", None) is not None else "last_hidden_state"
tokens = merged.generate(ids, max_new_tokens=int(max_new), **json.loads(options))
print(json.dumps({"module": type(merged).__module__, "peft_class": type(peft_model).__name__,
                  "lora_layers": sum("lora" in n for n, _ in merged.named_modules()),
                  "output": name, "values": getattr(out, name).tolist(), "tokens": tokens[0, ids.shape[1]:].tolist()}))
