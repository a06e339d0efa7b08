"""The one exception type users see: a clear line, no traceback."""


class AssayError(Exception):
    """A user-facing error: one clear line, no traceback."""
