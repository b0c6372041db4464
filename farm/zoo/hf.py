"""Hugging Face `transformers` models from small configs with random weights (nothing is
downloaded). Needs the `hf` extra: pip install -e '.[hf]'. Their programs return
`transformers.modeling_outputs` types, so that module is imported before they are loaded."""
from __future__ import annotations

from typing import Any

import torch

from farm.zoo.entry import BATCH, SEQ, ZooModel

VOCAB = 100
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB)
HF = dict(needs=("transformers",), modules=("transformers.modeling_outputs",), atol=1e-3, rtol=1e-3)


def _ids() -> tuple[tuple, dict[str, Any]]:
    return (), {"input_ids": torch.randint(0, VOCAB, (2, 16))}


def _text_dims() -> dict[str, Any]:
    return {"input_ids": {0: BATCH(), 1: SEQ()}}


def bert():
    from transformers import BertConfig, BertModel
    return BertModel(BertConfig(**SMALL, max_position_embeddings=64))


def gpt2():
    from transformers import GPT2Config, GPT2Model
    return GPT2Model(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, use_cache=False))


def llama():
    from transformers import LlamaConfig, LlamaModel
    return LlamaModel(LlamaConfig(**SMALL, num_key_value_heads=2, max_position_embeddings=64, use_cache=False))


def t5_encoder():
    from transformers import T5Config, T5EncoderModel
    return T5EncoderModel(T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=VOCAB))


def vit():
    from transformers import ViTConfig, ViTModel
    return ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                              image_size=32, patch_size=8))


def mixtral():
    """A sparse mixture of experts: 4 experts, 2 routed per token."""
    from transformers import MixtralConfig, MixtralModel
    return MixtralModel(MixtralConfig(**SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                      max_position_embeddings=64, use_cache=False))


ENTRIES = (
    ZooModel("hf_bert", "encoder", bert, _ids, _text_dims, **HF),
    ZooModel("hf_gpt2", "decoder", gpt2, _ids, _text_dims, **HF),
    ZooModel("hf_llama", "decoder", llama, _ids, _text_dims, **HF),
    ZooModel("hf_t5_encoder", "encoder", t5_encoder, _ids, _text_dims, **HF),
    ZooModel("hf_vit", "vision", vit, lambda: ((), {"pixel_values": torch.randn(2, 3, 32, 32)}),
             lambda: {"pixel_values": {0: BATCH()}}, **HF),
    # its experts run as transformers' own custom op (grouped_mm_fallback), registered when its module is imported:
    # before the program is loaded, and wherever the artifact runs
    ZooModel("hf_mixtral_moe", "moe", mixtral, _ids, _text_dims,
             **{**HF, "modules": (*HF["modules"], "transformers.integrations.moe")}),
)
