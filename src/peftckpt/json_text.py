"""JSON read from files a user or an adversary controls: a parse error, whatever the text, never a traceback.

``json.loads`` refuses nesting deeper than the interpreter's recursion limit with a ``RecursionError`` (quickly:
no memory grows), which callers that catch ``json.JSONDecodeError`` would let out as a traceback. :func:`parse_json`
reports it as the ``JSONDecodeError`` every other malformed text raises.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["parse_json"]


def parse_json(text: str | bytes | bytearray) -> Any:
    """``json.loads(text)``; nesting too deep to parse raises ``json.JSONDecodeError`` like any malformed text."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply to parse", "", 0) from None
