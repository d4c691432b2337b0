"""Parallel Language Model (PLM, paper 002; method-specs §1) on the shared transformer core.

One set of weights, two modes:
- encoder  q(x_j | x_<j): a plain causal LM over token embeddings (`forward` without labels);
- decoder  p(x_j | x_<i_z, u_{i_z..j}): rows fed with auxiliary embeddings e_u, at the rotary position
  of the token they predict, reading the encoder's keys of the clean prefix and, causally, the rows of
  their own block.
Training runs [encoder rows; decoder rows] through one forward with one visibility mask. Generation is
quadratic decoding (paper Algorithm 1): one call scores K_pred verify rows and K_pred proposal blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils import ModelOutput
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .auxiliaries import (
    VoronoiSampler,
    decode_auxiliary,
    draw_auxiliary_in_cell,
    fixed_uniforms,
    sample_auxiliary_bank,
)
from .configuration_backbone import STATIC_ROPE_TYPES
from .configuration_plm import PLMConfig, check_acceptance
from .generation import (
    DecodingStep,
    GenerationOptions,
    MultiTokenGenerationMixin,
    row_seeds,
)
from .layers import (
    AttentionProbs,
    DecoderBlock,
    RMSNorm,
    RotaryEmbedding,
    causal_layout,
    decoder_layers,
    make_padding_position_ids,
    token_nll,
    visibility_mask,
)
from .modeling_backbone import (
    BackbonePreTrainedModel,
    check_backbone_inputs,
    check_forward_kwargs,
    head_forward,
)


@dataclass
class PLMOutput(ModelOutput):
    """`loss` is the normalised PLM objective (Eq. 8/9 + λ·alignment, divided by the number of scored
    encoder + decoder positions); the other scalars are its parts, logged by the training loop."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    decoder_logits: torch.Tensor | None = None
    cache: DynamicCache | None = None
    encoder_nll: torch.Tensor | None = None
    decoder_nll: torch.Tensor | None = None
    alignment_loss: torch.Tensor | None = None
    reconstructed_tokens: torch.Tensor | None = None
    auxiliary_tv: torch.Tensor | None = None  # mean TV of the fitted Voronoi cells (see `draw_auxiliaries`)
    mask_auxiliary_fraction: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class PLMModelOutput(BaseModelOutputWithPast):
    """`mid_residuals`: the residual stream between attention and MLP of the blocks in `capture_layers`, in that
    order (read by PLM's representation alignment)."""

    mid_residuals: tuple[torch.Tensor, ...] | None = None


class ObjectivePasses(NamedTuple):
    """What the objective's forward passes (`_two_passes` or `_joint_pass`) give `decoder_objective`: the logits of
    the encoder rows [B, T, V] and of the decoder rows [B, D, V], the captured (encoder, decoder) mid-layer residuals
    (None without alignment), the decoder rows' auxiliaries [B, D] and their TV distances (None when the caller gave
    the auxiliaries), and the encoder pass's output, whose hidden states and attentions the objective reports."""

    encoder_logits: torch.Tensor
    decoder_logits: torch.Tensor
    mid_residuals: tuple[torch.Tensor, torch.Tensor] | None
    auxiliaries: torch.Tensor
    auxiliary_tv: torch.Tensor | None
    encoder_output: PLMModelOutput


@dataclass
class AcceptanceRule:
    """When quadratic decoding keeps a pending (proposed) token x at a verify row with encoder distribution q.

    "exact": only when x equals the token the Voronoi sampler draws there, so decoding is lossless relative to
    one-token-per-call Voronoi sampling (identical tokens for the same auxiliaries; that sampler is a top-M
    truncation of the encoder's softmax). "epsilon": also when q(x) > `epsilon`. "nucleus": also when x
    lies inside the top-`nucleus` probability mass (the mass of tokens more likely than x is below it).
    """

    rule: str = "exact"
    epsilon: float = 2e-3
    nucleus: float = 0.94

    def __post_init__(self):
        check_acceptance(self.rule, self.epsilon, self.nucleus)

    def accepts(self, pending: torch.Tensor, sampled: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """pending, sampled [B, W]; logits [B, W, V] of the verify rows that score them -> bool [B, W]."""
        accept = pending == sampled
        if self.rule == "exact":
            return accept
        probs = logits.softmax(-1)
        p_pending = probs.gather(-1, pending[..., None]).squeeze(-1)
        if self.rule == "epsilon":
            return accept | (p_pending > self.epsilon)
        above = (probs * (probs > p_pending[..., None])).sum(-1)
        return accept | (above < self.nucleus)


@dataclass
class PLMGenerationOptions(GenerationOptions):
    """PLM's own `generate()` options (next to the transformers ones the shared skeleton honours).

    decoding: "quadratic" (paper Algorithm 1: K_pred verify rows + K_pred proposal blocks per call) or "voronoi"
        (one token per call through the same Voronoi sampler; the lossless reference).
    k_pred / acceptance ("exact" | "epsilon" | "nucleus") / acceptance_epsilon / acceptance_nucleus: default to
        the config's values. "exact" yields exactly the tokens of "voronoi" decoding for the same auxiliary draws.
    auxiliary_seeds: one int per row; row b draws its auxiliary u_t (t = generated index) from a generator seeded
        with it, so a row gives the same tokens alone or in any batch. Default: seeds drawn from the global torch
        RNG (`torch.manual_seed` makes runs repeatable).
    do_sample: True (default) samples through Voronoi auxiliaries at temperature 1 over the top-`auxiliary_top_m`
        tokens; False decodes greedily: each verify row's token is the encoder's argmax, so "exact" acceptance gives
        exactly the tokens of greedy one-token-per-call decoding of the encoder. temperature / top_k / top_p: only
        their plain values (1.0 / 0 / 1.0).
    """

    family: ClassVar[str] = "PLM"
    row_seeds_option: ClassVar[str] = "auxiliary_seeds"

    decoding: str = "quadratic"
    k_pred: int | None = None
    acceptance: str | None = None
    acceptance_epsilon: float | None = None
    acceptance_nucleus: float | None = None
    auxiliary_seeds: list[int] | None = None
    acceptance_rule: AcceptanceRule | None = None  # filled by `resolved`

    def resolved(self, config: PLMConfig, batch_size: int) -> "PLMGenerationOptions":
        """Defaults from `config`, every value checked (ValueError naming the option), one seed per row."""
        for name, plain in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0)):
            if getattr(self, name) not in (None, plain):
                raise ValueError(f"{name} is not supported by PLM generate (Voronoi sampling is at temperature 1 "
                                 f"over the top-{config.auxiliary_top_m} tokens)")
        if self.decoding not in ("quadratic", "voronoi"):
            raise ValueError(f"decoding must be 'quadratic' or 'voronoi', got {self.decoding!r}")
        k_pred = config.k_pred if self.k_pred is None else self.k_pred
        if not 1 <= k_pred <= config.block_size:
            raise ValueError(f"k_pred must be between 1 and block_size={config.block_size}, got {k_pred}")
        rule = AcceptanceRule(
            config.acceptance if self.acceptance is None else self.acceptance,
            config.acceptance_epsilon if self.acceptance_epsilon is None else self.acceptance_epsilon,
            config.acceptance_nucleus if self.acceptance_nucleus is None else self.acceptance_nucleus)
        return replace(self, k_pred=k_pred, acceptance=rule.rule, acceptance_rule=rule,
                       auxiliary_seeds=row_seeds(self.auxiliary_seeds, batch_size, "auxiliary_seeds"))

    @classmethod
    def sampling_defaults(cls, config: PLMConfig) -> dict:
        return {"do_sample": True, "temperature": 1.0}


