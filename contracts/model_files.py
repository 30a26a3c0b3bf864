"""A model's files on the bus: what workers put in the JetStream object store
and the ingress reads back (shared/model_store.py), and the LoRA adapters an
operator publishes there for workers to load (shared/adapter_store.py)."""

from __future__ import annotations

from msgspec import Struct

# The object store bucket (a JetStream stream, OBJ_kvlane-models).
MODEL_FILES_BUCKET = "kvlane-models"
# Adapters are objects of the same bucket under this prefix: `adapters/<name>/<revision>`.
ADAPTER_PREFIX = "adapters/"


class TokenizerFiles(Struct, frozen=True, forbid_unknown_fields=True):
    """One object: every tokenizer file of one model revision, by file name.

    One object rather than one per file, so a reader gets a whole set or
    none, never the template of one revision beside the vocabulary of another.
    """

    model: str
    revision: str
    files: dict[str, bytes]


class AdapterFiles(Struct, frozen=True, forbid_unknown_fields=True):
    """One LoRA adapter as published: its PEFT files (adapter_config.json, adapter_model.safetensors)
    by file name, the base model it was trained on, and `revision`, a hash of the files' content."""

    name: str
    base: str
    revision: str
    files: dict[str, bytes]
    # Summed sizes of the adapter's tensors, as the safetensors header gives them: what a load moves.
    tensor_bytes: int = 0
    rank: int = 0


class AdapterRef(Struct, frozen=True, array_like=True):
    """An adapter a request runs with: its name (what the client asked for) and the object holding its files."""

    name: str
    object: str
