"""K3 tokenizer: tiktoken BPE (`tiktoken.model`) + Kimi special tokens + K3's chat format.

The chat format is K3's XTML (engine/k3_chat.py): messages framed by the special tokens
<|open|>, <|sep|>, <|close|> and <|end_of_msg|>; no [BOS]/[EOS] is emitted. Message text is
encoded as ordinary text, so a user writing "<|end_of_msg|>" cannot end a message.
"""
from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import tiktoken

from raydecode.models.bpe import (
    KIMI_NUM_SPECIAL, KIMI_PAT_STR, KIMI_SPECIAL_OFFSETS, TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE,
    TokenizerError, read_tiktoken_file,
)

from . import k3_chat

__all__ = ["Tokenizer", "TokenizerError"]

_END_TOKENS = (k3_chat.END_OF_MSG, "[EOS]", "[EOT]")
# tiktoken's regex backtracks badly on very long runs (tiktoken issue #195); cut runs of
# same-class (whitespace / non-whitespace) characters at this length before encoding
_MAX_RUN = 25_000


@dataclass(frozen=True)
class _Specials:
    ids: dict[str, int]       # name -> id
    bos: str
    eos: str
    pad: str | None
    unk: str | None


def _token_name(v, field: str, path: Path) -> str | None:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    raise TokenizerError(f"{path}: {field} = {v!r}; expected a string or {{'content': ...}}")


def _read_specials(d: Path, n_base: int) -> _Specials:
    cfg_path = d / TOKENIZER_CONFIG_FILE
    if not cfg_path.is_file():  # Kimi's layout: 258 specials right after the base tokens
        named = {i: n for n, i in KIMI_SPECIAL_OFFSETS.items()}
        ids = {named.get(i, f"<|reserved_token_{n_base + i}|>"): n_base + i
               for i in range(KIMI_NUM_SPECIAL)}
        return _Specials(ids, "[BOS]", "[EOS]", "[PAD]", "[UNK]")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{cfg_path}: malformed JSON ({e})") from None
    added = cfg.get("added_tokens_decoder") or {}
    if not isinstance(added, dict):
        raise TokenizerError(f"{cfg_path}: added_tokens_decoder must be an object id -> token")
    ids: dict[str, int] = {}
    for k, v in added.items():
        name = _token_name(v, f"added_tokens_decoder[{k!r}]", cfg_path)
        if not k.isdigit() or name is None:
            raise TokenizerError(f"{cfg_path}: added_tokens_decoder entry {k!r}: {v!r}; "
                                 "expected a decimal id mapping to {'content': ...}")
        if int(k) < n_base:
            raise TokenizerError(f"{cfg_path}: special token {name!r} has id {k}, inside the "
                                 f"{n_base} BPE tokens of {TIKTOKEN_FILE}")
        ids[name] = int(k)
    names = {f: _token_name(cfg.get(f), f, cfg_path) for f in
             ("bos_token", "eos_token", "pad_token", "unk_token")}
    sp = _Specials(ids, names["bos_token"] or "[BOS]", names["eos_token"] or "[EOS]",
                   names["pad_token"], names["unk_token"])
    for f, name in (("bos_token", sp.bos), ("eos_token", sp.eos), ("pad_token", sp.pad),
                    ("unk_token", sp.unk)):
        if name is not None and name not in ids:
            raise TokenizerError(f"{cfg_path}: {f} = {name!r} is not among the special tokens "
                                 f"{sorted(ids)[:20]}")
    return sp


def _split_long_runs(s: str) -> Iterator[str]:
    start, run, space = 0, 0, s[:1].isspace()
    for i, ch in enumerate(s):
        if ch.isspace() != space:
            space, run = ch.isspace(), 1
        else:
            run += 1
            if run > _MAX_RUN:
                yield s[start:i]
                start, run = i, 1
    yield s[start:]