@dataclass
class PLMDecodingState:
    """What quadratic decoding carries from one call to the next, per row."""

    cache: DynamicCache  # keys of the prompt and of the verify rows kept so far
    key_valid: torch.Tensor  # [B, S] False for padding and for verify rows rejected in this row only
    last_token: torch.Tensor  # [B] last committed token (input of the first verify row)
    next_pos: torch.Tensor  # [B] position of the next token to commit
    pending: torch.Tensor  # [B, width - 1] proposed tokens awaiting verification
    pending_ok: torch.Tensor  # [B] False until a proposal exists (first round)
    aux_table: torch.Tensor  # [B, max_new_tokens + 2 width] auxiliary index u_t per generated index t
    decoder: "QuadraticDecoder"  # what stays the same for every call


class QuadraticDecoder:
    """Quadratic decoding (paper Algorithm 1), one model call at a time: the rows of a call (`call_inputs`), the
    verification of the pending tokens (`verify`) and what a call commits (`advance`). It holds what is fixed for
    one `generate()`; what changes between calls is the `PLMDecodingState`.

    width: K_pred verify rows per call (1 for one-token-per-call Voronoi decoding); propose: also run the width²
    proposal rows. sites: (LM-head weight, auxiliary bank), the cells' sites for `sampler`.

    Verify row r (0 <= r < width) reads token x_{i-1+r} at position i-1+r. Proposal row (m, k) (0 <= m, k < width)
    predicts x_{i+m+k} from the auxiliary u_{i+m+k}, reading the clean prefix x_<i+m, that is the cached keys and
    verify rows r <= m, and the rows (m, k' <= k) of its own block. Every valid cached key lies before i, so every
    row sees all of them, and only the mask among the call's own rows (`local_mask`) differs between rows.
    """

    def __init__(self, width: int, propose: bool, acceptance: AcceptanceRule, sampler: VoronoiSampler,
                 sites: tuple[torch.Tensor, torch.Tensor], device, greedy: bool = False):
        self.width, self.acceptance, self.sampler, self.sites = width, acceptance, sampler, sites
        self.greedy = greedy
        self.propose = propose and width > 1  # width 1 leaves no room for pending tokens
        r = torch.arange(width, device=device)
        m, k = (t.reshape(-1) for t in torch.meshgrid(r, r, indexing="ij"))
        if not self.propose:  # the verify rows only
            m, k = m[:0], k[:0]
        sees_verify = torch.cat([r[:, None] >= r[None, :], m[:, None] >= r[None, :]])
        sees_proposal = torch.cat([torch.zeros(width, m.numel(), dtype=torch.bool, device=device),
                                   (m[:, None] == m[None, :]) & (k[:, None] >= k[None, :])])
        self.row_offset = torch.cat([r - 1, m + k])  # position of each row minus i
        self.proposal_offset = m + k  # generated-index offset of each proposal row's auxiliary
        self.local_mask = torch.cat([sees_verify, sees_proposal], dim=1)  # which of the call's rows each row sees

    def call_inputs(self, state: PLMDecodingState, count: torch.Tensor):
        """The call's token inputs [B, width], auxiliary inputs [B, width²] (None without proposals), position ids and
        boolean visibility mask [B, 1, rows, cached + rows]; count [B]: tokens committed so far per row."""
        tokens = torch.cat([state.last_token[:, None], state.pending], dim=1)
        aux = state.aux_table.gather(1, count[:, None] + self.proposal_offset) if self.propose else None
        batch, rows = tokens.shape[0], self.row_offset.numel()
        mask = torch.cat([state.key_valid[:, None, None, :].expand(-1, 1, rows, -1),
                          self.local_mask[None, None].expand(batch, 1, -1, -1)], dim=-1)
        return tokens, aux, state.next_pos[:, None] + self.row_offset, mask

    def verify(self, q: torch.Tensor, aux: torch.Tensor, pending: torch.Tensor, pending_ok: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Voronoi samples [B, W] of the verify rows (q [B, W, V], their auxiliaries `aux` [B, W]) and the number
        m [B] of pending tokens accepted before the first rejection.

        Only the rows up to each row's first rejection are used: the accepted ones and the commit row m. A row with
        three or more open candidates needs a fit of its cells, and such rows mostly come after a wrong pending token,
        that is after the rejection. So those rows are fitted only when a row's m reaches one (an unfitted row, -1,
        matches no pending token; the relaxed rules may still accept it). The cells of a row depend only on its
        logits, so the committed tokens are those of fitting every row."""
        batch, width, _ = q.shape
        if self.greedy:  # the encoder's argmax: lossless relative to greedy decoding of the encoder
            sampled = q.argmax(-1)
            return sampled, self.accepted(pending, sampled, q, pending_ok)
        flat_q, flat_aux = q.reshape(batch * width, -1), aux.reshape(-1)
        ranked = self.sampler.candidates(flat_q)  # candidates and capacities of every row, computed once
        sampled = torch.full_like(flat_aux, -1)
        rows = torch.arange(batch * width, device=q.device)
        if width > 1 and ranked is not None:
            rows = rows[(ranked[1] > 0).sum(dim=1) <= 2]
        commit_row = torch.arange(batch, device=q.device) * width
        while True:
            if rows.numel():
                sampled[rows] = self.sample_rows(flat_q, flat_aux, rows, ranked)
            accepted = self.accepted(pending, sampled.view(batch, width), q, pending_ok)
            commit = commit_row + accepted
            rows = commit[sampled[commit] < 0]
            if rows.numel() == 0:
                return sampled.view(batch, width), accepted

    def accepted(self, pending: torch.Tensor, sampled: torch.Tensor, q: torch.Tensor, pending_ok: torch.Tensor
                 ) -> torch.Tensor:
        """[B] pending tokens kept before each row's first rejection (sampled [B, W], q [B, W, V])."""
        if self.width == 1:
            return torch.zeros(sampled.shape[0], dtype=torch.long, device=sampled.device)
        accept = self.acceptance.accepts(pending, sampled[:, :-1], q[:, :-1]) & pending_ok[:, None]
        return accept.long().cumprod(1).sum(1)

    def sample_rows(self, flat_q, flat_aux, rows, ranked) -> torch.Tensor:
        """The Voronoi tokens f(u; q) of the flat verify rows `rows`."""
        # Inference mode: the fit is hundreds of small ops at decode sizes, and it trims their dispatch.
        with torch.inference_mode():
            owners = self.sampler.decoding_cells(flat_q[rows], *self.sites,
                                                 None if ranked is None else (ranked[0][rows], ranked[1][rows]))
            return decode_auxiliary(owners, flat_aux[rows])

    def advance(self, state: PLMDecodingState, logits: torch.Tensor, count: torch.Tensor) -> DecodingStep:
        """Verify the pending tokens with the call's `logits` [B, rows, V], commit m + 1 tokens per row and update
        `state` for the next call."""
        width, batch = self.width, logits.shape[0]
        q = logits[:, :width]  # [B, width, V]: q(. | x_<i+r)
        index = count[:, None] + torch.arange(width, device=q.device)  # generated index of each verify row
        sampled, accepted = self.verify(q, state.aux_table.gather(1, index), state.pending, state.pending_ok)
        committed = torch.cat([state.pending, state.pending.new_zeros(batch, 1)], dim=1)
        committed.scatter_(1, accepted[:, None], sampled.gather(1, accepted[:, None]))

        # Keep the keys of verify rows r <= m (their inputs are committed tokens); drop the proposal keys and the
        # verify keys rejected in every row, and mark those rejected in some rows only as invalid.
        kept, num_rows = 1 + int(accepted.max()), logits.shape[1]
        if num_rows > kept:
            state.cache.crop(-(num_rows - kept))
        state.key_valid = torch.cat([state.key_valid, torch.arange(kept, device=q.device) <= accepted[:, None]], 1)
        state.last_token = committed.gather(1, accepted[:, None]).squeeze(1)
        state.next_pos = state.next_pos + accepted + 1
        if self.propose:
            proposals = logits[:, width:].argmax(-1).view(batch, width, width)  # [B, m, k]
            state.pending = proposals.gather(1, accepted[:, None, None].expand(-1, 1, width)).squeeze(1)[:, 1:]
        state.pending_ok = torch.full((batch,), self.propose, dtype=torch.bool, device=q.device)
        return DecodingStep(committed, accepted + 1)


