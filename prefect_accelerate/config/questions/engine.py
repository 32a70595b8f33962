"""The questionnaire engine: questions as data, one loop that asks those whose condition holds.

A `Question` says what to ask (prompt, kind, options, default), when to ask it (a function of the
answers so far) and where its answer goes in the config dict (`target`, dotted for nested sections).
`ask` walks a table of them, reading typed answers through an input function and writing menus and
messages to an output stream, so tests drive it without a terminal. An invalid answer is explained
and asked again; the end of input or Ctrl-C stops everything with `QuestionnaireInterrupted`.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TextIO

from prefect_accelerate.errors import UsageError

Kind = Literal["yes_no", "int", "float", "text", "choice", "list", "lines"]
InputFn = Callable[[str], str]

_YES = frozenset({"yes", "y", "true"})
_NO = frozenset({"no", "n", "false"})


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: default of a question that has none: an empty answer is refused
REQUIRED: Any = _Required()


class QuestionnaireInterrupted(UsageError):
    """The questionnaire stopped (end of input or Ctrl-C) before every question was answered."""

    reason: str = ""
    question: str = ""

    @classmethod
    def at(cls, reason: str, question: str, path: object | None = None) -> QuestionnaireInterrupted:
        where = f" to {path}" if path is not None else ""
        error = cls(
            f"The questionnaire was interrupted ({reason}) at the question '{question}'; nothing was written{where}. "
            f"Run `prefect-accelerate config` again and answer every question (an empty answer takes the default "
            f"shown in brackets)."
        )
        error.reason, error.question = reason, question
        return error


class InvalidAnswer(ValueError):
    """Why a typed answer was refused; the question is asked again."""


def module_available(name: str) -> bool:
    """Whether `name` could be imported here, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


_DETECT: Any = object()


class Environment:
    """What the questions may look at besides the answers: the accelerator and importable packages.

    Args:
        accelerator: cuda, xpu, npu, mlu, mps, or None for a CPU-only machine. Detected through torch
            (`envreport.devices.detect_accelerator`) the first time a question needs it when left out.
        has_module: whether an optional package is importable (deepspeed, transformer_engine, boto3...).
        iam_client_factory: builds the boto3 IAM client for the SageMaker role creation from the
            answers (profile or keys, region); tests pass a stubbed client here.
        platform: `sys.platform`; MPS can only exist on darwin, which saves importing torch elsewhere.
    """

    def __init__(
        self,
        accelerator: str | None = _DETECT,
        *,
        has_module: Callable[[str], bool] = module_available,
        iam_client_factory: Callable[[Answers], Any] | None = None,
        platform: str | None = None,
    ) -> None:
        self._accelerator = accelerator
        self.has_module = has_module
        self.iam_client_factory = iam_client_factory
        self.platform = sys.platform if platform is None else platform

    @property
    def accelerator(self) -> str | None:
        if self._accelerator is _DETECT:
            from prefect_accelerate.envreport.devices import detect_accelerator

            self._accelerator = detect_accelerator().kind
        return self._accelerator

    @property
    def has_mps(self) -> bool:
        if self._accelerator is _DETECT and self.platform != "darwin":
            return False
        return self.accelerator == "mps"


class Answers(Mapping[str, Any]):
    """The answers so far, by question key, plus the environment the conditions may consult."""

    def __init__(self, env: Environment | None = None) -> None:
        self.env = env if env is not None else Environment()
        self._values: dict[str, Any] = {}
        self._questions: dict[str, Question] = {}
        #: keys of the questions asked, in order
        self.asked: list[str] = []

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:  # never show a secret, even in a traceback
        shown = {k: ("***" if self._questions[k].secret else v) for k, v in self._values.items()}
        return f"Answers({shown!r})"

    def record(self, question: Question, value: Any) -> None:
        self._values[question.key] = value
        self._questions[question.key] = question
        self.asked.append(question.key)

    def to_config_dict(self) -> dict[str, Any]:
        """The answers that have a target, placed in a config dict (`a.b` goes into section `a`)."""
        data: dict[str, Any] = {}
        for key, value in self._values.items():
            target = self._questions[key].target
            if target is None:
                continue
            node = data
            *sections, name = target.split(".")
            for section in sections:
                node = node.setdefault(section, {})
            node[name] = value
        return data


Condition = Callable[[Answers], bool]


def always(_: Answers) -> bool:
    return True


@dataclass(frozen=True)
class Option:
    """One entry of a menu: what is shown, and what the answer stores."""

    label: str
    value: Any


def options(*labels: Any, values: Iterable[Any] | None = None) -> tuple[Option, ...]:
    """Menu entries from labels (stored as they are unless `values` is given)."""
    stored = list(labels) if values is None else list(values)
    if len(stored) != len(labels):
        raise ValueError("options() needs one value per label")
    return tuple(Option(str(label), value) for label, value in zip(labels, stored))


