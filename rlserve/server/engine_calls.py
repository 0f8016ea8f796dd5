"""An engine call made for a control route, its failure answered as the route's error: a ValueError (bad input) is a
400 naming the field, a RuntimeError (a call out of lifecycle order, e.g. an update before its start) a 409; neither
takes the server down."""

from __future__ import annotations

from collections.abc import Awaitable, Collection
from typing import TypeVar

from rlserve.server.errors import APIError

T = TypeVar("T")


async def engine_call(
    call: Awaitable[T], param: str | None = None, fields: Collection[str] = (), data_param: str | None = None
) -> T:
    """`data_param`: the field whose free-form data (init_info, update_info, args) the call carries to the core."""
    try:
        return await call
    except ValueError as e:
        raise APIError.from_value_error(e, fields, param) from e
    except RuntimeError as e:
        raise APIError(409, str(e), param) from e
    except OverflowError as e:  # the message to the core process carries integers of 64 bits at most
        where = data_param or param
        raise APIError(400, f"{where or 'request body'}: a number out of range ({e})", where) from e