class PLMPreTrainedModel(BackbonePreTrainedModel):
    config_class = PLMConfig
    _can_record_outputs = {"hidden_states": DecoderBlock, "attentions": OutputRecorder(AttentionProbs)}
    # The inference forward compiles with fullgraph=True, and so does the objective (labels) with the default
    # block_stride = block_size (tests/modeling/test_compile.py); with block_stride != block_size the number of
    # decoder rows depends on the random phase (see `block_layout`).
    _can_compile_fullgraph = True

    def check_vocab_resize(self, size: int) -> None:
        """A vocabulary smaller than `auxiliary_top_m` is refused: the config could then not be loaded again."""
        if size < self.config.auxiliary_top_m:
            raise ValueError(f"cannot resize the token embeddings to {size}: PLMConfig.auxiliary_top_m "
                             f"({self.config.auxiliary_top_m}) must not exceed vocab_size; lower auxiliary_top_m first")

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, PLMModel):
            module.mask_auxiliary.normal_(0.0, std)
            # The bank is a pure function of its seed, so re-deriving it equals loading it.
            module.auxiliary_bank.copy_(sample_auxiliary_bank(self.config.num_auxiliaries, self.config.hidden_size,
                                                              self.config.auxiliary_seed))


class PLMModel(PLMPreTrainedModel):
    """The shared backbone: embeddings for both modes, decoder blocks, final norm."""

    # The causal LM's own parts, which `AutoModel` on its checkpoint leaves out on purpose: not reported as
    # unexpected keys (the README's backbone snippet loads quietly).
    _keys_to_ignore_on_load_unexpected = [r"^(lm_head|alignment_proj)(\.|$)"]

    def __init__(self, config: PLMConfig):
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        # Fixed random unit vectors e_u (never trained, saved with the weights), read in through a learned map
        # (`auxiliary_projection`, which trains better than the paper's direct e_u) or as they are: everything above
        # the embeddings is shared.
        self.register_buffer("auxiliary_bank", sample_auxiliary_bank(config.num_auxiliaries, d, config.auxiliary_seed))
        self.auxiliary_proj = nn.Linear(d, d, bias=False) if config.auxiliary_projection else None
        self.mask_auxiliary = nn.Parameter(torch.zeros(d))
        self.layers = decoder_layers(config)
        self.norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary = RotaryEmbedding.from_config(config)
        self.gradient_checkpointing = False
        self.post_init()

    def embed_auxiliaries(self, aux_index: torch.Tensor) -> torch.Tensor:
        """Decoder input for auxiliary indices [...]; index −1 reads the learned mask auxiliary."""
        e_u = self.auxiliary_bank[aux_index.clamp(min=0)].to(self.mask_auxiliary.dtype)
        embedded = e_u if self.auxiliary_proj is None else self.auxiliary_proj(e_u)
        return torch.where((aux_index >= 0)[..., None], embedded, self.mask_auxiliary.to(embedded.dtype))

    @deprecate_kwarg("past_key_values", version="5.40.0", new_name="cache")
    @capture_outputs
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: DynamicCache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                capture_layers: tuple[int, ...] = (), **kwargs) -> PLMModelOutput:
        """The causal encoder over `input_ids` (or `inputs_embeds`), as transformers' base models.

        attention_mask: a 2-D padding mask over cached + new tokens (1 = real token), or a ready boolean
            [B, 1, Tq, Tk] visibility mask (PLM training and quadratic decoding), which needs explicit `position_ids`.
        capture_layers: blocks whose mid residual (between attention and MLP) is returned in `mid_residuals`.
        `output_hidden_states` / `output_attentions` (the latter with attn_implementation="eager") are recorded by
        transformers' output capturing (`_can_record_outputs`).
        """
        check_backbone_inputs(self, kwargs, input_ids=input_ids, inputs_embeds=inputs_embeds)
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, length = hidden.shape[:2]
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is not None and attention_mask.dim() == 4:
            mask = attention_mask.bool()
            if position_ids is None:
                raise ValueError("a 4-D attention_mask needs explicit position_ids")
        else:
            position_ids, mask = causal_layout(attention_mask, batch, length, past, hidden.device, position_ids)
        cos, sin = self.rotary(position_ids, dtype=hidden.dtype)
        captured = {}
        for index, layer in enumerate(self.layers):
            if index in capture_layers:
                hidden, captured[index] = layer(hidden, cos, sin, mask, cache=cache, return_mid=True)
            else:
                hidden = layer(hidden, cos, sin, mask, cache=cache)
        return PLMModelOutput(last_hidden_state=self.norm(hidden), cache=cache,
                              mid_residuals=tuple(captured[i] for i in capture_layers) or None)


