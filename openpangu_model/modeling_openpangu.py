"""OpenPangu-Embedded as a diff over transformers' Llama.

The architecture is Llama's (RMSNorm, rotate-half RoPE, GQA, SwiGLU MLP, untied lm_head) with biases on
q/k/v/o, which Llama already supports through `attention_bias`. What differs is the config class and the
checkpoint: OpenPangu checkpoints carry legacy `self_attn.rotary_emb.inv_freq` buffers that are
recomputed from rope_theta, so they are dropped silently on load.
"""

from transformers import LlamaForCausalLM, LlamaModel, LlamaPreTrainedModel

from .configuration_openpangu import PanguEmbeddedConfig


class PanguEmbeddedPreTrainedModel(LlamaPreTrainedModel):
    config_class = PanguEmbeddedConfig
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]


class PanguEmbeddedModel(PanguEmbeddedPreTrainedModel, LlamaModel):
    pass


class PanguEmbeddedForCausalLM(PanguEmbeddedPreTrainedModel, LlamaForCausalLM):
    pass


__all__ = ["PanguEmbeddedPreTrainedModel", "PanguEmbeddedModel", "PanguEmbeddedForCausalLM"]
