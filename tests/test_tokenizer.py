import pytest
from transformers import AutoTokenizer

from inference.runtime.chat import IncrementalText, prompt_ids
from openpangu_model import PanguTokenizer, split_thinking


@pytest.fixture(scope="module")
def tokenizer(tiny_pangu):
    return AutoTokenizer.from_pretrained(tiny_pangu[0])


def test_auto_tokenizer_gives_pangu_tokenizer_with_pangu_special_ids(tokenizer):
    assert isinstance(tokenizer, PanguTokenizer)
    assert (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) == (0, 1, 0)
    assert tokenizer.eos_token == "[unused10]"
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("[unused10]") != tokenizer.unk_token_id


def test_bos_is_prepended_once_and_no_eos_appended(tokenizer):
    ids = tokenizer("Hello world")["input_ids"]
    assert ids[0] == 1 and ids.count(1) == 1 and ids[-1] != tokenizer.eos_token_id
    assert tokenizer("Hello world", add_special_tokens=False)["input_ids"] == ids[1:]


def test_special_tokens_are_single_ids(tokenizer):
    ids = tokenizer("[unused9]用户：hi[unused10]", add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("[unused9]")
    assert ids[-1] == tokenizer.eos_token_id


def test_chat_template_inserts_empty_system_turn(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "你好"}], tokenize=False, add_generation_prompt=True)
    assert text == "[unused9]系统：[unused10][unused9]用户：你好[unused10][unused9]助手："


def test_chat_template_keeps_given_system_turn_and_history(tokenizer):
    messages = [
        {"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"},
        {"role": "user", "content": "V"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "[unused9]系统：S[unused10][unused9]用户：U[unused10][unused9]助手：A[unused10][unused9]用户：V[unused10][unused9]助手："


def test_prompt_ids_start_with_bos_and_append_no_think(tokenizer):
    ids = prompt_ids(tokenizer, [{"role": "user", "content": "hi"}], no_think=True)
    assert ids[0] == 1
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("用户：hi /no_think[unused10][unused9]助手：")


@pytest.mark.parametrize("text", ["The quick brown fox.", "  leading spaces", "你好 世界", "def add(a, b):\n    return a"])
def test_round_trip(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_split_thinking():
    assert split_thinking("[unused16]let me think[unused17]Paris.[unused10]") == ("let me think", "Paris.")
    assert split_thinking("Paris.[unused10]") == (None, "Paris.")


@pytest.mark.parametrize("text", ["Hello world, 你好 世界! def add(a, b): return a + b", "  two  spaces"])
def test_streamed_deltas_concatenate_to_the_full_decode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = IncrementalText(tokenizer)
    chunks = [stream.push(ids[i : i + 2]) for i in range(0, len(ids), 2)]
    assert "".join(chunks) == tokenizer.decode(ids)


def test_streamed_deltas_on_demo_tokenizer(demo_model):
    _, tokenizer = demo_model
    text = "Medusa heads propose tokens; the base model verifies them. 你好!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = IncrementalText(tokenizer)
    assert "".join(stream.push([i]) for i in ids) == tokenizer.decode(ids)
