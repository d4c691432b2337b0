"""AR vs PLM (k_pred=8) after SFT on the count task, batch 1, in one process (first 8 test prompts, as the bench).

    python scripts/speed_post_training_count.py   # needs runs/count2/{ar,plm}/sft (docs/post_training.md)
"""
import json
from hf_latentlm.eval.task import evaluate_task
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.training.tasks import load_task
test = load_task('count', split_sizes={'train': 1, 'test': 100})['test']
ar, t = load_model_and_tokenizer('runs/count2/ar/sft')
plm, _ = load_model_and_tokenizer('runs/count2/plm/sft')
rows = {}
for label, model, options in [('ar', ar, {}), ('plm k8 exact', plm, {'k_pred': 8}),
                              ('plm k8 nucleus', plm, {'k_pred': 8, 'acceptance': 'nucleus'})]:
    r = evaluate_task(model, t, test, batch_size=8, speed_prompts=8, generate_kwargs=options)
    rows[label] = {k: r[k] for k in ('accuracy', 'mean_answer_tokens', 'tokens_per_call_batch_1', 'tokens_per_s_batch_1')}
for label, r in rows.items():
    r['x_ar'] = r['tokens_per_s_batch_1'] / rows['ar']['tokens_per_s_batch_1']
print(json.dumps(rows, indent=1))
