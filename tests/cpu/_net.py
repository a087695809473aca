"""Shared test helper: a free local TCP port (gloo rendezvous, HTTP servers)."""
from __future__ import annotations

from raydecode.commands.serve import free_loopback_port as free_port

__all__ = ["free_port"]