class PLMForCausalLM(PLMPreTrainedModel, MultiTokenGenerationMixin):
    """PLM with an LM head. `forward(input_ids)` is the encoder (an ordinary causal LM, so NLL,
    PEFT and TRL work unchanged); `forward(input_ids, labels=...)` is the PLM training objective;
    `generate()` is quadratic decoding (or one-token-per-call Voronoi sampling with
    `decoding="voronoi"`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Tied to the vocabulary-sharded embedding, so sharded with it, as Llama's head.
    _tp_plan = {"lm_head": "colwise_gather_output"}
    generation_options_class = PLMGenerationOptions
    base_model_class = PLMModel

    def __init__(self, config: PLMConfig):
        super().__init__(config)
        self.model = PLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # g_ψ of the alignment loss; trained, saved, unused at inference.
        self.alignment_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.auxiliary_sampler = VoronoiSampler(config)
        self.post_init()

    @classmethod
    def from_causal_lm(cls, model_or_path, **plm_config) -> "PLMForCausalLM":
        """A PLM whose shared backbone is a copy of a Llama-architecture causal LM: a `LlamaForCausalLM`, or its
        folder or Hub id (loaded in float32 for training); see docs/families/plm.md. Embeddings, blocks, final norm
        and LM head are copied (tied where the source ties them), so the encoder pass computes the source's logits;
        `plm_config` sets PLM's own fields. A source field the backbone cannot express is refused with a ValueError
        naming it (`plm_config_from_llama`). PLM's own parts never enter the encoder pass: the auxiliary projection
        and the mask auxiliary start at the RMS scale of the source's token embeddings (the scale its blocks were
        trained on), the alignment map g_ψ at the identity (encoder and decoder states share one residual space)."""
        from transformers import LlamaForCausalLM

        source = model_or_path if isinstance(model_or_path, nn.Module) else load_llama_causal_lm(str(model_or_path))
        if not isinstance(source, LlamaForCausalLM):
            raise ValueError(f"from_causal_lm takes a LlamaForCausalLM (or its folder or Hub id), got "
                             f"{type(source).__name__}")
        config = plm_config_from_llama(source.config, **plm_config)
        dtype = source.get_input_embeddings().weight.dtype
        model = cls(config).to(dtype)
        weights = {name: tensor for name, tensor in source.state_dict().items() if "rotary_emb" not in name}
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        # Everything but PLM's own parts (and a tied head) must have come from the source.
        own = ("model.auxiliary_bank", "model.auxiliary_proj.", "model.mask_auxiliary", "alignment_proj.",
               "lm_head.weight")
        left = [name for name in missing if not name.startswith(own)]
        if left or unexpected:
            raise ValueError(f"the source's weights do not map onto PLM's backbone: missing {left[:3]}, unexpected "
                             f"{unexpected[:3]}")
        if config.tie_word_embeddings:
            model.tie_weights()
        with torch.no_grad():
            scale = source.get_input_embeddings().weight.float().pow(2).mean().sqrt().item()
            if model.model.auxiliary_proj is not None:
                # The bank's vectors have unit norm, so N(0, scale²) entries give outputs of RMS `scale`.
                model.model.auxiliary_proj.weight.normal_(0.0, scale)
            model.model.mask_auxiliary.normal_(0.0, scale)
            model.alignment_proj.weight.copy_(torch.eye(config.hidden_size, dtype=dtype))
            model.alignment_proj.bias.zero_()
        return model

    # ------------------------------------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------------------------------------

    @head_forward
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: DynamicCache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0, **kwargs) -> PLMOutput:
        """Without `labels`: the causal encoder, `logits` [B, T, V] (the last `logits_to_keep` if set). With `labels`
        ([B, T], -100 = not scored): the PLM objective; `logits` are then the same encoder logits, and the decoder's
        are in `decoder_logits`. Transformers' `output_hidden_states`, `output_attentions`, `return_dict` apply."""
        check_forward_kwargs(self, kwargs)
        if labels is not None:
            if cache is not None or inputs_embeds is not None:
                raise ValueError("the PLM training objective takes input_ids and labels only (no cache/inputs_embeds)")
            return self.plm_loss(input_ids, labels, attention_mask, **kwargs)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state[:, -logits_to_keep:] if logits_to_keep else out.last_hidden_state
        return PLMOutput(logits=self.lm_head(hidden), cache=out.cache, hidden_states=out.hidden_states,
                         attentions=out.attentions)

    def auxiliary_owners(self, logits: torch.Tensor, observed: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Training's cells of this model (`VoronoiSampler.training_cells`) for the rows of encoder logits [P, V]:
        the owner token of every auxiliary [P, N_aux] and the fit's TV [P] (None for non-Voronoi types)."""
        return self.auxiliary_sampler.training_cells(logits, self.lm_head.weight, self.model.auxiliary_bank, observed)

    def block_layout(self, length: int, phase: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decoder rows of one sequence: target position, block id and block start of each row.
        Block z starts at 1 + z·s − phase; blocks are truncated to targets in [1, length).

        Tensor ops only, on the device of `phase` (an int or a 0-d tensor): the random phase of a training step
        never reaches Python, so torch.compile traces the layout without a graph break. With s = K (the default)
        every target is decoded exactly once, so there are always length − 1 rows and the shapes are static; with
        s ≠ K the row count depends on the phase (a data-dependent shape under compile)."""
        K, s = self.config.block_size, self.config.block_stride
        phase = torch.as_tensor(phase, dtype=torch.long)
        device = phase.device
        # Every block that may hold a target for some phase in [0, s), K candidate rows each; rows outside
        # [1, length) are dropped below (a block starting before 1 keeps its tail).
        block = torch.arange(self.num_layout_blocks(length), device=device)[:, None].expand(-1, K)
        first = 1 + block * s - phase  # [Z, K]
        pos = first + torch.arange(K, device=device)
        keep = ((pos >= 1) & (pos < length)).flatten()
        if s == K:
            # A stable sort puts the kept rows first in their (block, offset) order; their number is static.
            rows = torch.sort((~keep).to(torch.uint8), stable=True).indices[:length - 1]
        else:
            rows = keep.nonzero().squeeze(1)
        return pos.flatten()[rows], block.flatten()[rows], first.clamp(min=1).flatten()[rows]

    def num_layout_blocks(self, length: int) -> int:
        """An upper bound on the block ids of `block_layout(length, phase)` for any phase (static: no data)."""
        return (length + self.config.block_stride - 1) // self.config.block_stride + 1

    def plm_loss(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask=None, **kwargs) -> PLMOutput:
        """The PLM objective with a fresh block layout: `decoder_objective` with auxiliaries drawn from this pass."""
        if input_ids.shape[1] < 2:
            raise ValueError("PLM training needs sequences of at least 2 tokens")
        # A fresh block phase per training step, drawn from the global CPU RNG as a tensor (a resumed run restores
        # that RNG, and the training loop seeds it per rank; a Python int would break a compiled graph); phase 0 in
        # eval mode so validation is deterministic.
        phase = (torch.randint(self.config.block_stride, ()) if self.training
                 else torch.zeros((), dtype=torch.long))
        layout = self.block_layout(input_ids.shape[1], phase.to(input_ids.device))
        return self.decoder_objective(input_ids, labels, attention_mask, layout, **kwargs)

    @torch.no_grad()
    def draw_auxiliaries(self, q_logits: torch.Tensor, input_ids: torch.Tensor,
                         dec_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Auxiliary index of every decoder row [B, D] (−1: mask auxiliary), u ~ sg[q], and the Voronoi fit's TV per
        position (None for other auxiliary types).

        q_logits [B, T-1, V]: encoder logits, row j-1 scoring x_j. Each decoder row's auxiliary is drawn from the cell
        of the OBSERVED token it predicts (`input_ids`), never from `labels`: a row whose label is masked (-100) is
        not scored, but it is still an input of the later rows of its block. Training draws from the global RNG;
        eval mode uses `fixed_uniforms` over the decoder rows (the same for every sequence of the batch), so the eval
        loss is deterministic and a row's loss does not depend on the rest of the batch. Voronoi cells are fitted
        only where the observed token has one (`VoronoiSampler.training_cells`)."""
        batch, length = input_ids.shape
        targets = input_ids[:, dec_pos]  # [B, D]
        observed = input_ids[:, 1:].reshape(-1)  # the token scored by each row of q
        owners, tv = self.auxiliary_owners(q_logits.reshape(-1, q_logits.shape[-1]), observed)
        if owners is None:
            return torch.full_like(targets, -1), tv
        owners = owners.view(batch, length - 1, -1)[:, dec_pos - 1]  # [B, D, N_aux]
        num_dec = dec_pos.shape[0]
        uniform = None if self.training else fixed_uniforms(num_dec, input_ids.device).repeat(batch)
        aux = draw_auxiliary_in_cell(owners.reshape(batch * num_dec, -1), targets.reshape(-1), uniform=uniform)
        return aux.view(batch, num_dec), tv

    def decoder_objective(self, input_ids, labels, attention_mask, layout, aux=None, with_alignment: bool = True,
                          **kwargs) -> PLMOutput:
        """The normalised PLM loss with its logged parts, for a given block layout (`block_layout`).

        aux [B, D]: the decoder rows' auxiliaries; None draws them from this call's encoder pass (`draw_auxiliaries`).
        Passing them fixes the auxiliary realisation, as PLM's DPO score does.
        with_alignment: False leaves out the alignment term (and its hidden-state capture) even when
        `alignment_weight` > 0; PLM's DPO score has no alignment term.

        Two passes (paper §3, `_two_passes`): the decoder rows read the cached keys of the encoder pass, with
        gradient (so the decoder loss trains the encoder pass too). Under gradient checkpointing, which drops caches,
        one joint forward (`_joint_pass`) computes the same thing.
        Positions follow the padding like the plain forward's: with a 2-D `attention_mask` (left padding) a row's
        encoder logits equal `forward(input_ids, attention_mask)`'s, and padded targets are never scored."""
        cfg = self.config
        batch, length = input_ids.shape
        dec_pos, dec_block, dec_start = layout
        capture = ((cfg.alignment_encoder_layer, cfg.alignment_decoder_layer)
                   if with_alignment and cfg.alignment_weight > 0 else None)
        passes = (self._joint_pass if self.model.gradient_checkpointing and self.training and torch.is_grad_enabled()
                  else self._two_passes)
        positions = (make_padding_position_ids(attention_mask) if attention_mask is not None  # over real tokens only
                     else torch.arange(length, device=input_ids.device)[None].expand(batch, -1))
        out = passes(input_ids, attention_mask, positions, layout, aux, capture, kwargs)
        enc_logits, dec_logits, aux = out.encoder_logits, out.decoder_logits, out.auxiliaries

        # Scored rows: labelled targets that are real tokens. Encoder: every one. Decoder: those of a block up to
        # and including its first end-of-document target.
        scored = labels != -100
        if attention_mask is not None:
            scored = scored & attention_mask.bool()
        targets = labels[:, dec_pos]  # [B, D]
        enc_valid = scored[:, 1:]
        dec_valid = scored[:, dec_pos] & self.decoder_row_valid(input_ids, dec_pos, dec_start)
        n_enc, n_dec = enc_valid.sum(), dec_valid.sum()
        enc_sum = (token_nll(enc_logits[:, :-1], labels[:, 1:]) * enc_valid).sum()
        dec_sum = (token_nll(dec_logits, targets) * dec_valid).sum()
        total = enc_sum + dec_sum
        align_sum = None
        if capture is not None:
            enc_mid, dec_mid = out.mid_residuals
            # REPA-style: g_ψ(decoder state) against the encoder state of the row that predicts the same target.
            aligned = self.alignment_proj(dec_mid)
            reference = enc_mid[:, dec_pos - 1].detach()
            align = 1.0 - F.cosine_similarity(aligned.float(), reference.float(), dim=-1)
            align_sum = (align * dec_valid).sum()
            total = total + cfg.alignment_weight * align_sum
        loss = total / (n_enc + n_dec).clamp(min=1)

        with torch.no_grad():
            first = dec_pos == dec_start
            correct = ((dec_logits.argmax(-1) == targets) | first) & dec_valid
            reconstructed = self.reconstructed_tokens(correct, dec_block, dec_pos - dec_start, first,
                                                      num_blocks=self.num_layout_blocks(length),
                                                      block_size=cfg.block_size)
            uses_mask = ((aux < 0) & dec_valid).sum() / n_dec.clamp(min=1)
            # mean over the fitted positions (0 when none was fitted: no cell was drawn)
            tv = None if out.auxiliary_tv is None else out.auxiliary_tv.sum() / max(out.auxiliary_tv.numel(), 1)
        return PLMOutput(
            loss=loss, logits=enc_logits, decoder_logits=dec_logits,
            hidden_states=out.encoder_output.hidden_states, attentions=out.encoder_output.attentions,
            encoder_nll=enc_sum.detach() / n_enc.clamp(min=1), decoder_nll=dec_sum.detach() / n_dec.clamp(min=1),
            alignment_loss=None if align_sum is None else align_sum.detach() / n_dec.clamp(min=1),
            reconstructed_tokens=reconstructed, auxiliary_tv=tv, mask_auxiliary_fraction=uses_mask,
        )

    def _objective_visibility(self, layout, attention_mask, length: int, encoder_rows: bool) -> torch.Tensor:
        """Visibility of [the encoder rows, if `encoder_rows`; the decoder rows] over [the T token keys; the decoder
        rows' keys], in index space: an encoder row sees the causal token prefix, a decoder row the clean prefix
        before its block start and, causally, the rows of its own block. Padded token keys are hidden."""
        dec_pos, dec_block, dec_start = layout
        enc_idx = torch.arange(length, device=dec_pos.device)
        no_group = torch.full_like(enc_idx, -1)
        key_valid = None
        if attention_mask is not None:
            key_valid = torch.cat([attention_mask.bool(), attention_mask.new_ones(
                attention_mask.shape[0], dec_pos.shape[0], dtype=torch.bool)], dim=1)
        query_pos, query_limit, query_group = dec_pos, dec_start, dec_block
        if encoder_rows:
            query_pos, query_limit = torch.cat([enc_idx, dec_pos]), torch.cat([enc_idx + 1, dec_start])
            query_group = torch.cat([no_group, dec_block])
        return visibility_mask(query_pos=query_pos, query_limit=query_limit, query_group=query_group,
                               key_pos=torch.cat([enc_idx, dec_pos]), key_group=torch.cat([no_group, dec_block]),
                               key_valid=key_valid)

    def _two_passes(self, input_ids, attention_mask, positions, layout, aux, capture, kwargs) -> ObjectivePasses:
        """Encoder pass into a cache, auxiliaries from its detached logits, decoder pass over the cached keys."""
        dec_pos = layout[0]
        length = input_ids.shape[1]
        cache = DynamicCache(config=self.config)
        enc = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, cache=cache,
                         capture_layers=capture[:1] if capture else (), **kwargs)
        enc_logits = self.lm_head(enc.last_hidden_state)
        tv = None
        if aux is None:
            aux, tv = self.draw_auxiliaries(enc_logits[:, :-1].detach(), input_ids, dec_pos)
        dec = self.model(inputs_embeds=self.model.embed_auxiliaries(aux), position_ids=positions[:, dec_pos],
                         attention_mask=self._objective_visibility(layout, attention_mask, length, False), cache=cache,
                         capture_layers=capture[1:] if capture else ())
        mids = (enc.mid_residuals[0], dec.mid_residuals[0]) if capture else None
        return ObjectivePasses(enc_logits, self.lm_head(dec.last_hidden_state), mids, aux, tv, enc)

    def _joint_pass(self, input_ids, attention_mask, positions, layout, aux, capture, kwargs) -> ObjectivePasses:
        """[tokens; auxiliaries] in one forward (no cache, so gradient checkpointing works): the encoder rows see the
        causal prefix, the decoder rows what they see in the two-pass path (`_objective_visibility`)."""
        dec_pos = layout[0]
        length = input_ids.shape[1]
        tv = None
        if aux is None:
            with torch.no_grad():
                q_logits = self(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
            aux, tv = self.draw_auxiliaries(q_logits, input_ids, dec_pos)
        mask = self._objective_visibility(layout, attention_mask, length, True)
        embeds = torch.cat([self.model.embed_tokens(input_ids), self.model.embed_auxiliaries(aux)], dim=1)
        out = self.model(inputs_embeds=embeds, position_ids=torch.cat([positions, positions[:, dec_pos]], 1),
                         attention_mask=mask, capture_layers=capture or (), **kwargs)
        logits = self.lm_head(out.last_hidden_state)
        mids = None
        if capture:
            mids = (out.mid_residuals[0][:, :length], out.mid_residuals[1][:, length:])
        if out.hidden_states is not None:  # report the encoder rows, as the two-pass path does
            out.hidden_states = tuple(h[:, :length] for h in out.hidden_states)
        if out.attentions is not None:
            out.attentions = tuple(a[..., :length, :length] for a in out.attentions)
        return ObjectivePasses(logits[:, :length], logits[:, length:], mids, aux, tv, out)

    def decoder_row_valid(self, input_ids, dec_pos, dec_start) -> torch.Tensor:
        """[B, D] bool: no end-of-document target precedes the row's target inside its block (a block stops at its
        first EOS target, which is itself still scored)."""
        eos = self.config.eos_token_id if self.config.eos_token_id is not None else -1
        eos_cum = F.pad((input_ids == eos).long().cumsum(1), (1, 0))  # eos_cum[:, p] = #EOS among x_<p
        return eos_cum[:, dec_pos] == eos_cum[:, dec_start]  # no EOS among x_start .. x_{pos-1}

    @staticmethod
    def reconstructed_tokens(correct: torch.Tensor, block: torch.Tensor, offset: torch.Tensor, first: torch.Tensor,
                             num_blocks: int | None = None, block_size: int | None = None) -> torch.Tensor:
        """R (App. 17): mean over blocks of the length of the correctly decoded prefix, the first token
        counted as correct. correct [B, D] (False on unscored rows; first rows True when scored),
        block / offset / first [D]: block id, offset inside the block, first row of its block.
        num_blocks / block_size: bounds on the block ids / offsets (default: read from the data; pass static
        bounds to keep the shapes data-independent under torch.compile). 0 when no block is scored."""
        batch = correct.shape[0]
        num_blocks = int(block.max()) + 1 if num_blocks is None else num_blocks
        block_size = int(offset.max()) + 1 if block_size is None else block_size
        grid = correct.new_zeros(batch, num_blocks, block_size, dtype=torch.long)
        grid[:, block, offset] = correct.long()
        per_block = grid.cumprod(-1).sum(-1)  # [B, Z]
        # A block counts when its first row is scored (one first row per block, so the scatter sums one value).
        first_scored = (correct & first).long()
        scored = per_block.new_zeros(per_block.shape).scatter_add_(1, block.expand(batch, -1), first_scored) > 0
        # Masked mean instead of boolean indexing: the same value, static shapes.
        return (per_block * scored).sum().float() / scored.sum().clamp(min=1)

    # ------------------------------------------------------------------------------------------------
    # generation (the loop is `MultiTokenGenerationMixin.generate`; options are `PLMGenerationOptions`)
    # ------------------------------------------------------------------------------------------------

    def compiled_methods(self) -> list[tuple[nn.Module, str]]:
        """The network, and for Voronoi auxiliaries the offsets of the verify rows' cells (`fit_decoding_offsets`):
        at decode sizes they are hundreds of small ops, whose dispatch compiling removes. The token scores and the
        exact moves stay outside."""
        methods = super().compiled_methods()
        if self.config.auxiliary_type == "voronoi":
            methods.append((self.auxiliary_sampler, "fit_decoding_offsets"))
        return methods

    def _start_decoding(self, input_ids, request, options: PLMGenerationOptions):
        """Encode all prompt tokens but the last into a fresh cache (the last one opens the first round) and draw
        u_t for every generated index t of every row up front (Algorithm 1, first line)."""
        cfg = self.config
        if cfg.auxiliary_type == "none":
            raise ValueError("a PLM trained with auxiliary_type='none' has no auxiliary sampler to decode with")
        batch, device = input_ids.shape[0], input_ids.device
        width = options.k_pred if options.decoding == "quadratic" else 1
        aux_table = torch.stack([
            torch.randint(cfg.num_auxiliaries, (request.max_new_tokens + 2 * width,),
                          generator=torch.Generator().manual_seed(seed))
            for seed in options.auxiliary_seeds]).to(device)
        cache = DynamicCache(config=cfg)
        positions = make_padding_position_ids(request.attention_mask)
        if input_ids.shape[1] > 1:
            self(input_ids=input_ids[:, :-1], attention_mask=request.attention_mask[:, :-1],
                 position_ids=positions[:, :-1], cache=cache)
        decoder = QuadraticDecoder(width, options.decoding == "quadratic", options.acceptance_rule,
                                   self.auxiliary_sampler, (self.lm_head.weight, self.model.auxiliary_bank), device,
                                   greedy=options.do_sample is False)
        state = PLMDecodingState(
            cache=cache, key_valid=request.attention_mask[:, :-1].bool(),
            last_token=input_ids[:, -1], next_pos=request.attention_mask.long().sum(1),
            pending=torch.zeros(batch, width - 1, dtype=torch.long, device=device),
            pending_ok=torch.zeros(batch, dtype=torch.bool, device=device),  # False forces m = 0 (first round)
            aux_table=aux_table, decoder=decoder)
        # The prefill is a model call too (it commits no token), so it is counted.
        return state, int(input_ids.shape[1] > 1)

    def _decoding_step(self, state: PLMDecodingState, new_tokens) -> DecodingStep:
        """One model call over the rows `state.decoder` lays out; it commits m + 1 tokens per row."""
        tokens, aux, position_ids, mask = state.decoder.call_inputs(state, new_tokens.count)
        embeds = self.model.embed_tokens(tokens)
        if aux is not None:
            embeds = torch.cat([embeds, self.model.embed_auxiliaries(aux)], dim=1)
        logits = self(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids,
                      cache=state.cache).logits.float()
        return state.decoder.advance(state, logits, new_tokens.count)


#: LlamaConfig fields PLM's backbone computes differently (or not at all), with the value it computes. A source
#: holding anything else is refused, naming the field.
LLAMA_FIELDS_REQUIRED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
                         "pretraining_tp": 1}
#: Fields that some Llama-architecture checkpoints carry and that change the attention (sliding windows, QK-norm).
LLAMA_FIELDS_ABSENT = ("sliding_window", "use_sliding_window", "qk_norm", "use_qk_norm", "qk_layernorm")
#: The backbone fields taken from the source's config (`BackboneConfig` uses Llama's names).
LLAMA_FIELDS_COPIED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_parameters", "rms_norm_eps",
                       "initializer_range", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


def plm_config_from_llama(llama_config, **plm_config) -> PLMConfig:
    """A `PLMConfig` with the backbone of `llama_config` (a `LlamaConfig`) and PLM's own fields from `plm_config`.
    ValueError naming the first source field the backbone cannot express, or a backbone field set in `plm_config`
    (they belong to the source)."""
    model_type = getattr(llama_config, "model_type", None)
    if model_type != "llama":
        raise ValueError(f"model_type {model_type!r}: PLM starts from Llama-architecture causal LMs only (model_type "
                         f"'llama')")
    for name, value in LLAMA_FIELDS_REQUIRED.items():
        if getattr(llama_config, name, value) != value:
            raise ValueError(f"{name}={getattr(llama_config, name)!r} in the source config: PLM's backbone needs "
                             f"{name}={value!r}")
    for name in LLAMA_FIELDS_ABSENT:
        if getattr(llama_config, name, None) not in (None, False):
            raise ValueError(f"{name}={getattr(llama_config, name)!r} in the source config: PLM's backbone has no "
                             f"{name.replace('use_', '')} (full causal attention without QK-norm only)")
    layer_types = getattr(llama_config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError(f"layer_types={list(layer_types)!r} in the source config: PLM's backbone has full attention "
                         f"in every layer")
    rope = dict(getattr(llama_config, "rope_parameters", None) or {"rope_type": "default",
                                                                      "rope_theta": llama_config.rope_theta})
    if rope.get("rope_type", "default") not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope_parameters['rope_type']={rope.get('rope_type')!r} in the source config: PLM's backbone "
                         f"supports {STATIC_ROPE_TYPES} (frequencies fixed at construction)")
    given = sorted(set(plm_config) & set(LLAMA_FIELDS_COPIED))
    if given:
        raise ValueError(f"{', '.join(given)}: backbone fields come from the source model, not from plm_config")
    backbone = {name: getattr(llama_config, name) for name in LLAMA_FIELDS_COPIED if hasattr(llama_config, name)}
    backbone["rope_parameters"] = rope
    if backbone.get("head_dim") is None:
        backbone["head_dim"] = llama_config.hidden_size // llama_config.num_attention_heads
    return PLMConfig(**backbone, **plm_config)


def load_llama_causal_lm(path, **kwargs):
    """The `LlamaForCausalLM` saved in folder or Hub id `path`, in float32 unless `kwargs` say otherwise; its config
    is read and checked (`plm_config_from_llama`) before any weights load."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(path)
    plm_config_from_llama(config)
    return LlamaForCausalLM.from_pretrained(path, config=config, **{"dtype": torch.float32, **kwargs})


__all__ = ["AcceptanceRule", "PLMDecodingState", "PLMForCausalLM", "PLMGenerationOptions", "PLMModel",
           "PLMOutput", "PLMPreTrainedModel", "QuadraticDecoder", "load_llama_causal_lm",
           "plm_config_from_llama"]
