"""The K3 tokenizer's on-disk form and a small byte-level BPE trainer for test checkpoints.

K3 (like Kimi K2) ships `tiktoken.model`: one line per mergeable token, "<base64 bytes> <rank>",
ranks 0..n-1, plus special tokens at ids n, n+1, ... named in `tokenizer_config.json`
(`added_tokens_decoder`). The pre-tokenizer regex is `KIMI_PAT_STR` (from Kimi's public
`tokenization_kimi.py`, `TikTokenTokenizer.pat_str`). Without a `tokenizer_config.json`, K3's
layout is assumed: 256 reserved + 2 specials after the base tokens, the named ones at the offsets
in `KIMI_SPECIAL_OFFSETS` (K3: [BOS] = 163584, <|end_of_msg|> = 163586, the XTML markers
<|open|> <|close|> <|sep|> = 163587..163589, [PAD] = 163839; the others are
`<|reserved_token_ID|>`).

Test checkpoints get a tokenizer trained here on an embedded corpus, sized to fill
`vocab_size` exactly: 256 byte tokens + merges, then `TINY_SPECIAL_TOKENS` at the top ids
(so every id a random model can sample decodes): K3's named specials in K3's order, reserved
ones between, [UNK] and [PAD] last.
"""
from __future__ import annotations

import base64
import binascii
import json
from collections import Counter, defaultdict
from pathlib import Path

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

KIMI_NUM_SPECIAL = 256 + 2
# K3 special ids as offsets from the first special id (= number of base tokens)
KIMI_SPECIAL_OFFSETS = {
    "[BOS]": 0, "[EOS]": 1, "<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4, "<|sep|>": 5,
    "[start_header_id]": 6, "[end_header_id]": 7, "[EOT]": 9, "[UNK]": 254, "[PAD]": 255,
}

# Test tokenizers: K3's named specials at K3's offsets 0..9 (reserved where K3 has none), six
# more reserved, then [UNK] and [PAD] ([PAD] at vocab_size - 1 as in K3).
_TINY_NAMED = {off: name for name, off in KIMI_SPECIAL_OFFSETS.items() if off < 10}
TINY_SPECIAL_TOKENS = (
    *(_TINY_NAMED.get(i, f"<|reserved_token_{i}|>") for i in range(15)), "[UNK]", "[PAD]",
)
# bump when TINY_SPECIAL_TOKENS changes: the tiny preset's cached checkpoint folder carries it
TINY_TOKENIZER_LAYOUT = "xtml"


class TokenizerError(ValueError):
    """A tokenizer file or input that cannot be used; the message names the file/line or value."""


# ---- tiktoken.model ------------------------------------------------------------------------

