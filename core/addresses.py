"""The two addresses a command or a worker needs (TEMPORAL_ADDRESS, DATABASE_URL), checked before
anything is connected: an unset one is an AddressMissing error naming it and its flag (exit 2).

The product never starts a server: the embedded development stack lives in the checkout's
devstack package (`./dev up`), which records its addresses where the settings read them
(core.config.dev_env_file)."""

from __future__ import annotations

from core.config import Settings
from core.errors import InputError


class AddressMissing(InputError):
    """TEMPORAL_ADDRESS or DATABASE_URL is unset (neither exported, nor given as a flag, nor
    recorded by `./dev up`)."""


ADDRESS_FLAGS = {"DATABASE_URL": "--database-url", "TEMPORAL_ADDRESS": "--temporal-address"}


def missing_addresses(settings: Settings) -> list[str]:
    names = [("DATABASE_URL", settings.database_url), ("TEMPORAL_ADDRESS", settings.temporal_address)]
    return [name for name, value in names if value is None]


def address_missing(names: list[str]) -> AddressMissing:
    """Names only the addresses the command needs, and only their flags."""
    flags = " / ".join(ADDRESS_FLAGS[name] for name in names)
    return AddressMissing(
        f"{' and '.join(names)} {'is' if len(names) == 1 else 'are'} not set: export "
        f"{'it' if len(names) == 1 else 'them'} (or pass {flags}); for a local "
        "stack run `./dev up` in this checkout first"
    )


def require(settings: Settings, *, database: bool = True) -> Settings:
    """`settings` when every address the command needs is set, else AddressMissing naming the
    missing ones. `database=False`: a command that needs Temporal alone (`schedule ...`, `cleanup
    list`) asks for TEMPORAL_ADDRESS only."""
    missing = [name for name in missing_addresses(settings) if database or name != "DATABASE_URL"]
    if missing:
        raise address_missing(missing)
    return settings


def database_url(settings: Settings) -> str:
    """The database only (commands that need no Temporal): DATABASE_URL, else AddressMissing."""
    if settings.database_url is None:
        raise address_missing(["DATABASE_URL"])
    return settings.database_url
