"""API keys: ``Authorization: Bearer KEY``, compared in constant time.

Only SHA-256 digests of the keys are kept, and a presented key is checked against every
digest with ``hmac.compare_digest`` (no early exit), so neither the comparison time nor
a memory dump gives a key away.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    """The keys clients may present. With no keys, every request is allowed."""

    def __init__(self, keys: Iterable[str] | None) -> None:
        self._digests = [_digest(key) for key in keys or () if key]

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def allows(self, authorization: str | None) -> bool:
        """Whether the ``Authorization`` header value carries one of the keys."""
        if not self.required:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        presented = _digest(token.strip())
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(digest, presented)
        return matched
