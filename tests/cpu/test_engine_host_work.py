"""The engine's per-step host work that must not grow with the output or the prompt:
incremental detokenization (engine/tokenizer.py `IncrementalDecoder`, used by LLMEngine for
every sampled token) equals a full decode of the ids so far after every token — multi-byte
characters split across tokens, specials skipped, K3's channel markers; a step's tokens are read
with `Request.ids_slice` (no prompt + output copy), equal to slicing all_ids."""
import random

import pytest

from raydecode.engine.tokenizer import Tokenizer, TokenizerError
from raydecode.models.bpe import write_test_tokenizer

VOCAB = 512


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_test_tokenizer(d, VOCAB)
    return Tokenizer.from_dir(d)


def _ids(tok, rng, n):
    text = "".join(rng.choice(["a", "é", "—", "日本", "🙂", " def f(x):\n", "ß", "\t"])
                   for _ in range(n))
    ids = tok.encode(text)
    specials = list(tok.special_tokens.values())
    out = []
    for i in ids:                         # sprinkle specials, markers among them
        out.append(i)
        if rng.random() < 0.08:
            out.append(rng.choice(specials))
    # byte-level splits: single-byte tokens of a multi-byte character, out of order too
    out += [tok.encode("é")[0]] if rng.random() < 0.5 else []
    return out


@pytest.mark.parametrize("markers", [False, True])
def test_incremental_equals_full_decode_after_every_token(tok, markers):
    rng = random.Random(1234 + markers)
    for trial in range(40):
        ids = _ids(tok, rng, rng.randrange(1, 30))
        dec = tok.incremental(skip_special=True, markers=markers)
        for k in range(1, len(ids) + 1):
            got = dec.feed(ids[k - 1:k])
            assert got == tok.decode(ids[:k], skip_special=True, markers=markers), (trial, k)
        assert dec.n == len(ids)


def test_split_character_and_raw_bytes(tok):
    # a 4-byte emoji as its single-byte tokens: U+FFFD pending, then the whole character
    byte_ids = [tok.encode_bytes(bytes([b]))[0] for b in "🙂".encode()] \
        if hasattr(tok, "encode_bytes") else None
    if byte_ids is None:
        byte_ids = [i for b in "🙂".encode() for i in range(tok.vocab_size)
                    if tok.decode_bytes([i]) == bytes([b])][:4]
    assert len(byte_ids) == 4
    dec = tok.incremental()
    texts = [dec.feed([i]) for i in byte_ids]
    assert texts == [tok.decode(byte_ids[:k]) for k in range(1, 5)]
    assert texts[-1] == "🙂" and dec.utf8.getstate()[0] == b""
    # a lone continuation byte is a genuine U+FFFD: still exact as more text follows
    assert dec.feed([byte_ids[1]]) == tok.decode(byte_ids + [byte_ids[1]])
    assert dec.feed(tok.encode("ok")) == tok.decode(byte_ids + [byte_ids[1]] + tok.encode("ok"))


def test_unknown_id_raises_like_decode(tok):
    dec = tok.incremental()
    with pytest.raises(TokenizerError, match=str(VOCAB + 5)):
        dec.feed([VOCAB + 5])


def test_request_ids_slice_equals_all_ids_slices():
    from raydecode.engine.request import Request
    from raydecode.engine.sampling import SamplingParams
    rng = random.Random(7)
    for _ in range(200):
        r = Request(prompt_ids=[rng.randrange(100) for _ in range(rng.randrange(1, 9))],
                    params=SamplingParams(max_tokens=8),
                    output_ids=[rng.randrange(100) for _ in range(rng.randrange(0, 9))])
        n = r.num_tokens
        a = rng.randrange(n + 1)
        b = rng.randrange(a, n + 1)
        assert r.ids_slice(a, b) == r.all_ids[a:b], (a, b)
