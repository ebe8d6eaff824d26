import pytest
from conftest import HF_FIXTURES

from jaxrl_scale.models.hf import load_tokenizer
from jaxrl_scale.models.tokenizer import CharTokenizer


def test_char_tokenizer_ids_and_round_trip():
    tok = CharTokenizer("abc 12\n")
    assert tok.encode("ab 1") == [2, 3, 5, 6]  # 0 <pad>, 1 <eos>, then the alphabet in order
    assert tok.decode([2, 3, 5, 6, 1]) == "ab 1"  # specials skipped by default
    assert tok.decode([2, 1], skip_special_tokens=False) == "a<eos>"
    assert tok.decode(tok.encode("c\n21 ")) == "c\n21 "
    assert tok.vocab_size == 9 and tok.eos_ids == (1,) and tok.pad_id == 0


def test_char_tokenizer_rejects_unknown_characters():
    tok = CharTokenizer("0123456789")
    with pytest.raises(ValueError, match=r"character 'x' at index 2"):
        tok.encode("12x4")
    with pytest.raises(ValueError, match="repeated"):
        CharTokenizer("aab")


def test_hf_tokenizer_same_interface():
    tok = load_tokenizer(HF_FIXTURES / "qwen2")
    ids = tok.encode("w0 w10 w93")
    assert ids == [2, 12, 95]
    assert tok.decode(ids) == "w0 w10 w93"
    assert tok.eos_ids == (0,)
    assert tok.vocab_size == 96
