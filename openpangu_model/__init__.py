"""OpenPangu-Embedded for transformers, without remote code.

Importing this package registers the model type "PanguEmbedded" with the Auto classes, so that
`AutoConfig/AutoModelForCausalLM/AutoTokenizer.from_pretrained(DIR)` load an OpenPangu-Embedded
directory even when its config.json still names remote code in `auto_map`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from .configuration_openpangu import PanguEmbeddedConfig
from .modeling_openpangu import PanguEmbeddedForCausalLM, PanguEmbeddedModel, PanguEmbeddedPreTrainedModel
from .tokenization_openpangu import CHAT_TEMPLATE, NO_THINK_SUFFIX, PanguTokenizer, split_thinking

AutoConfig.register(PanguEmbeddedConfig.model_type, PanguEmbeddedConfig, exist_ok=True)
AutoModel.register(PanguEmbeddedConfig, PanguEmbeddedModel, exist_ok=True)
AutoModelForCausalLM.register(PanguEmbeddedConfig, PanguEmbeddedForCausalLM, exist_ok=True)
AutoTokenizer.register(PanguEmbeddedConfig, slow_tokenizer_class=PanguTokenizer, exist_ok=True)

__all__ = [
    "PanguEmbeddedConfig",
    "PanguEmbeddedModel",
    "PanguEmbeddedForCausalLM",
    "PanguEmbeddedPreTrainedModel",
    "PanguTokenizer",
    "CHAT_TEMPLATE",
    "NO_THINK_SUFFIX",
    "split_thinking",
]
