"""OpenPangu-Embedded configuration: Llama's, plus the `bias` switch the real config.json uses."""

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig


@strict
class PanguEmbeddedConfig(LlamaConfig):
    """Defaults are those of OpenPangu-Embedded-7B; its config.json lacks `head_dim`/`attention_dropout`.

    `bias` (the key OpenPangu ships) switches the q/k/v/o projection biases; Llama calls it
    `attention_bias`, so it is mirrored there. The MLP never has a bias.
    """

    model_type = "PanguEmbedded"
    default_theta = 16_000_000.0

    vocab_size: int = 153376
    hidden_size: int = 4096
    intermediate_size: int = 12800
    num_hidden_layers: int = 34
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 45892
    bias: bool = True

    def __post_init__(self, **kwargs):
        self.attention_bias = self.bias
        self.mlp_bias = False
        super().__post_init__(**kwargs)


__all__ = ["PanguEmbeddedConfig"]
