"""A model's files on the bus: what workers put in the JetStream object store
and the ingress reads back (shared/model_store.py)."""

from __future__ import annotations

from msgspec import Struct

# The object store bucket (a JetStream stream, OBJ_kvlane-models).
MODEL_FILES_BUCKET = "kvlane-models"


class TokenizerFiles(Struct, frozen=True, forbid_unknown_fields=True):
    """One object: every tokenizer file of one model revision, by file name.

    One object rather than one per file, so a reader gets a whole set or
    none, never the template of one revision beside the vocabulary of another.
    """

    model: str
    revision: str
    files: dict[str, bytes]
