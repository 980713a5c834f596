"""Errors a user can act on."""

from pydantic import ValidationError


class InputError(ValueError):
    """Bad input from a user: reported plainly, nothing is started."""


class HeaderInjectionError(ValueError):
    """A header name or value built from data would break the request (CR/LF, control characters).

    The message names the header, never its value (it may be a credential)."""


def validation_message(err: ValidationError) -> str:
    """A pydantic error as one line a user can act on: `field: problem; field: problem`."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}" for e in err.errors())
