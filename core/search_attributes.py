"""Custom search attributes: how an operator finds a run in the Temporal UI."""

from temporalio.common import SearchAttributeKey

CLEANUP_DEADLINE = SearchAttributeKey.for_datetime("CleanupDeadline")
CLEANUP_ACCOUNT_ID = SearchAttributeKey.for_keyword("CleanupAccountId")
CLEANUP_PHASE = SearchAttributeKey.for_keyword("CleanupPhase")
BUSINESS_DATE = SearchAttributeKey.for_keyword("BusinessDate")

ALL = (CLEANUP_DEADLINE, CLEANUP_ACCOUNT_ID, CLEANUP_PHASE, BUSINESS_DATE)

_CLI_TYPES = {
    "DATETIME": "Datetime",
    "KEYWORD": "Keyword",
    "INT": "Int",
    "TEXT": "Text",
    "BOOL": "Bool",
    "DOUBLE": "Double",
}


def dev_server_flags() -> list[str]:
    """`--search-attribute Name=Type` flags for `temporal server start-dev`."""
    flags: list[str] = []
    for key in ALL:
        flags += ["--search-attribute", f"{key.name}={_CLI_TYPES[key.indexed_value_type.name]}"]
    return flags
