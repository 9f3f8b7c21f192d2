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
import os
import secrets
from pathlib import Path

from common.schema import Message, encode

__all__ = ["RUN_KEY_FILE", "SIGNATURE", "Signer", "make_run_key"]

SIGNATURE = "signature"  # the lineage key
RUN_KEY_FILE = "signing.key"  # in the run directory: the run's own key (pipeline.run_key)


def make_run_key(run_dir: Path) -> Path:
    """The file of the run's own signing key in ``run_dir``, made once (a random key, mode 0600, linked into place so
    that of services starting at once one writes it and every one reads the same). Raises OSError when it cannot."""
    path = run_dir / RUN_KEY_FILE
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        made = run_dir / f".{RUN_KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        made.write_text(secrets.token_hex(32) + "\n")
        made.chmod(0o600)
        try:
            os.link(made, path)  # fails if another service made it first: its key is the run's
        except FileExistsError:
            pass
        finally:
            made.unlink()
    return path


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
