"""The one exception type users see: a clear line, no traceback."""


class AssayError(Exception):
    """A user-facing error: one clear line, no traceback."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (or its type), for one-line errors."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
