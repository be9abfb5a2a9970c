"""tapdraft's bolt-on MTP head as a vLLM draft model (``method: "mtp"``), over any dense target vLLM serves.

vLLM 0.32 builds an MTP drafter only from a class named by the *target's* architecture (``qwen3_next_mtp.py``,
``deepseek_mtp.py``, ...); a dense Llama / Qwen3 target has none. This class mirrors ``qwen3_next_mtp.py``'s shape
(one fusion, one decoder layer, the target's embedding and lm_head shared by the proposer) with tapdraft's MTP
math exactly (``train/drafters/mtp/model.py``, the export's ``tapdraft-vllm`` layout):

    x      = eh_proj([enorm(Emb(x_{t+1})) ; hnorm(h_t)])      h_t = the target's final-normed last hidden state,
    h      = DecoderLayer(x)  (a Qwen3 block: QK-norm, GQA)     which is what vLLM's target returns
    logits = lm_head(shared_head.norm(h))                      (the target's logits_scaling folded into the norm)

Names are the export's (DeepSeek-V3's MTP names at ``model.layers.{L}``: L = the target's layer count, so the
draft's attention layer never collides with the target's). The forward returns h before the output norm and
``compute_logits`` applies it, as DeepSeek's MTP does.

Drafts a round: vLLM drafts a second token by rerunning the layer on its own output at the next position over a cache
that holds depth-1 states. A head trained with ``chain: rerun`` (``mtp_chain`` in its config) learned exactly that
and is served with several; a ``sequence`` head (depth 2 attends over depth-2 states of every earlier row) drafts one
(``num_speculative_tokens: 1``) and more is refused here.

Multimodal: a head trained on the dataset's audio frame embeddings (``tapdraft.audio_embeds``) declares
``supports_multimodal_embeddings``, so the proposer hands it the target's merged embeddings on audio prompts; one
trained without them reads the placeholder id's embedding there, which is what vLLM's text-only path gives it.

A draft vocabulary (``draft_vocab_size`` in the config, tapdraft's ``common.draft_vocab``): the head scores the N
frozen lm_head rows the export carries instead of the target's V (on a CPU the head is most of a draft's cost) and
scatters them to target ids through ``d2t``, -inf elsewhere, as vLLM's EAGLE-3 ``compute_logits`` does.

Shapes: N tokens, H hidden.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer
from vllm.model_executor.models.utils import _merge_multimodal_embeddings, maybe_prefix

STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
"""(vLLM's fused parameter, the export's name, its shard): vLLM's Qwen3 block fuses q/k/v and gate/up."""


def _draft_config(vllm_config: VllmConfig):
    """The export's config (``model_config`` is the target's while the proposer builds its draft, as in
    ``deepseek_mtp.py``)."""
    return vllm_config.speculative_config.draft_model_config.hf_config


class _SharedHead(nn.Module):
    def __init__(self, H: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(H, eps=eps)


class TapdraftMTPLayer(Qwen3DecoderLayer):
    """vLLM's Qwen3 decoder layer plus DeepSeek-V3's MTP fusion (``enorm``, ``hnorm``, ``eh_proj``) and output norm,
    named as tapdraft's ``MTPHead`` names them."""

    def __init__(self, config, cache_config, quant_config, prefix: str) -> None:
        super().__init__(config, cache_config=cache_config, quant_config=quant_config, prefix=prefix)
        H, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(H, eps=eps)
        self.hnorm = RMSNorm(H, eps=eps)
        self.eh_proj = ReplicatedLinear(2 * H, H, bias=False, return_bias=False, prefix=f"{prefix}.eh_proj")
        self.shared_head = _SharedHead(H, eps)

    def step(self, emb_NH: torch.Tensor, h_NH: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb_NH), self.hnorm(h_NH)], dim=-1))
        out, residual = self(positions, x, None)
        return out + residual


class TapdraftMTPModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = _draft_config(vllm_config)
        self.first = int(config.first_mtp_layer_index)
        n = int(config.num_nextn_predict_layers)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)  # the target's, shared
        self.layers = nn.ModuleDict({
            str(self.first + i): TapdraftMTPLayer(config, vllm_config.cache_config, vllm_config.quant_config,
                                                  prefix=f"{prefix}.layers.{self.first + i}")
            for i in range(n)
        })

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None, spec_step_idx: int = 0):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        return self.layer(spec_step_idx).step(inputs_embeds, hidden_states, positions)

    def layer(self, spec_step_idx: int) -> TapdraftMTPLayer:
        return self.layers[str(self.first + spec_step_idx % len(self.layers))]


