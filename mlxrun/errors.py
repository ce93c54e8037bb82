"""User-facing errors: the CLI prints these as one line and exits non-zero."""

from pathlib import Path


class MlxrunError(Exception):
    """A problem with the user's input or machine, with a message that says what to do.

    Raised at the boundary (files, options, devices); never for internal bugs, which stay
    as ordinary exceptions with tracebacks.
    """


def read_user_text(path: str, flag: str, give: str) -> str:
    """The UTF-8 text of the file a user named with `flag`; a missing, unreadable or
    non-UTF-8 file is one MlxrunError line that names it (`give`: what to give instead)."""
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MlxrunError(f"{flag} {path}: no such file; give {give}") from None
    except UnicodeDecodeError:
        raise MlxrunError(f"{flag} {path}: not UTF-8 text; give a plain text file") from None
    except OSError as e:
        raise MlxrunError(f"{flag} {path}: cannot be read ({e.strerror or e})") from None
