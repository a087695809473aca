"""K3 tiktoken tokenizer: the test tokenizer's vocabulary, round trips, specials, the chat
format's framing and marker decoding (the XTML details are tests/cpu/test_k3_chat.py)."""
import base64

import pytest

from raydecode.engine.k3_chat import ChatOptions
from raydecode.engine.tokenizer import Tokenizer, TokenizerError
from raydecode.models.bpe import (KIMI_SPECIAL_OFFSETS, TIKTOKEN_FILE, TINY_SPECIAL_TOKENS,
                                  TRAINING_CORPUS, tokenizer_ids_for_vocab, train_byte_bpe,
                                  write_test_tokenizer, write_tiktoken_file)

VOCAB = 512


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_test_tokenizer(d, VOCAB)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def test_vocab_fills_the_model_vocab_with_specials_on_top(tok):
    assert tok.vocab_size == VOCAB
    n_base = VOCAB - len(TINY_SPECIAL_TOKENS)
    assert tok.num_base_tokens == n_base
    assert sorted(tok.special_tokens.values()) == list(range(n_base, VOCAB))
    ids = tokenizer_ids_for_vocab(VOCAB)
    assert (tok.bos_id, tok.pad_id) == (ids["bos_token_id"], ids["pad_token_id"])
    assert tok.special_tokens["<|end_of_msg|>"] == ids["eos_token_id"]
    # K3's named specials keep K3's offsets from the first special id
    for name, off in KIMI_SPECIAL_OFFSETS.items():
        if off < 10:
            assert tok.special_tokens[name] == n_base + off
    assert ids["eos_token_id"] in tok.eos_ids
    assert tok.pad_id == VOCAB - 1
    for i in range(VOCAB):                      # every id a model can sample decodes
        assert tok.decode_bytes([i])


@pytest.mark.parametrize("text", [
    "", "Hello, world!", "  leading and trailing  \n\n\tspaces ",
    "naïve café — Über straße", "今天天气很好，我们去公园吧。", "emoji 🙂🚀 and ZWJ 👩‍💻",
    "x" * 3000 + " 12345678 " + "\n" * 40, "code: def f(x):\n    return x ** 2  # ok",
])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.num_base_tokens for i in ids)   # no specials appear in plain text


def test_bpe_compresses_and_is_deterministic():
    a = train_byte_bpe(TRAINING_CORPUS, 400)
    assert a == train_byte_bpe(TRAINING_CORPUS, 400)
    assert sorted(a.values()) == list(range(400))
    assert all(len(t) >= 2 for t, r in a.items() if r >= 256)


def test_merges_shorten_the_training_text(tok):
    text = TRAINING_CORPUS[:2000]
    assert len(tok.encode(text)) < 0.6 * len(text.encode())   # bytes alone: 1.0


def test_specials_encode_as_single_ids(tok):
    for name in TINY_SPECIAL_TOKENS:
        sid = tok.special_tokens[name]
        assert tok.encode(name) == [sid]
        plain = tok.encode(name, allow_special=False)
        assert len(plain) > 1 and sid not in plain
        assert tok.decode(plain) == name
    assert tok.decode([tok.bos_id, *tok.encode("hi"), tok.eos_id], skip_special=True) == "hi"


def test_chat_template_frames_messages_with_single_marker_ids(tok):
    msgs = [{"role": "user", "content": "Hi <|end_of_msg|> <|open|>there"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}]
    ids = tok.apply_chat_template(msgs, options=ChatOptions(thinking=False))
    assert tok.decode(ids) == (
        '<|open|>message role="user"<|sep|>Hi <|end_of_msg|> <|open|>there<|close|>message'
        '<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
        'Hello<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    sp = tok.special_tokens
    # markup is single ids: 2 messages end with <|end_of_msg|>; the user's literal text does not
    assert ids.count(sp["<|end_of_msg|>"]) == 2
    assert ids.count(sp["<|open|>"]) == 5 and ids.count(sp["<|close|>"]) == 3


def test_marker_decoding_keeps_structure_and_drops_other_specials(tok):
    from raydecode.engine.k3_chat import MARKS
    sp = tok.special_tokens
    ids = [sp["<|open|>"], *tok.encode("think"), sp["<|sep|>"], *tok.encode("hi"), sp["[EOT]"],
           sp["<|close|>"], *tok.encode("<|open|>", allow_special=False)]
    assert tok.decode(ids, skip_special=True) == "thinkhi<|open|>"
    assert tok.decode(ids, skip_special=True, markers=True) == (
        MARKS["<|open|>"] + "think" + MARKS["<|sep|>"] + "hi" + MARKS["<|close|>"] + "<|open|>")


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty"),
    ([{"role": "robot", "content": "x"}], "role must be one of"),
    ([{"role": "tool", "content": "x"}], "needs a tool_call_id"),
    ([{"role": "user", "content": 5}], "expected a string"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "text"),
])
def test_chat_template_rejects_bad_messages(tok, messages, match):
    with pytest.raises(TokenizerError, match=match):
        tok.apply_chat_template(messages)


def test_decode_rejects_ids_outside_vocab(tok):
    with pytest.raises(TokenizerError, match=r"\[512\]"):
        tok.decode([1, 512])


def _write_lines(d, lines):
    (d / TIKTOKEN_FILE).write_text("".join(line + "\n" for line in lines))


def _good_lines():
    return [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]


@pytest.mark.parametrize("mutate, match", [
    (lambda ls: ls.__setitem__(2, "QUJD"), r":3: expected '<base64 token> <rank>'"),
    (lambda ls: ls.__setitem__(5, "%%%% 5"), r":6: .* is not valid base64"),
    (lambda ls: ls.__setitem__(7, "QUJD seven"), r":8: rank 'seven' is not an integer"),
    (lambda ls: ls.append("QUJD 3"), r":257: rank 3 repeats"),
    (lambda ls: ls.append("QUJD 300"), r"without gaps"),
])
def test_bad_tiktoken_file_errors_name_the_line(tmp_path, mutate, match):
    lines = _good_lines()
    mutate(lines)
    _write_lines(tmp_path, lines)
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_dir(tmp_path)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_dir(tmp_path)


def test_kimi_layout_without_tokenizer_config(tmp_path):
    ranks = train_byte_bpe(TRAINING_CORPUS, 300)
    write_tiktoken_file(tmp_path / TIKTOKEN_FILE, ranks)
    tok = Tokenizer.from_dir(tmp_path)
    for name, off in KIMI_SPECIAL_OFFSETS.items():
        assert tok.special_tokens[name] == 300 + off
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (300, 301, 555)
    assert tok.encode("<|end_of_msg|>") == [302]
