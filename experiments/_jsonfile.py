"""Reading one JSON object from a file: the one parser of every results, cost and run file.

The outcomes are told apart so that each caller keeps its own policy (a damaged results file
ends the command naming it; a damaged run ``result.json`` is an unfinished run, resumed):

- no such file: ``None``;
- the system cannot read it (permissions, I/O error): ``UnreadableJsonFile``;
- its bytes are no JSON text (not UTF-8, empty, cut off mid-write): ``InvalidJsonFile``;
- valid JSON, but not an object (a file of another kind): ``NotAJsonObject``.

All three are ``JsonFileError`` (a ``DamchaValueError``) whose message starts with the path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from damcha_core import DamchaValueError


class JsonFileError(DamchaValueError):
    """A JSON file that cannot be used; ``str()`` is ``f"{path} {reason}"``."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path} {reason}")
        self.path, self.reason = path, reason


class UnreadableJsonFile(JsonFileError):
    """The system cannot read the file (``OSError``): no statement about its content."""


class InvalidJsonFile(JsonFileError):
    """The file's content is no JSON text: not UTF-8, empty, or not valid JSON (cut off mid-write?)."""


class NotAJsonObject(JsonFileError):
    """The file is valid JSON, but not an object (a file of another kind)."""


def read_json_object(path: str | Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None if there is no such file; a ``JsonFileError`` subclass
    naming the file and what is wrong otherwise (see the module docstring)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # no such file (NotADirectory: a parent is a file)
        return None
    except OSError as exc:
        raise UnreadableJsonFile(path, f"cannot be read ({type(exc).__name__}: {exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Bytes that are not UTF-8 are damaged content, not a system error; the wording is the
        # one the report has always printed for them.
        raise InvalidJsonFile(path, f"cannot be read ({type(exc).__name__}: {exc})") from None
    try:
        obj = json.loads(text)
    except ValueError as exc:
        what = "empty" if not text.strip() else "not valid JSON"
        raise InvalidJsonFile(path, f"is {what} ({exc}; cut off mid-write?)") from None
    if not isinstance(obj, dict):
        raise NotAJsonObject(path, f"holds a JSON {type(obj).__name__}, expected a JSON object")
    return obj