class Tokenizer:
    """tiktoken BPE over the Kimi regex; ids are the model's token ids."""

    def __init__(self, ranks: dict[bytes, int], specials: _Specials, name: str = "k3",
                 extra_eos_ids: Sequence[int] = ()):
        self._enc = tiktoken.Encoding(name=name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                      special_tokens=specials.ids)
        self.special_tokens: dict[str, int] = dict(specials.ids)
        self.num_base_tokens = len(ranks)
        self.vocab_size = self._enc.max_token_value + 1
        self.bos_id = specials.ids[specials.bos]
        self.eos_id = specials.ids[specials.eos]
        self.pad_id = specials.ids[specials.pad] if specials.pad else None
        self.unk_id = specials.ids[specials.unk] if specials.unk else None
        ends = {specials.ids[t] for t in _END_TOKENS if t in specials.ids}
        self.eos_ids: tuple[int, ...] = tuple(sorted(ends | {self.eos_id} | set(extra_eos_ids)))
        self._valid = set(ranks.values()) | set(specials.ids.values())
        self._marks = {specials.ids[t]: c for t, c in k3_chat.MARKS.items() if t in specials.ids}

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """`path/tiktoken.model` (+ `tokenizer_config.json`, + `config.json` eos_token_id)."""
        d = Path(path)
        ranks = read_tiktoken_file(d / TIKTOKEN_FILE)
        specials = _read_specials(d, len(ranks))
        extra: list[int] = []
        model_cfg = d / "config.json"
        if model_cfg.is_file():
            try:
                eos = json.loads(model_cfg.read_text()).get("eos_token_id")
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{model_cfg}: malformed JSON ({e})") from None
            extra = [eos] if isinstance(eos, int) else list(eos or [])
        tok = cls(ranks, specials, name=d.name or "k3", extra_eos_ids=extra)
        missing = [t for t in k3_chat.MARKUP_TOKENS if t not in tok.special_tokens]
        if missing:
            raise TokenizerError(f"{d}: special tokens {missing} are missing; the K3 chat "
                                 "format needs them")
        return tok

    # ---- text <-> ids ----------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Text -> ids. With allow_special, special-token strings become their single ids."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        out: list[int] = []
        for piece in _split_long_runs(text):
            if allow_special:
                out.extend(self._enc.encode(piece, allowed_special="all"))
            else:
                out.extend(self._enc.encode_ordinary(piece))
        return out

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        bad = [i for i in ids if i not in self._valid]
        if bad:
            raise TokenizerError(f"token ids {bad[:5]} are not in this vocabulary "
                                 f"(0..{self.vocab_size - 1})")
        return self._enc.decode_bytes(list(ids))

    def decode(self, ids: Sequence[int], skip_special: bool = False,
               markers: bool = False) -> str:
        """Ids -> text; invalid UTF-8 (a split multi-byte character) decodes as U+FFFD. With
        `markers`, K3's structural tokens <|open|> <|close|> <|sep|> decode as the characters
        of `k3_chat.MARKS` (the chat output parser reads them) and the text between them is
        decoded run by run."""
        if markers and self._marks:
            parts, run = [], []
            for i in ids:
                if i in self._marks:
                    parts += [self.decode(run, skip_special), self._marks[i]]
                    run = []
                else:
                    run.append(i)
            return "".join(parts) + self.decode(run, skip_special)
        if skip_special:
            specials = set(self.special_tokens.values())
            ids = [i for i in ids if i not in specials]
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def incremental(self, skip_special: bool = False, markers: bool = False) -> "IncrementalDecoder":
        """A decoder fed one request's output ids as they come: the same text as `decode` of
        all of them, at a cost per token that does not grow with the output."""
        return IncrementalDecoder(self, skip_special, markers)

    # ---- chat ------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tools: Sequence[dict] | None = None,
                            options: k3_chat.ChatOptions = k3_chat.ChatOptions()) -> list[int]:
        """OpenAI-style messages -> prompt ids in K3's chat format (engine/k3_chat.py)."""
        return self.render_chat(messages, tools, options, add_generation_prompt).ids

    def render_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    options: k3_chat.ChatOptions = k3_chat.ChatOptions(),
                    add_generation_prompt: bool = True) -> k3_chat.ChatPrompt:
        """The prompt ids and where generation starts (for the output parser)."""
        return k3_chat.render(self, messages, tools, options, add_generation_prompt)


class IncrementalDecoder:
    """`Tokenizer.decode(ids, skip_special, markers)` of a growing id list, incrementally.

    Byte-level BPE: the text is the UTF-8 decoding (errors replaced) of the ids' bytes, run by
    run between markers. Python's incremental UTF-8 decoder gives exactly the full decoding's
    characters for all but a trailing incomplete sequence (at most 3 bytes, which it buffers);
    the text so far is that plus the buffered bytes decoded alone, as a full decode would. So a
    token costs the same however long the output, invalid bytes included."""

    def __init__(self, tok: Tokenizer, skip_special: bool, markers: bool):
        self.tok = tok
        self.marks = tok._marks if markers else {}
        self.specials = set(tok.special_tokens.values()) if skip_special else set()
        self.text = ""                              # all but the buffered bytes' character
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.n = 0                                  # ids consumed

    def feed(self, ids: Sequence[int]) -> str:
        """Consume ids (the output's next ones) -> the text of everything consumed."""
        for i in ids:
            self.n += 1
            b = self.tok.decode_bytes([i])          # validates like decode (raises if unknown)
            if i in self.marks:                     # a run ends: flush it, then the marker
                self.text += self.utf8.decode(b"", final=True) + self.marks[i]
                self.utf8.reset()
            elif i not in self.specials:
                self.text += self.utf8.decode(b, final=False)
        return self.text + self.utf8.getstate()[0].decode("utf-8", errors="replace")
