"""Errors a user can act on."""


class InputError(ValueError):
    """Bad input from a user: reported plainly, nothing is started."""
