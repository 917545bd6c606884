"""Prefix keys of KV pages: which tokens a full page holds, and everything before them.

The prefix cache (:class:`~jaxpar.engine._pages.PageTable`) indexes full pages by a *hash
chain*, as vLLM does: page i's key is a digest of page i-1's key and page i's tokens, and
page 0's parent is a digest of what else decides K/V (the model, its dtype). Equal keys
mean an equal sequence from the first token to the page's last, so equal K/V.

Why a chain of page keys and not a radix tree over tokens (SGLang's): pages are the unit
that can be shared (a row's block table points at whole pages, and a shared page is
never written), so a match finer than a page would buy nothing without copying a
partial page. A dict lookup per page finds the longest cached prefix in O(pages), and
eviction is per page, least recently used, with no tree to rebalance.

Digests are 128-bit BLAKE2b: a collision would silently serve another prompt's K/V, so
Python's 64-bit ``hash`` (and its per-process salt) is not used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

DIGEST_BYTES = 16


def cache_salt(*parts: object) -> bytes:
    """The chain's root: a digest of everything besides the tokens that changes K/V (the
    model config with its dtype; later, adapters or multimodal inputs)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=DIGEST_BYTES).digest()


def page_keys(tokens: Sequence[int], page_size: int, salt: bytes, pages: int | None = None):
    """Keys of the first ``pages`` full pages of ``tokens`` (default: every full page)."""
    full = len(tokens) // page_size
    n = full if pages is None else min(pages, full)
    ids = np.asarray(tokens[: n * page_size], np.int64)
    keys, parent = [], salt
    for i in range(n):
        page = ids[i * page_size : (i + 1) * page_size].tobytes()
        parent = hashlib.blake2b(parent + page, digest_size=DIGEST_BYTES).digest()
        keys.append(parent)
    return keys
