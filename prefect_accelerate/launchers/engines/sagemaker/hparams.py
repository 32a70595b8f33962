"""Script arguments as SageMaker hyperparameters, with Accelerate's typing rules (reference §4.3.5).

SageMaker passes hyperparameters to the entry point as `--name value` pairs, so the script's arguments
must be such pairs. Values are typed as Accelerate types them: a number becomes an int when it is whole
(`3`, `1e3` -> 1000) and a float otherwise (`5e-5`); `True`/`False` become booleans; anything else stays
text. Names are argparse destinations (`--learning-rate` -> `learning_rate`).

Differences from Accelerate (docs/compatibility.md): a flag without a value is a UsageError naming the
flag (Accelerate: a ValueError about store_true); negative numbers are values, not flags; `--name=value`
is accepted; a positional argument is an error that says so (Accelerate: argparse exits).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from prefect_accelerate.errors import UsageError


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def typed_value(text: str) -> Any:
    """Accelerate's value typing: whole numbers -> int, other numbers -> float, True/False -> bool, else str."""
    number = _number(text)
    if number is None:
        return {"True": True, "False": False}.get(text, text)
    return int(number) if number.is_integer() else number


def _is_flag(token: str) -> bool:
    return token.startswith("-") and len(token) > 1 and _number(token) is None


def script_hyperparameters(args: Sequence[str]) -> dict[str, Any]:
    """`["--lr", "3e-4", "--epochs", "3"]` -> `{"lr": 0.0003, "epochs": 3}`.

    Raises:
        UsageError: a flag without a value (argparse store_true/store_false style) or a positional argument.
    """
    out: dict[str, Any] = {}
    tokens = list(args)
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if not _is_flag(token):
            raise UsageError(
                f"Script argument {token!r} is not part of a `--name value` pair. SageMaker passes script arguments to the "
                "script as hyperparameters, which are `--name value` pairs; positional arguments cannot be passed."
            )
        if token.startswith("--") and "=" in token:
            name, _, value = token.partition("=")
            index += 1
        else:
            if index + 1 >= len(tokens) or _is_flag(tokens[index + 1]):
                raise UsageError(
                    f"Script argument {token} has no value. SageMaker passes script arguments as hyperparameters (`--name "
                    "value` pairs), so flags without a value (argparse store_true/store_false) cannot be passed: give it "
                    f"an explicit value (e.g. `{token} True`) and parse it with a type in your script."
                )
            name, value = token, tokens[index + 1]
            index += 2
        out[name.lstrip("-").replace("-", "_")] = typed_value(value)
    return out


def serialize_hyperparameter(value: Any) -> str:
    """How SageMaker SDK 3 writes a value on the container's command line (text as is, the rest as JSON)."""
    return value if isinstance(value, str) else json.dumps(value)
