"""Shard URL patterns, kept importable here for callers; the code lives in
:mod:`shardflow.storage.urls` (strings) and :mod:`shardflow.storage.listing` (globs)."""

from __future__ import annotations

from .storage.listing import expand_urls
from .storage.urls import SHARD_SUFFIXES, expand_braces, has_glob, join_url, parent_url, protocol_of

__all__ = ["expand_braces", "expand_urls", "has_glob", "join_url", "parent_url", "protocol_of", "SHARD_SUFFIXES"]