@dataclass(frozen=True)
class Question:
    """One question of the questionnaire.

    Attributes:
        key: the answer's name; conditions and builders read `answers[key]`.
        prompt: the question, or a function of the answers giving it.
        kind: yes_no, int, float, text, choice (a menu), list (comma-separated, empty gives []),
            lines (one item at a time, then `more_prompt` until the answer is no).
        default: what an empty answer means (for a menu: the option's index); REQUIRED when none.
            May be a function of the answers.
        options: the menu of a choice question (or a function of the answers giving it).
        when: asked only when this holds for the answers so far.
        check: a function (value, answers) returning why the value is refused, or None.
        convert: applied to an accepted value before it is stored (e.g. expanding `~`).
        target: where the value goes in the config dict; None for answers that only steer the flow.
        minimum, maximum: bounds for int and float answers.
        secret: read through the secret input (no echo on a terminal), never shown or stored.
        intro: a note printed before the question is asked.
        more_prompt: for `lines`, the yes/no question asked after each item.
    """

    key: str
    prompt: str | Callable[[Answers], str]
    kind: Kind = "text"
    default: Any = REQUIRED
    options: tuple[Option, ...] | Callable[[Answers], tuple[Option, ...]] = ()
    when: Condition = always
    check: Callable[[Any, Answers], str | None] | None = None
    convert: Callable[[Any], Any] | None = None
    target: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    secret: bool = False
    intro: str | None = None
    more_prompt: str | None = None

    def applies(self, answers: Answers) -> bool:
        return bool(self.when(answers))

    def text(self, answers: Answers) -> str:
        return self.prompt(answers) if callable(self.prompt) else self.prompt

    def menu(self, answers: Answers) -> tuple[Option, ...]:
        return self.options(answers) if callable(self.options) else self.options

    def default_for(self, answers: Answers) -> Any:
        return self.default(answers) if callable(self.default) else self.default

    # -- reading one answer ------------------------------------------------------------------------

    def parse(self, typed: str, answers: Answers) -> Any:
        """The value of a typed answer; raises InvalidAnswer saying why it is refused."""
        text = typed.strip()
        default = self.default_for(answers)
        if self.kind == "choice":
            value = _parse_choice(text, self.menu(answers), default)
        elif text == "":
            if default is REQUIRED:
                raise InvalidAnswer("An answer is needed here.")
            value = default
            if self.kind == "list" and isinstance(value, str):
                value = _split_list(value)
        else:
            value = self._parse_text(text)
        if self.check is not None:
            reason = self.check(value, answers)
            if reason:
                raise InvalidAnswer(reason)
        return self.convert(value) if self.convert is not None else value

    def _parse_text(self, text: str) -> Any:
        shown = "" if self.secret else f" {text!r}"  # a secret is never repeated back
        if self.kind == "yes_no":
            word = text.lower()
            if word in _YES:
                return True
            if word in _NO:
                return False
            raise InvalidAnswer(f"The answer{shown} is not yes or no; please answer yes or no.")
        if self.kind in ("int", "float"):
            try:
                number: float = int(text) if self.kind == "int" else float(text)
            except ValueError:
                what = "a whole number such as 1" if self.kind == "int" else "a number such as 1.0"
                raise InvalidAnswer(f"The answer{shown} is not a number; enter {what}.") from None
            if not math.isfinite(number):
                raise InvalidAnswer("Enter a finite number.")
            if self.minimum is not None and number < self.minimum:
                raise InvalidAnswer(f"Enter a number of at least {_number(self.minimum)} (not {text}).")
            if self.maximum is not None and number > self.maximum:
                raise InvalidAnswer(f"Enter a number of at most {_number(self.maximum)} (not {text}).")
            return number
        if self.kind == "list":
            return _split_list(text)
        return text

    # -- showing it ---------------------------------------------------------------------------------

    def input_prompt(self, answers: Answers) -> str:
        """The line handed to the input function (a menu's entries are printed before it)."""
        default = self.default_for(answers)
        if self.kind == "choice":
            menu = self.menu(answers)
            if _numeric(menu):
                hint = f"{', '.join(o.label for o in menu)}"
                shown = f" [{menu[default].label}]" if default is not REQUIRED else ""
                return f"{self.text(answers)} (one of {hint}){shown}: "
            shown = f" [{default}: {menu[default].label}]" if default is not REQUIRED else ""
            return f"Type the option's number (counting from 0: 0-{len(menu) - 1}) or its name{shown}: "
        if self.kind == "yes_no":
            hint = {True: " [YES/no]", False: " [yes/NO]"}.get(default, " [yes/no]")
        elif default is REQUIRED or default is None:
            hint = ""
        elif self.kind == "list":
            hint = " [none]" if default in ("", []) else f" [{default}]"
        else:
            hint = f" [{default}]"
        text = self.text(answers)
        return f"{text} " if not hint and text.endswith("?") else f"{text}{hint}: "

    def menu_lines(self, answers: Answers) -> list[str]:
        menu = self.menu(answers)
        if self.kind != "choice" or _numeric(menu):
            return []
        width = len(str(len(menu) - 1))
        return [self.text(answers)] + [f"  {i:>{width}}) {o.label}" for i, o in enumerate(menu)]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _split_list(text: str) -> list[str]:
    # Accelerate splits on "," without stripping, so an empty answer gave [""] (reference §2.1.1)
    return [item.strip() for item in text.split(",") if item.strip()]


