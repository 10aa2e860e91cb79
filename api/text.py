"""Text that PostgreSQL, JSON and HTTP can carry: checks for lone surrogates and NULs, and a printable escape."""

from __future__ import annotations

import re

SURROGATE = re.compile("[\ud800-\udfff]")  # code points UTF-8 cannot encode; a str holds them only unpaired


def valid_unicode(text: str) -> bool:
    """Whether UTF-8 (and so PostgreSQL, JSON and HTTP) can hold the text: no surrogate code point, which a lone
    \\uD800-\\uDFFF escape in JSON gives."""
    return SURROGATE.search(text) is None


def storable(text: str) -> bool:
    """Whether PostgreSQL text can hold it: valid Unicode and no NUL (a query binding either fails)."""
    return "\x00" not in text and valid_unicode(text)


def readable(text: str) -> str:
    """The text with any surrogate code point written as its escape, so that it can be stored and shown."""
    return text.encode("utf-8", "backslashreplace").decode()
