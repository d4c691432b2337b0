"""A KL term that holds a model's encoder pass near the frozen causal LM it started from (`train` and `sft`
with `--init-from SRC --encoder-kl-weight W`).

A PLM started from a pretrained AR model shares every backbone weight between its encoder and its decoder, so the
decoder's loss moves the encoder away from the source. `EncoderKL` adds W · KL(source ‖ encoder), the mean over the
training rows' positions of the KL between the source's next-token distribution and the encoder's, to the training
loss. The source runs without gradient; it is a plain module beside the prepared model (no parameters to train,
so DDP and FSDP leave it alone), on the same device and under the same autocast as the training forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_kl(logits: torch.Tensor, reference_logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions of KL(reference ‖ model) between the softmaxes of `reference_logits` and `logits`
    ([..., V] each), computed in float32; `mask` [...] (1: counted), e.g. an attention mask, leaves padding out (its
    positions are dropped before the softmax, so whatever they hold, even non-finite values, cannot reach the loss)."""
    if mask is not None:
        keep = mask.bool()
        logits, reference_logits = logits[keep], reference_logits[keep]
    log_q = F.log_softmax(logits.float(), dim=-1)
    log_p = F.log_softmax(reference_logits.float(), dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).mean()


class EncoderKL:
    """`weight` · KL(source ‖ encoder) on the encoder logits of a training forward (`logits` of the model output,
    the plain causal pass over the same rows)."""

    def __init__(self, source: torch.nn.Module, weight: float):
        if weight <= 0:
            raise ValueError(f"encoder_kl_weight must be positive to add a KL term, got {weight}")
        self.source = source.eval().requires_grad_(False)
        self.weight = float(weight)

    def add_to(self, output, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The training loss with the KL term over the positions of `input_ids` [B, T] added (every position of
        packed rows; with `attention_mask`, the attended ones), and the parts to log beside the model's own (`loss`:
        the total; `encoder_kl`: the KL before weighting)."""
        with torch.no_grad():
            reference = self.source(input_ids=input_ids, attention_mask=attention_mask).logits
        kl = token_kl(output.logits, reference, attention_mask)
        loss = output.loss + self.weight * kl
        return loss, {"loss": loss.detach().float(), "encoder_kl": kl.detach().float()}


__all__ = ["EncoderKL", "token_kl"]