def _numeric(menu: tuple[Option, ...]) -> bool:
    """A menu of numbers (machine rank, ZeRO stage, FSDP version) takes the number itself."""
    return bool(menu) and all(o.label.lstrip("-").isdigit() for o in menu)


def _parse_choice(text: str, menu: tuple[Option, ...], default: Any) -> Any:
    if text == "":
        if default is REQUIRED:
            raise InvalidAnswer("An answer is needed here.")
        return menu[default].value
    if _numeric(menu):
        for option in menu:
            if option.label == text.lstrip("+") or (text.isdigit() and int(text) == int(option.label)):
                return option.value
        raise InvalidAnswer(f"{text!r} is not one of {', '.join(o.label for o in menu)}.")
    if text.isdigit():
        index = int(text)
        if index < len(menu):
            return menu[index].value
        raise InvalidAnswer(f"There is no option {index}; type a number from 0 to {len(menu) - 1}, or an option's name.")
    wanted = text.lower()
    for option in menu:
        if wanted in (option.label.lower(), str(getattr(option.value, "value", option.value)).lower()):
            return option.value
    raise InvalidAnswer(
        f"{text!r} is not one of the options; type a number from 0 to {len(menu) - 1}, or one of: "
        f"{', '.join(o.label for o in menu)}."
    )


def only_when(condition: Condition, questions: Iterable[Question]) -> tuple[Question, ...]:
    """The same questions, each asked only when `condition` also holds (a branch of the table)."""
    return tuple(replace(q, when=_both(condition, q.when)) for q in questions)


def _both(first: Condition, second: Condition) -> Condition:
    return lambda answers: first(answers) and second(answers)


@dataclass
class _Reader:
    input_fn: InputFn
    secret_fn: InputFn
    out: TextIO
    #: the question being asked, for the message when the input stops
    current: str = field(default="")

    def read(self, prompt: str, *, secret: bool = False) -> str:
        self.out.flush()
        return (self.secret_fn if secret else self.input_fn)(prompt)


def _ask_one(question: Question, answers: Answers, reader: _Reader) -> Any:
    out = reader.out
    reader.current = question.text(answers)
    if question.intro:
        print(question.intro, file=out)
    if question.kind == "lines":
        return _ask_lines(question, answers, reader)
    for line in question.menu_lines(answers):
        print(line, file=out)
    prompt = question.input_prompt(answers)
    while True:
        typed = reader.read(prompt, secret=question.secret)
        try:
            return question.parse(typed, answers)
        except InvalidAnswer as why:
            print(f"  {why}", file=out)


def _ask_lines(question: Question, answers: Answers, reader: _Reader) -> list[str]:
    item = replace(question, kind="text", default=REQUIRED, intro=None, check=None, convert=None)
    more = Question(key=question.key, prompt=question.more_prompt or "Add another?", kind="yes_no", default=False)
    items: list[str] = []
    while True:
        items.append(_ask_one(item, answers, reader))
        if not _ask_one(more, answers, reader):
            return items


def ask(
    questions: Iterable[Question],
    input_fn: InputFn = input,
    out: TextIO | None = None,
    *,
    env: Environment | None = None,
    secret_fn: InputFn | None = None,
) -> Answers:
    """Ask every question whose condition holds, in order, and return the answers.

    Args:
        questions: the table to walk.
        input_fn: reads one typed answer given the prompt (`input` by default; tests pass a script).
        out: where menus, notes and "ask again" messages go (stdout by default).
        env: accelerator and package probes the conditions consult (detected when left out).
        secret_fn: reads secret answers (defaults to `input_fn`; the CLI passes getpass on a terminal).

    Returns:
        The answers, with `asked` listing the keys in the order they were asked.

    Raises:
        QuestionnaireInterrupted: the input ended (EOF) or the user pressed Ctrl-C.

    Example:
        >>> answers = ask(QUESTIONS, iter(["0", "yes"]).__next__, io.StringIO())  # doctest: +SKIP
    """
    stream = sys.stdout if out is None else out
    answers = Answers(env)
    reader = _Reader(input_fn, secret_fn or input_fn, stream)
    try:
        for question in questions:
            if question.applies(answers):
                answers.record(question, _ask_one(question, answers, reader))
    except (EOFError, StopIteration, KeyboardInterrupt) as stop:
        # StopIteration too: `iter(answers).__next__` is a handy input function
        why = "Ctrl-C" if isinstance(stop, KeyboardInterrupt) else "the input ended"
        print(file=stream)
        raise QuestionnaireInterrupted.at(why, reader.current) from None
    return answers
