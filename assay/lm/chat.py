"""Conversations as training examples: a column of chat messages rendered with the tokenizer's
chat template, the loss on the assistant's turns only, as supervised fine-tuning trains them.

Each assistant message's text is found in the rendered conversation (from the last message
back, so a reply quoted earlier is not taken for it), and the tokens that overlap it carry
loss, with the special token that closes its turn (ChatML's <|im_end|>, Llama 3's <|eot_id|>):
the model learns to stop there. Everything else (system and user turns, the template's role
markers) is context only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from assay.core.errors import AssayError

Conversation = list[dict[str, str]]


def tokenize_conversations(
    column: list[Any], rows: list[int], tokenizer: Any, name: str
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """([tokens] int32, [loss mask] bool) of each conversation in `column` (rows: their source
    ids, for errors), rendered with the tokenizer's chat template, not yet truncated."""
    convos = [_conversation(value, row, name) for value, row in zip(column, rows)]  # rows first:
    _require_template(tokenizer, name)  # a column of plain text is no conversation, template or not
    strings = [tokenizer.apply_chat_template(c, tokenize=False) for c in convos]
    # the template writes the special tokens (BOS included) itself: the tokenizer adds none
    enc = tokenizer(strings, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    closers = _special_ids(tokenizer)
    tokens, masks = [], []
    for text, convo, row, ids, offsets in zip(strings, convos, rows, enc["input_ids"], enc["offset_mapping"]):
        ids = np.asarray(ids, dtype=np.int32)
        mask = assistant_mask(
            ids,
            np.asarray(offsets, dtype=np.int64).reshape(-1, 2),
            assistant_spans(text, convo, row, name),
            closers,
        )
        tokens.append(ids)
        masks.append(mask)
    return tokens, masks


def assistant_spans(text: str, convo: Conversation, row: int, name: str) -> list[tuple[int, int]]:
    """[start, end) character spans of the assistant messages' texts in the rendered `text`."""
    spans = []
    end = len(text)
    for message in reversed(convo):
        content = message["content"]
        if message["role"] != "assistant" or not content.strip():
            continue
        start = text.rfind(content, 0, end)
        if start < 0:  # templates often strip a message's surrounding whitespace
            content = content.strip()
            start = text.rfind(content, 0, end)
        if start < 0:
            raise AssayError(
                f"dataset {name!r}: row {row}'s chat template rewrites an assistant message, so its "
                "tokens cannot be found in the rendered conversation; give the data as "
                "--prompt_column/--completion_column or --text_column instead"
            )
        spans.append((start, start + len(content)))
        end = start
    return spans[::-1]


def assistant_mask(
    ids: np.ndarray, offsets: np.ndarray, spans: list[tuple[int, int]], closers: set[int]
) -> np.ndarray:
    """[L] bool: the tokens overlapping a span, and the special token right after each (its
    turn's end). Token 0 never carries loss: nothing comes before it to predict it from."""
    mask = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        inside = np.flatnonzero((offsets[:, 0] < end) & (offsets[:, 1] > start))
        if len(inside) == 0:
            continue
        mask[inside] = True
        after = int(inside[-1]) + 1
        if after < len(ids) and int(ids[after]) in closers:
            mask[after] = True
    mask[:1] = False
    return mask


def conversation_text(value: Any) -> str:
    """A conversation as readable text: one "role: content" line per message."""
    if not isinstance(value, list):
        return str(value)
    return "\n".join(f"{m.get('role')}: {m.get('content')}" if isinstance(m, dict) else str(m) for m in value)


def _conversation(value: Any, row: int, name: str) -> Conversation:
    """The messages of one row, checked: a list of {role, content} with text in both."""
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok or not value:
        raise AssayError(
            f"dataset {name!r}: row {row} is not a conversation (a non-empty list of messages, each "
            '{"role": ..., "content": TEXT}); fix or drop that row'
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _require_template(tokenizer: Any, name: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise AssayError(
            f"dataset {name!r} holds conversations, but the model's tokenizer has no chat template; "
            "use a chat model's tokenizer, or render the conversations to text first (--text_column)"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise AssayError("conversations need a fast tokenizer (one with character offsets)")


def _special_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special tokens (those that may close a turn)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {int(i) for i, token in added.items() if getattr(token, "special", False)} | {
        int(i) for i in tokenizer.all_special_ids
    }
