"""The questions of `prefect-accelerate config`, as data: the engine and the two branches' tables."""

from prefect_accelerate.config.questions.engine import (
    REQUIRED,
    Answers,
    Environment,
    InvalidAnswer,
    Option,
    Question,
    QuestionnaireInterrupted,
    ask,
    only_when,
    options,
)

__all__ = [
    "REQUIRED",
    "Answers",
    "Environment",
    "InvalidAnswer",
    "Option",
    "Question",
    "QuestionnaireInterrupted",
    "ask",
    "only_when",
    "options",
]
