"""``model=hf``: a local Hugging Face causal LM behind the model contract (token ids in, logits out).

Architectures laid out like Llama (``llama``, ``mistral``, ``qwen2``, ``qwen3``: ``model.embed_tokens``,
``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``) are taken apart: the wrapper holds those pieces
as its own children (the decoder layers in a ``ModuleDict`` keyed "0", "1", ...) and runs them in its own forward,
which skips the pieces a pipeline stage does not hold. The layers are Hugging Face's own modules, so the math is
theirs; the causal (or sliding-window) masks are built by Hugging Face's own mask functions. Other architectures
are wrapped whole as ``self.hf`` and run by their own forward.
"""

from __future__ import annotations

import torch
from torch import nn

from distrain.errors import ArtifactError
from distrain.models.common.documents import document_positions
from distrain.models.hf.spec import HF_CONFIG_SPEC, attention_kinds, has_llama_layout, hf_spec


class HFCausalLM(nn.Module):
    """``AutoModelForCausalLM`` from a local directory (never the hub), in fp32.

    Args:
        name_or_path: a local directory with ``config.json`` and ``*.safetensors`` weights.
        max_seq_len: the longest sequence trained on (the default ``data.seq_len``).
        random_init: build from ``config.json`` with Hugging Face's initialisation instead of loading the weights.
        attn_implementation: transformers' attention kernel (``sdpa``, ``eager``).
        vocab_size: the ids the data holds (None: ``config.json``'s vocabulary); more than the model's embedding
            holds is refused, fewer is fine (embeddings are often padded to a multiple of 64).

    Llama layout: children ``embed_tokens``, ``rotary_emb`` (non-persistent RoPE buffers, needed by every pipeline
    stage), ``layers``, ``norm``, ``lm_head``. Otherwise one child, ``hf``. Either way the transformers config is the
    plain attribute ``config`` (not a module: the state dict names every tensor once).
    """

    parallel_spec = HF_CONFIG_SPEC  # replaced per instance by the architecture's spec

    def __init__(
        self,
        *,
        name_or_path: str,
        max_seq_len: int,
        random_init: bool = False,
        attn_implementation: str = "sdpa",
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(name_or_path, local_files_only=True)
        if vocab_size is not None and vocab_size > config.vocab_size:  # a padded embedding may hold more ids
            raise ValueError(f"vocab_size {vocab_size} is more than the model's {config.vocab_size} ({name_or_path})")
        on_meta = torch.empty(()).is_meta  # validation builds shapes only: no weights to read
        if random_init or on_meta:
            hf = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        else:
            hf, loading = AutoModelForCausalLM.from_pretrained(
                name_or_path,
                local_files_only=True,
                attn_implementation=attn_implementation,
                dtype=torch.float32,
                output_loading_info=True,
            )
            _refuse_partial_load(name_or_path, loading)
        hf.float()
        self.max_seq_len, self.vocab_size, self.hidden_size = max_seq_len, config.vocab_size, config.hidden_size
        self.config, self.architecture = hf.config, type(hf).__name__
        self.split = has_llama_layout(hf)
        if self.split:
            self._adopt(hf)
        else:
            self.hf = hf
        self.parallel_spec = hf_spec(self)

    def _adopt(self, hf: nn.Module) -> None:
        """Hold the Llama-layout model's pieces as this module's children; the transformers model itself is
        dropped (its pieces keep their weights, ties included: a tied ``lm_head`` shares ``embed_tokens``' weight)."""
        inner = hf.model
        self.embed_tokens = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        self.layers = nn.ModuleDict({str(index): layer for index, layer in enumerate(inner.layers)})
        self.norm = inner.norm
        self.lm_head = hf.lm_head
        self.layer_kinds = attention_kinds(self.config)  # full_attention | sliding_attention, per layer

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) of ``tokens`` (batch, seq), on the tokens' device; no key/value cache.

        Llama layout, as a pipeline stage: hidden states (batch, seq, hidden_size) in when ``embed_tokens`` is None,
        hidden states out when ``lm_head`` is None. ``documents`` (long, (batch, seq); document masking, Llama
        layout only): position ids restart at each document, and Hugging Face's mask functions, given them, keep
        attention inside each packed document. No communication here (strategies' hooks may add some)."""
        if not self.split:
            if documents is not None:  # validation refuses this; a model built outside train.py might not be
                raise ValueError(f"{self.architecture} is not taken apart (Llama layout): it takes no documents")
            return self.hf(input_ids=tokens, use_cache=False).logits
        h = self.embed_tokens(tokens) if self.embed_tokens is not None else tokens
        if documents is None:
            positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        else:
            positions = document_positions(documents)
        position_embeddings = self.rotary_emb(h, positions)
        kinds = {self.layer_kinds[int(key)] for key in self.layers}
        masks = causal_masks(self.config, h, kinds, None if documents is None else positions)
        for key, layer in self.layers.items():
            # Keyword arguments, as Hugging Face's own model passes them; activation checkpointing, compile and
            # FSDP wrap the layer's call and pass them through.
            h = layer(
                h,
                attention_mask=masks[self.layer_kinds[int(key)]],
                position_embeddings=position_embeddings,
                position_ids=positions,
            )
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h


def _refuse_partial_load(name_or_path: str, loading: dict[str, list]) -> None:
    """transformers reports weights it could not place and carries on with random ones; a run must not (the
    directory's inspector refuses this before any rank starts; this is the same rule where the weights are read)."""
    for kind in ("missing_keys", "mismatched_keys", "unexpected_keys"):
        names = [str(name) for name in loading.get(kind) or ()]
        if names:
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            what = kind.replace("_keys", "").replace("_", " ")
            raise ArtifactError(name_or_path, f"its weights do not fit its config.json: {what} {names[0]}{more}")


def causal_masks(
    config: object, hidden: torch.Tensor, kinds: set[str], packed_positions: torch.Tensor | None = None
) -> dict[str, torch.Tensor | None]:
    """Each attention kind's mask for ``hidden`` (batch, seq, width), from Hugging Face's own mask functions, on
    the hidden states' device: None where the kernel can be told "causal" instead (sdpa without a window shorter
    than the sequence), an additive or boolean mask otherwise (eager attention adds nothing when given None).
    ``packed_positions`` (batch, seq): positions that restart at each packed document, from which Hugging Face's
    functions keep attention inside each document (a new document wherever a position does not follow the last)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    return {
        kind: makers[kind](
            config=config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=packed_positions
        )
        for kind in kinds
    }
