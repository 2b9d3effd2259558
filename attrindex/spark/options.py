"""Reading the string options Spark hands a data source into typed settings, with clear errors.

Spark lower-cases option names, so every lookup here is by the lower-cased name; messages quote
the names as users write them (``keyColumn``). Options prefixed ``storage.`` become fsspec storage
options: ``true``/``false`` become booleans and values starting with ``{`` or ``[`` are parsed as
JSON (for nested settings like ``client_kwargs``); everything else stays a string.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from ..errors import InvalidInputError

STORAGE_PREFIX = "storage."


class Options:
    """The options of one read or write of data source ``source``."""

    def __init__(self, raw: Mapping[str, str], source: str):
        self.raw = {str(k).lower(): v for k, v in dict(raw).items()}
        self.source = source

    def _error(self, message: str) -> InvalidInputError:
        return InvalidInputError(f"{self.source}: {message}")

    def has(self, name: str) -> bool:
        return name.lower() in self.raw

    def required(self, name: str, what: str) -> str:
        value = self.raw.get(name.lower())
        if value is None or not str(value).strip():
            raise self._error(f"the option {name!r} is required ({what}): .option({name!r}, ...)")
        return str(value)

    def text(self, name: str, default: str | None = None) -> str | None:
        value = self.raw.get(name.lower())
        return default if value is None else str(value)

    def integer(self, name: str, default: int | None = None, *, minimum: int | None = None) -> int | None:
        value = self.raw.get(name.lower())
        if value is None:
            return default
        try:
            number = int(str(value).strip())
        except ValueError:
            raise self._error(f"the option {name!r} must be an integer, got {value!r}") from None
        if minimum is not None and number < minimum:
            raise self._error(f"the option {name!r} must be >= {minimum}, got {number}")
        return number

    def choice(self, name: str, choices: tuple[str, ...], default: str) -> str:
        value = str(self.raw.get(name.lower(), default)).strip().lower()
        if value not in choices:
            raise self._error(f"the option {name!r} must be one of {', '.join(choices)}; got {value!r}")
        return value

    def int_set(self, name: str) -> frozenset[int]:
        """A comma-separated list of ints >= 0 (empty when absent)."""
        value = self.raw.get(name.lower())
        if not value:
            return frozenset()
        try:
            numbers = frozenset(int(part) for part in str(value).split(",") if part.strip())
        except ValueError:
            raise self._error(f"the option {name!r} must be comma-separated integers, got {value!r}") from None
        if any(n < 0 for n in numbers):
            raise self._error(f"the option {name!r} takes integers >= 0, got {value!r}")
        return numbers

    def storage_options(self) -> dict[str, Any]:
        """The ``storage.*`` options, prefix removed, for ``open_storage`` (``single_writer`` refused)."""
        from .checks import refuse_single_writer

        options = {name[len(STORAGE_PREFIX):]: _storage_value(value)
                   for name, value in self.raw.items() if name.startswith(STORAGE_PREFIX)}
        refuse_single_writer(options, self.source)
        return options


def _storage_value(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text[:1] in ("{", "["):
        try:
            return json.loads(text)
        except ValueError:
            raise InvalidInputError(f"storage option value {value!r} looks like JSON but does not parse") from None
    return value
