"""The one exception type users see: its message is the whole story, printed on one line."""


class QuasarError(Exception):
    """A problem with the user's input or environment, explained in one line (no traceback)."""
