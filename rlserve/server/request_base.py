"""The base of every request body: an unknown field, a number that is NaN or infinite, or a string that is not
Unicode text is a 400 naming the field."""

from __future__ import annotations

from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, model_validator

from rlserve.server.errors import APIError


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The location ("messages.0.content") of the first string in `value` that is not Unicode text: a lone surrogate,
    which JSON's "\\ud800" escape makes. Tokenizers raise TypeError on such strings and UTF-8 cannot encode them."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode()
        except UnicodeEncodeError:
            return path or "request body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found = lone_surrogate_path(key, where) or lone_surrogate_path(item, where)
            if found:
                return found
    elif isinstance(value, list):
        # A list of numbers (token ids, up to millions of them) is not walked: a string among them fails the schema.
        if value and isinstance(value[0], int | float):
            return None
        for i, item in enumerate(value):
            found = lone_surrogate_path(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


def _may_hold_lone_surrogate(value: Any) -> bool:
    """False when `value` is JSON whose strings are all Unicode text, found by msgspec's encoder (which refuses
    them) in a tenth of the time the walk of lone_surrogate_path takes over a large body; True when the walk must
    look (a lone surrogate, or objects the encoder does not know)."""
    try:
        msgspec.json.encode(value)
    except (UnicodeEncodeError, TypeError, ValueError, OverflowError):
        return True
    return False


class OpenAIBaseModel(BaseModel):
    # NaN and infinities (Python's JSON parser reads them) are no number a request can mean: a 400 naming the field.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        """400 naming the field for a string that is not Unicode text; checked by the outermost model first, so the
        location is the whole path."""
        where = lone_surrogate_path(data) if _may_hold_lone_surrogate(data) else None
        if where is not None:
            top = where.split(".", 1)[0]
            raise APIError(400, f"{where}: holds a lone surrogate (\\ud800-\\udfff): not Unicode text", top)
        return data
