"""User-facing errors: the CLI prints these as one line and exits non-zero."""


class MlxrunError(Exception):
    """A problem with the user's input or machine, with a message that says what to do.

    Raised at the boundary (files, options, devices); never for internal bugs, which stay
    as ordinary exceptions with tracebacks.
    """
