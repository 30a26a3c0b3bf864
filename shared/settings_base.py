"""What every configuration section shares: strict decoding, and the bounds most fields use."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

PositiveFloat = Annotated[float, Meta(gt=0)]
PositiveInt = Annotated[int, Meta(ge=1)]


class ConfigError(ValueError):
    """Raised with a message that names the bad key and where it came from."""


class Section(Struct, forbid_unknown_fields=True, kw_only=True):
    """A configuration section: an unknown key is an error, never ignored."""