class TapdraftMTPForCausalLM(nn.Module):
    """The draft model vLLM's MTP proposer runs (registered by the plugin as ``TapdraftMTPForCausalLM``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = _draft_config(vllm_config)
        spec = vllm_config.speculative_config
        k = getattr(spec, "num_speculative_tokens", 1) if spec is not None else 1
        if k != 1 and getattr(config, "mtp_chain", "sequence") != "rerun":
            raise ValueError(f"this MTP head was trained to draft one token a round (its depths run over whole "
                             f"sequences), got num_speculative_tokens={k}: vLLM drafts further tokens by rerunning the "
                             "layer over its own cache; serve it with num_speculative_tokens 1, or train it with "
                             "drafter.chain: rerun")
        self.config = config
        self.model = TapdraftMTPModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      prefix=maybe_prefix(prefix, "lm_head"))  # the target's, shared
        self.logits_processor = LogitsProcessor(config.vocab_size)
        # a draft vocabulary: the export's own N frozen rows (``lm_head.weight``), scored instead of the target's V, and
        # its offsets ``d2t`` (target id of draft id i = i + d2t[i]); the proposer still shares ``lm_head`` above
        n = getattr(config, "draft_vocab_size", None)
        self.draft_vocab_size = int(n) if n else None
        if self.draft_vocab_size:
            self.draft_lm_head = ParallelLMHead(self.draft_vocab_size, config.hidden_size,
                                                prefix=maybe_prefix(prefix, "draft_lm_head"))
            self.draft_logits_processor = LogitsProcessor(self.draft_vocab_size)
            self.register_buffer("draft_target_ids", torch.zeros(self.draft_vocab_size, dtype=torch.long),
                                 persistent=False)
        # an instance flag: the proposer asks the instance (``supports_multimodal_embeddings(self.model)``)
        self.supports_multimodal_embeddings = bool((getattr(config, "tapdraft", None) or {}).get("audio_embeds"))

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings=None, *,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return self.model.embed_tokens(input_ids)
        assert is_multimodal is not None, "merged embeddings need the placeholder mask"
        emb = self.model.embed_tokens(input_ids.masked_fill(is_multimodal.to(input_ids.device), 0))
        return _merge_multimodal_embeddings(inputs_embeds=emb, multimodal_embeddings=multimodal_embeddings,
                                            is_multimodal=is_multimodal)

    def forward(self, input_ids, positions, hidden_states, intermediate_tensors=None, inputs_embeds=None,
                spec_step_idx: int = 0, **kwargs):
        return self.model(input_ids, positions, hidden_states, inputs_embeds, spec_step_idx)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor | None:
        normed = self.model.layer(spec_step_idx).shared_head.norm(hidden_states)
        if not self.draft_vocab_size:
            return self.logits_processor(self.lm_head, normed)
        z = self.draft_logits_processor(self.draft_lm_head, normed)
        if z is None:
            return None
        out = z.new_full((z.shape[0], self.config.vocab_size), float("-inf"))
        out[:, self.draft_target_ids] = z
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        # the embedding and lm_head are the target's: the proposer shares them after loading
        loaded = {"model.embed_tokens.weight", "lm_head.weight"}
        for name, w in weights:
            if self.draft_vocab_size and name == "lm_head.weight":  # the draft vocabulary's rows
                p = self.draft_lm_head.weight
                getattr(p, "weight_loader", default_weight_loader)(p, w)
                loaded.add("draft_lm_head.weight")
                continue
            if self.draft_vocab_size and name == "d2t":
                self.draft_target_ids.copy_(torch.arange(self.draft_vocab_size) + w.long().to(
                    self.draft_target_ids.device))
                continue
            if not name.startswith("model.layers."):
                continue
            for fused, part, shard in STACKED:
                if f".{part}." in name:
                    p = params[name.replace(f".{part}.", f".{fused}.")]
                    p.weight_loader(p, w, shard)
                    loaded.add(name.replace(f".{part}.", f".{fused}."))
                    break
            else:
                p = params[name]
                getattr(p, "weight_loader", default_weight_loader)(p, w)
                loaded.add(name)
        return loaded
