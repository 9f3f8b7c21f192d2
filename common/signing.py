"""Signatures on what a run's services publish: only a holder of the run's key can make a message they accept.

Digests catch damage, not forgery: a writer with access to the shared store and the topics can write a snapshot,
compute its digest and announce it. With a key (``pipeline.signing_key_env`` or ``signing_key_file``, given by
reference like the SASL password) every message a service publishes carries ``lineage["signature"]``, an
HMAC-SHA256 of the message's encoding without it; a message that is unsigned or signed with another key is
refused (dead-lettered, counted). A weight announcement names its snapshot's digest, and a batch sent by reference
is signed as the batch it carries, so the signature vouches for the files too. Broker ACLs stay the first line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac

from common.schema import Message, encode

__all__ = ["SIGNATURE", "Signer"]

SIGNATURE = "signature"  # the lineage key


class Signer:
    def __init__(self, key: bytes):
        if not key:
            raise ValueError("an empty signing key signs nothing")
        self._key = key

    def _mac(self, message: Message) -> str:
        lineage = {k: v for k, v in message.lineage.items() if k != SIGNATURE}
        payload = encode(dataclasses.replace(message, lineage=lineage))
        return hmac.new(self._key, payload, hashlib.sha256).hexdigest()

    def sign(self, message: Message) -> None:
        """Set (or replace: lineage is carried from stage to stage) the message's signature."""
        message.lineage.pop(SIGNATURE, None)
        message.lineage[SIGNATURE] = self._mac(message)

    def verify(self, message: Message) -> bool:
        signature = message.lineage.get(SIGNATURE)
        return isinstance(signature, str) and hmac.compare_digest(signature, self._mac(message))
