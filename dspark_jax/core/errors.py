"""The one exception type users see as a single line (CLIs catch it and exit non-zero)."""


class UserError(Exception):
    """Bad input from the user: an unknown name, a missing or corrupt file, an unsupported model.

    Command-line entry points print `error: <message>` and exit with status 2; they never show a
    traceback for these.
    """
