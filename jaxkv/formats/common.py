"""What every format reader shares: JSON files, parser errors and config errors as
CheckpointErrors that name the file."""

import json
import os

from jaxkv.core.config import Config
from jaxkv.models.maps import CheckpointError


def read_json(file: str) -> dict:
    """A JSON object from file; anything else is a CheckpointError naming the file and where."""
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def holds(directory: str, name: str) -> bool:
    """Whether directory holds the file name; a directory of that name there is a
    CheckpointError saying so (not a file found missing)."""
    file = os.path.join(directory, name)
    if os.path.isdir(file):
        raise CheckpointError(f"{file}: is a directory; expected the file {name}")
    return os.path.isfile(file)


def parse_error(file: str, what: str, error: Exception) -> CheckpointError:
    """The CheckpointError for a file a third-party parser rejected (its message kept)."""
    return CheckpointError(f"{file}: not a valid {what} (truncated or corrupt?): "
                           f"{type(error).__name__}: {error}")


def build_config(make, source: str) -> Config:
    """make(); Config's own validation errors (a zero width, a null count, a string where a
    number belongs) become CheckpointErrors naming the file they came from."""
    try:
        return make()
    except CheckpointError:
        raise
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{source}: {e}") from None
