"""The slow SentencePiece tokenizer of OpenPangu-Embedded (`tokenizer.model`)."""

from typing import Any

from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

# The chat format OpenPangu was trained on: every turn is `[unused9]ROLE：content[unused10]`, a system
# turn always comes first (an empty one when none is given), and the reply starts after `[unused9]助手：`.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '[unused9]系统：[unused10]' }}{% endif %}"
    "{% if message['role'] == 'system' %}{{ '[unused9]系统：' + message['content'] + '[unused10]' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '[unused9]助手：' + message['content'] + '[unused10]' }}{% endif %}"
    "{% if message['role'] == 'tool' %}{{ '[unused9]工具：' + message['content'] + '[unused10]' }}{% endif %}"
    "{% if message['role'] == 'function' %}{{ '[unused9]方法：' + message['content'] + '[unused10]' }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[unused9]用户：' + message['content'] + '[unused10]' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '[unused9]助手：' }}{% endif %}"
)

THINK_START = "[unused16]"
THINK_END = "[unused17]"
NO_THINK_SUFFIX = " /no_think"


class PanguTokenizer(SentencePieceBackend):
    """SentencePiece tokenizer that prepends BOS (`<s>`, id 1) and ends turns with `[unused10]` (EOS)."""

    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]
    is_fast = False

    def __init__(
        self,
        vocab_file: str,
        unk_token: str = "<unk>",
        bos_token: str = "<s>",
        eos_token: str = "[unused10]",
        pad_token: str = "<unk>",
        add_bos_token: bool = True,
        add_eos_token: bool = False,
        sp_model_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        kwargs.setdefault("chat_template", CHAT_TEMPLATE)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        kwargs.setdefault("legacy", True)
        super().__init__(
            vocab_file=vocab_file,
            unk_token=unk_token,
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=pad_token,
            add_bos_token=add_bos_token,
            add_eos_token=add_eos_token,
            sp_model_kwargs=sp_model_kwargs or {},
            **kwargs,
        )

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        # SentencePiece itself knows its whitespace and byte-fallback pieces; the generic join would
        # strip real leading spaces and print byte pieces like <0x5F> verbatim.
        return self.sp_model.decode(tokens)

    def build_inputs_with_special_tokens(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None
    ) -> list[int]:
        bos = [self.bos_token_id] if self.add_bos_token else []
        eos = [self.eos_token_id] if self.add_eos_token else []
        ids = bos + token_ids_0 + eos
        if token_ids_1 is not None:
            ids += bos + token_ids_1 + eos
        return ids

    def get_special_tokens_mask(
        self,
        token_ids_0: list[int],
        token_ids_1: list[int] | None = None,
        already_has_special_tokens: bool = False,
    ) -> list[int]:
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, already_has_special_tokens=True)
        bos = [1] if self.add_bos_token else []
        eos = [1] if self.add_eos_token else []
        mask = bos + [0] * len(token_ids_0) + eos
        if token_ids_1 is not None:
            mask += bos + [0] * len(token_ids_1) + eos
        return mask


def split_thinking(text: str) -> tuple[str | None, str]:
    """Split Pangu output `[unused16]thoughts[unused17]answer[unused10]` into (thoughts, answer).

    Thoughts are None when the model answered without thinking (e.g. after ` /no_think`).
    """
    text = text.split("[unused10]", 1)[0]
    if THINK_END not in text:
        return None, text.replace(THINK_START, "").strip()
    thoughts, answer = text.split(THINK_END, 1)
    return thoughts.replace(THINK_START, "").strip(), answer.strip()


__all__ = ["PanguTokenizer", "CHAT_TEMPLATE", "split_thinking", "NO_THINK_SUFFIX"]
