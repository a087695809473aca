"""API keys of the OpenAI routes: where they come from and how a request's key is checked.

Sources (all accepted together, as vLLM's `--api-key` / `VLLM_API_KEY` users expect):
  * `serve.api_keys` in the deployment config (`raydecode serve … --api-key KEY` adds to it);
  * `serve.api_key_file`: one key per line ('#' starts a comment), e.g. a mounted secret;
  * the environment variable RAYDECODE_API_KEY of the ingress process (several keys comma
    separated), e.g. a Kubernetes secret on the Ray pods (`env_api_keys`, the one read).
With no key from any source the routes are open.

Keys are held only as SHA-256 digests; a presented key is hashed and compared with every
digest by `hmac.compare_digest` (constant time, no early exit), so neither its content nor
which key matched shows in the timing. No message, log line, metric or repr carries a key.
"""
from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Iterable

from raydecode.kernels import settings

ENV_API_KEY = "RAYDECODE_API_KEY"


class APIKeyError(ValueError):
    """Keys that cannot be used; the message names the source, never a key."""


def env_api_keys() -> list[str]:
    """The keys in $RAYDECODE_API_KEY (comma separated); [] when unset."""
    return [k.strip() for k in settings.api_keys().split(",") if k.strip()]


def read_key_file(path: str | Path) -> list[str]:
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise APIKeyError(f"serve.api_key_file {str(p)!r}: cannot be read "
                          f"({type(e).__name__})") from None
    keys = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    for n, k in enumerate(keys, start=1):
        check_key(k, f"serve.api_key_file {str(p)!r}, key {n}")
    return keys


def check_key(key: str, where: str) -> str:
    if not key or any(c.isspace() or c == "," for c in key) or not key.isprintable():
        raise APIKeyError(f"{where}: a key must be non-empty printable text without "
                          "whitespace or commas")
    return key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class APIKeys:
    """The accepted keys (as digests). Falsy when there are none: the routes are open."""

    def __init__(self, keys: Iterable[str] = ()):
        self._digests = tuple(sorted({_digest(k) for k in keys}))

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"APIKeys({len(self)} keys)"

    def check(self, authorization: str | None) -> str | None:
        """None if `authorization` (the header's value) carries an accepted bearer key, else
        why not: 'missing' or 'invalid'."""
        if not self._digests:
            return None
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return "missing"
        d, ok = _digest(token), False
        for accepted in self._digests:                 # every one: no early exit
            ok |= hmac.compare_digest(d, accepted)
        return None if ok else "invalid"


def resolve_api_keys(serve_options) -> APIKeys:
    """All keys of a deployment (ServeOptions): config keys, key file, environment."""
    keys = [k.get_secret_value() for k in serve_options.api_keys]
    if serve_options.api_key_file:
        keys += read_key_file(serve_options.api_key_file)
    for n, k in enumerate(env_api_keys(), start=1):
        keys.append(check_key(k, f"${ENV_API_KEY}, key {n}"))
    return APIKeys(keys)
