"""Lines that share a prompt prefix, side by side: a batch's requests ordered so that those sharing a long prefix (one
system prompt and document, many questions) travel in one chunk, hence to one worker, and run together there, where
the prefix cache computes the prefix once.

The API has no tokenizer, so a prompt is keyed by its text (chat messages in order, role included): lines sharing a
text prefix share a token prefix but for the tokens at its end. The key is a chain of hashes of fixed-size pieces of
that text, so sorting by it puts lines sharing their first k pieces next to each other for every k, at a bounded
cost per line however long the prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence


def prefix_order_enabled() -> bool:
    """SLUICE_PREFIX_ORDER: 1 (default) groups a batch's lines by prompt prefix, 0 keeps file order (benchmarks)."""
    raw = os.environ.get("SLUICE_PREFIX_ORDER", "1")
    if raw not in ("0", "1"):
        raise ValueError(f"SLUICE_PREFIX_ORDER={raw!r}: give 1 (group lines by prompt prefix) or 0 (file order)")
    return raw == "1"


PIECE_CHARS = 256  # about 64 tokens: a prefix shorter than this is not worth keeping together
MAX_PIECES = 64  # text past 16 KiB decides nothing more


def prompt_text(body) -> str:
    """A request body's prompt as text: chat messages in order (role, name, content), or the completion prompt."""
    messages = getattr(body, "messages", None)
    if messages is None:
        prompt = body.prompt
        return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    return "".join(f"\x1e{m.role}\x1f{m.name or ''}\x1f{_content(m.content)}" for m in messages)


def _content(content) -> str:
    return content if isinstance(content, str) else json.dumps(content, sort_keys=True, default=str)


def prefix_key(text: str) -> tuple[bytes, ...]:
    """Each piece's hash chained to the pieces before it: equal first k entries mean an equal first k pieces."""
    key, digest = [], hashlib.blake2b(digest_size=8)
    for start in range(0, min(len(text), PIECE_CHARS * MAX_PIECES), PIECE_CHARS):
        digest.update(text[start:start + PIECE_CHARS].encode("utf-8", "surrogatepass"))
        key.append(digest.copy().digest())
    return tuple(key)


def prefix_groups(keys: Sequence[tuple[bytes, ...]]) -> list[list[int]]:
    """Indices into `keys`, grouped: lines sharing at least their first piece are in one group, groups and lines
    within them ordered by key (a stable sort: file order among equal keys)."""
    order = sorted(range(len(keys)), key=keys.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and keys[i][:1] and keys[groups[-1][-1]][:1] == keys[i][:1]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def pack(groups: Iterable[list[int]], size: int) -> list[list[int]]:
    """Chunks of at most `size` items that never split a group that fits in one; a larger group fills chunks of its
    own. Lone lines fill the room groups leave."""
    chunks: list[list[int]] = []
    current: list[int] = []
    for group in groups:
        if len(group) > size:
            chunks += [group[start:start + size] for start in range(0, len(group), size)]
            continue
        if len(current) + len(group) > size:
            chunks.append(current)
            current = []
        current += group
    if current:
        chunks.append(current)
    return chunks
