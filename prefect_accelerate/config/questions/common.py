"""Questions both branches ask (torch dynamo, mixed precision), and small helpers for building tables."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prefect_accelerate.config.enums import (
    DYNAMO_BACKEND_CHOICES,
    TORCH_DYNAMO_MODES,
    DynamoBackend,
    PrecisionType,
)
from prefect_accelerate.config.questions.engine import Answers, Condition, Question, options


def yes_no(key: str, prompt: str, default: bool = False, **fields: Any) -> Question:
    return Question(key=key, prompt=prompt, kind="yes_no", default=default, **fields)


def integer(key: str, prompt: Any, default: Any = 1, *, minimum: float | None = 1, **fields: Any) -> Question:
    """A whole-number question; by default at least 1, as counts and sizes are."""
    return Question(key=key, prompt=prompt, kind="int", default=default, minimum=minimum, **fields)


def menu(key: str, prompt: str, labels: Iterable[Any], default: Any = 0, **fields: Any) -> Question:
    """A menu whose entries store their own label."""
    return Question(key=key, prompt=prompt, kind="choice", options=options(*labels), default=default, **fields)


def answered(key: str, value: Any = True) -> Condition:
    """Condition: the question `key` was asked and its answer is `value`."""
    return lambda a: key in a and a[key] == value


def missing_package(module: str, extra: str, purpose: str):
    """A check refusing a yes when `module` is not importable here (Accelerate asserts and crashes)."""

    def check(value: Any, answers: Answers) -> str | None:
        if value is True and not answers.env.has_module(module):
            return (
                f"{purpose} needs the Python package `{module}`, which is not installed in this environment. "
                f"Answer no, or press Ctrl-C, install it with `pip install 'prefect-accelerate[{extra}]'` "
                f"(or `pip install {module}`) and run `prefect-accelerate config` again."
            )
        return None

    return check


# Accelerate's menu omits "no" and misspells TORCHXLA_TRACE_ONCE (which then fails to convert,
# reference §13.17); the menu here is the launcher's list without "no", spelled right.
_DYNAMO_MENU = tuple(name for name in DYNAMO_BACKEND_CHOICES if name != "no")

DYNAMO_QUESTIONS: tuple[Question, ...] = (
    yes_no("use_dynamo", "Do you wish to optimize your script with torch dynamo?"),
    Question(
        key="dynamo_backend",
        prompt="Which dynamo backend would you like to use?",
        kind="choice",
        options=options(*_DYNAMO_MENU, values=[DynamoBackend.parse(n).value for n in _DYNAMO_MENU]),
        default=_DYNAMO_MENU.index("inductor"),
        when=answered("use_dynamo"),
        target="dynamo_config.dynamo_backend",
    ),
    yes_no(
        "dynamo_customize", "Do you want to customize the defaults sent to torch.compile?", when=answered("use_dynamo")
    ),
    Question(
        key="dynamo_mode",
        prompt="Which mode do you want to use?",
        kind="choice",
        options=options(*TORCH_DYNAMO_MODES),
        default=0,  # Accelerate's SageMaker flow passes the string "default" here (reference §13.16)
        when=answered("dynamo_customize"),
        target="dynamo_config.dynamo_mode",
    ),
    yes_no(
        "dynamo_use_fullgraph",
        "Do you want the fullgraph mode or is it ok to break the model into several subgraphs? (yes = fullgraph)",
        when=answered("dynamo_customize"),
        target="dynamo_config.dynamo_use_fullgraph",
    ),
    yes_no(
        "dynamo_use_dynamic",
        "Do you want to enable dynamic shape tracing?",
        when=answered("dynamo_customize"),
        target="dynamo_config.dynamo_use_dynamic",
    ),
    yes_no(
        "dynamo_use_regional_compilation",
        "Do you want to enable regional compilation?",
        when=answered("dynamo_customize"),
        target="dynamo_config.dynamo_use_regional_compilation",
    ),
)

PRECISION_OPTIONS = options("no", "fp16", "bf16", "fp8", values=[p.value for p in (PrecisionType.NO, PrecisionType.FP16, PrecisionType.BF16, PrecisionType.FP8)])

TF32_NOTICE = (
    "Torch dynamo used without mixed precision requires TF32 to be efficient. Accelerate will enable it by "
    "default when launching your scripts."
)