def write_tiktoken_file(path: str | Path, ranks: dict[bytes, int]) -> None:
    lines = [f"{base64.b64encode(tok).decode()} {r}\n"
             for tok, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    Path(path).write_text("".join(lines))


def read_tiktoken_file(path: str | Path) -> dict[bytes, int]:
    """Parse "<base64> <rank>" lines; ranks must be exactly 0..n-1, tokens unique."""
    p = Path(path)
    if not p.is_file():
        raise TokenizerError(f"tokenizer file {p} does not exist")
    ranks: dict[bytes, int] = {}
    seen: dict[int, int] = {}
    for lineno, line in enumerate(p.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.decode("utf-8", errors="replace").split()
        if len(parts) != 2:
            raise TokenizerError(f"{p}:{lineno}: expected '<base64 token> <rank>', got "
                                 f"{' '.join(parts)[:80]!r}")
        try:
            tok = base64.b64decode(parts[0], validate=True)
        except (binascii.Error, ValueError):
            raise TokenizerError(f"{p}:{lineno}: token {parts[0][:40]!r} is not valid "
                                 "base64") from None
        try:
            rank = int(parts[1])
        except ValueError:
            raise TokenizerError(f"{p}:{lineno}: rank {parts[1][:20]!r} is not an "
                                 "integer") from None
        if not tok:
            raise TokenizerError(f"{p}:{lineno}: empty token")
        if tok in ranks:
            raise TokenizerError(f"{p}:{lineno}: token {tok!r} repeats (first at rank "
                                 f"{ranks[tok]})")
        if rank in seen:
            raise TokenizerError(f"{p}:{lineno}: rank {rank} repeats (first on line "
                                 f"{seen[rank]})")
        ranks[tok], seen[rank] = rank, lineno
    if not ranks:
        raise TokenizerError(f"{p}: no tokens")
    if set(seen) != set(range(len(ranks))):
        missing = sorted(set(range(len(ranks))) - set(seen))[:5]
        raise TokenizerError(f"{p}: ranks must be 0..{len(ranks) - 1} without gaps; "
                             f"missing e.g. {missing}")
    missing_bytes = [b for b in range(256) if bytes([b]) not in ranks]
    if missing_bytes:
        raise TokenizerError(f"{p}: byte-level BPE needs all 256 single bytes; missing "
                             f"{len(missing_bytes)} (e.g. {missing_bytes[:5]})")
    return ranks


# ---- training ------------------------------------------------------------------------------

def train_byte_bpe(corpus: str, num_tokens: int, pat_str: str = KIMI_PAT_STR,
                   fill: bool = False) -> dict[bytes, int]:
    """Ranks for `num_tokens` base tokens: the 256 bytes (rank = byte value), then merges.

    Greedy BPE over the regex pre-tokenized corpus: repeatedly merge the most frequent adjacent
    pair (ties -> smallest (left rank, right rank)); a merge whose bytes already exist is
    applied without a new rank. Deterministic for a given corpus. When the corpus has no pair
    left, `fill` appends tokens "existing token + one byte" (in rank, then byte order) until
    `num_tokens`; otherwise that is an error.
    """
    import regex  # tiktoken's own dependency; V1 gives the `&&` class intersection

    if num_tokens < 256:
        raise TokenizerError(f"a byte-level BPE vocabulary needs >= 256 base tokens, asked "
                             f"for {num_tokens}")
    ranks = {bytes([b]): b for b in range(256)}
    vocab = [bytes([b]) for b in range(256)]
    words = Counter(m.encode() for m in regex.compile(pat_str, flags=regex.V1).findall(corpus))
    seqs = [list(w) for w in words]             # token ids of each distinct word
    freq = list(words.values())
    pairs: Counter = Counter()                  # (left, right) -> weighted count
    where: dict[tuple[int, int], set[int]] = defaultdict(set)   # pair -> words holding it
    for j, ids in enumerate(seqs):
        for pr in zip(ids, ids[1:]):
            pairs[pr] += freq[j]
            where[pr].add(j)
    while len(vocab) < num_tokens:
        live = [(c, pr) for pr, c in pairs.items() if c > 0]
        if not live:
            if not fill:
                raise TokenizerError(f"the training corpus yields only {len(vocab)} tokens; "
                                     f"{num_tokens} base tokens were asked for")
            _fill(ranks, vocab, num_tokens)
            break
        a, b = min(live, key=lambda cp: (-cp[0], cp[1]))[1]
        merged = vocab[a] + vocab[b]
        new = ranks.get(merged)
        if new is None:
            new = ranks[merged] = len(vocab)
            vocab.append(merged)
        for j in sorted(where.pop((a, b))):
            ids = seqs[j]
            for pr in zip(ids, ids[1:]):
                pairs[pr] -= freq[j]
            i, out = 0, []
            while i < len(ids):
                if i + 1 < len(ids) and ids[i] == a and ids[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(ids[i])
                    i += 1
            seqs[j] = out
            for pr in zip(out, out[1:]):
                pairs[pr] += freq[j]
                where[pr].add(j)
    return ranks


def _fill(ranks: dict[bytes, int], vocab: list[bytes], num_tokens: int) -> None:
    for a in range(num_tokens):          # vocab grows while we walk it
        for b in range(256):
            if len(vocab) == num_tokens:
                return
            cand = vocab[a] + bytes([b])
            if cand not in ranks:
                ranks[cand] = len(vocab)
                vocab.append(cand)


def _test_num_base(vocab_size: int) -> int:
    n_base = vocab_size - len(TINY_SPECIAL_TOKENS)
    if n_base < 256 + 64:
        raise TokenizerError(f"vocab_size = {vocab_size} is too small for a byte-level test "
                             f"tokenizer; need >= {256 + 64 + len(TINY_SPECIAL_TOKENS)}")
    return n_base


def tokenizer_ids_for_vocab(vocab_size: int) -> dict[str, int]:
    """bos/eos/pad ids of the test tokenizer for `vocab_size`: [BOS], <|end_of_msg|>, [PAD]
    (generation ends at <|end_of_msg|>, as K3's config.json eos_token_id does)."""
    n_base = _test_num_base(vocab_size)
    at = {name: n_base + i for i, name in enumerate(TINY_SPECIAL_TOKENS)}
    return {"bos_token_id": at["[BOS]"], "eos_token_id": at["<|end_of_msg|>"],
            "pad_token_id": at["[PAD]"]}


def write_test_tokenizer(out_dir: str | Path, vocab_size: int) -> dict[str, int]:
    """Train on the embedded corpus and write `tiktoken.model` + `tokenizer_config.json` filling
    ids 0..vocab_size-1; returns `tokenizer_ids_for_vocab(vocab_size)`."""
    n_base = _test_num_base(vocab_size)
    out = Path(out_dir)
    ranks = train_byte_bpe(TRAINING_CORPUS, n_base, fill=True)
    write_tiktoken_file(out / TIKTOKEN_FILE, ranks)
    ids = {name: n_base + i for i, name in enumerate(TINY_SPECIAL_TOKENS)}
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "added_tokens_decoder": {str(i): {"content": name, "special": True}
                                 for name, i in ids.items()},
    }
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer_ids_for_vocab(vocab_size)


TRAINING_CORPUS = """\
The river ran past the old mill and under the stone bridge, where the children waited every
evening to count the boats. Some nights there were seven boats, some nights there were none at
all, and the counting mattered less than the waiting. When the lamps came on along the bank the
water turned gold, then grey, then black, and somebody's mother would call them home for dinner.

A decoder reads one token at a time. It looks back over everything it has written so far, mixes
what it finds, and chooses the next token. Then it does the same thing again, and again, until it
writes an end marker or runs out of room. Speed comes from doing less work per step: reading fewer
bytes of weights, launching fewer kernels, and waiting less for the other GPUs to answer.

Questions people ask: What time is it? How far is the station? Can you translate this sentence?
Why does the sky look blue in the afternoon and red in the evening? Which numbers are prime:
2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47? What is 12 times 12? It is 144.

def greet(name: str) -> str:
    return f"Hello, {name}!"

for i in range(10):
    print(i, i * i, greet("world"))

{"role": "user", "content": "Summarize the meeting notes in three bullet points."}
{"role": "assistant", "content": "1. Budget approved. 2. Launch moved to May. 3. Hire two."}

Le petit café au coin de la rue ouvre à sept heures. Les étudiants arrivent, commandent un crème
et révisent leurs notes avant l'examen. Über den Dächern der Stadt zogen graue Wolken, und es
begann leise zu regnen. El mercado abre los sábados; hay frutas, pan recién hecho y música.

今天天气很好，我们一起去公园散步吧。学习语言需要时间和耐心，每天练习一点点就会进步。
人工智能模型通过大量的文本进行训练，然后根据上下文预测下一个词。

Weather report: cloudy in the morning, clearing by noon, with a high of 21 degrees and a light
wind from the west. Tomorrow: rain after 4 pm, low of 12 degrees. Pack an umbrella.

Recipe: mix two cups of flour, one cup of water, a pinch of salt and a spoon of oil. Knead for
ten minutes, rest for an hour, roll thin, and bake at 220 degrees until the edges are brown.

She opened the letter slowly. "Dear friend," it began, "I am writing to tell you that the garden
is finally growing. The tomatoes are red, the beans are climbing the fence, and the sunflowers are
taller than the door. Come and see them before the summer ends." She smiled and put the kettle on.

Math: (a + b)^2 = a^2 + 2ab + b^2; sqrt(16) = 4; 3.14159 is close to pi; 1/3 = 0.333...
Lists: apples, bananas, cherries; red, green, blue; north, south, east, west; one, two, three.
"""
