"""Run with `python -S`: for each checkpoint, build `transformers.pipeline("text-generation", trust_remote_code=True)`
with `hf_latentlm` NOT importable and print one JSON line per checkpoint with what the pipeline returned (continuation
only, full text, streamed text) and what the model's own generate() gives under the same global seed.

argv: purelib platlib prompt max_new_tokens checkpoint...
"""

import json
import sys

from without_package import assert_package_not_loaded, block_package

purelib, platlib, prompt, max_new = sys.argv[1:5]
block_package(purelib, platlib)

import torch  # noqa: E402
from transformers import TextIteratorStreamer, pipeline  # noqa: E402

max_new = int(max_new)
for checkpoint in sys.argv[5:]:
    pipe = pipeline("text-generation", model=checkpoint, trust_remote_code=True)
    assert_package_not_loaded()
    torch.manual_seed(0)
    continuation = pipe(prompt, max_new_tokens=max_new, return_full_text=False)[0]["generated_text"]
    torch.manual_seed(0)
    full = pipe(prompt, max_new_tokens=max_new)[0]["generated_text"]
    streamer = TextIteratorStreamer(pipe.tokenizer, skip_prompt=True)
    torch.manual_seed(0)
    pipe(prompt, max_new_tokens=max_new, streamer=streamer)
    streamed = "".join(streamer)
    # The reference: the model's generate() with only the length given, under the same seed.
    ids = pipe.tokenizer(prompt, return_tensors="pt")["input_ids"]
    torch.manual_seed(0)
    tokens = pipe.model.generate(ids, max_new_tokens=max_new)[0, ids.shape[1]:]
    print(json.dumps({"checkpoint": checkpoint, "module": type(pipe.model).__module__, "continuation": continuation,
                      "full": full, "streamed": streamed,
                      "generate": pipe.tokenizer.decode(tokens, skip_special_tokens=True)}))
