"""`prefect-accelerate config`: ask Accelerate's questionnaire and write the config file.

The questions live as data in `prefect_accelerate.config.questions` (one table per branch, in
Accelerate's order); this module puts the two branches behind the first menu, turns the answers into
the typed config, and writes it atomically. Nothing is written unless every question was answered
and the result validates.
"""

from __future__ import annotations

import builtins
import getpass
import os
import sys
from pathlib import Path
from typing import TextIO

from pydantic import ValidationError

from prefect_accelerate.config.enums import ComputeEnvironment
from prefect_accelerate.config.io import save_config_file
from prefect_accelerate.config.model import AnyConfig, ClusterConfig, SageMakerConfig
from prefect_accelerate.config.paths import default_config_path
from prefect_accelerate.config.questions.cluster import CLUSTER_QUESTIONS, build_cluster, cluster_notices
from prefect_accelerate.config.questions.common import answered
from prefect_accelerate.config.questions.engine import (
    Answers,
    Environment,
    InputFn,
    Question,
    QuestionnaireInterrupted,
    ask,
    only_when,
    options,
)
from prefect_accelerate.config.questions.sagemaker import (
    SAGEMAKER_QUESTIONS,
    build_sagemaker,
    finish_sagemaker,
    sagemaker_notices,
)
from prefect_accelerate.errors import ConfigError

_LOCAL = ComputeEnvironment.LOCAL_MACHINE
_SAGEMAKER = ComputeEnvironment.AMAZON_SAGEMAKER

COMPUTE_ENVIRONMENT = Question(
    key="compute_environment",
    prompt="In which compute environment are you running?",
    kind="choice",
    options=options("This machine", "AWS (Amazon SageMaker)", values=[_LOCAL, _SAGEMAKER]),
    default=0,
)

#: every question, in order; each branch is asked only behind its answer to the first menu
QUESTIONS: tuple[Question, ...] = (
    COMPUTE_ENVIRONMENT,
    *only_when(answered("compute_environment", _LOCAL), CLUSTER_QUESTIONS),
    *only_when(answered("compute_environment", _SAGEMAKER), SAGEMAKER_QUESTIONS),
)


def is_sagemaker(answers: Answers) -> bool:
    return answers.get("compute_environment") == _SAGEMAKER


def build_config(answers: Answers) -> AnyConfig:
    """The typed config for a full set of answers. Raises ConfigError if they do not validate."""
    sagemaker = is_sagemaker(answers)
    data = build_sagemaker(answers) if sagemaker else build_cluster(answers)
    model = SageMakerConfig if sagemaker else ClusterConfig
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ConfigError(
            f"The answers do not make a valid config ({problems}). Nothing was written; run "
            f"`prefect-accelerate config` again with different answers."
        ) from None


def notices(answers: Answers) -> list[str]:
    return sagemaker_notices(answers) if is_sagemaker(answers) else cluster_notices(answers)


def _secret_reader(input_fn: InputFn) -> InputFn:
    # typed secrets are not echoed on a terminal; piped input is never echoed anyway
    if input_fn is builtins.input and sys.stdin is not None and sys.stdin.isatty():
        return getpass.getpass
    return input_fn


def run_questionnaire(
    config_file: str | os.PathLike[str] | None = None,
    *,
    input_fn: InputFn = input,
    out: TextIO | None = None,
    env: Environment | None = None,
    secret_fn: InputFn | None = None,
) -> Path:
    """Ask the questions, then write the config (YAML, or JSON for a .json name) and return its path.

    Args:
        config_file: where to write; the default config path (resolved now) when None. Parent folders
            are created; an existing file is replaced atomically and its old content kept as `<file>.bak`.
        input_fn: reads one answer given its prompt (`input` by default).
        out: where menus and messages go (stdout by default).
        env: the accelerator and package probes (detected when None); tests inject them.
        secret_fn: reads the AWS secret key (getpass on a terminal, else `input_fn`).

    Returns:
        The path written.

    Raises:
        QuestionnaireInterrupted: end of input or Ctrl-C before the last question; nothing written.
        ConfigError: the path is a folder, the IAM role could not be created, or the file could not be written.

    Example:
        >>> run_questionnaire("cfg.yaml", input_fn=iter(["0", "0", "yes", "no", "no", "0"]).__next__)  # doctest: +SKIP
    """
    path = Path(config_file).expanduser() if config_file is not None else default_config_path()
    if path.is_dir():
        raise ConfigError(f"--config_file {path} is a folder. Pass a file path ending in .yaml or .json.")
    stream = sys.stdout if out is None else out
    try:
        answers = ask(QUESTIONS, input_fn, stream, env=env, secret_fn=secret_fn or _secret_reader(input_fn))
    except QuestionnaireInterrupted as stop:
        raise QuestionnaireInterrupted.at(stop.reason, stop.question, path) from None
    config = build_config(answers)
    for line in notices(answers):
        print(line, file=stream)
    if is_sagemaker(answers):
        finish_sagemaker(answers, stream)
    try:
        backup = save_config_file(config, path)
    except OSError as error:
        raise ConfigError(
            f"Could not write the config file {path}: {error.strerror or error}. Check that the folder is writable, "
            f"or pass another path with --config_file."
        ) from None
    if backup is not None:
        print(f"The previous content of {path} was kept in {backup}.", file=stream)
    return path
