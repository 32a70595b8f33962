"""argparse with Accelerate's two parser habits: hyphen aliases and "which flags were given".

Accelerate's CLI accepts `--num-processes` for every `--num_processes` and records, for each parse,
the set of destinations the user actually passed (`nondefault`). The launcher needs that set to decide
whether a value from the config file may fill a flag (reference §1, §4.2). We get both with a parser
subclass and tracking actions; the hyphen spellings are hidden from `--help`.
"""

from __future__ import annotations

import argparse
from typing import Any

NONDEFAULT = "nondefault"


def _track(namespace: argparse.Namespace, dest: str) -> None:
    given = getattr(namespace, NONDEFAULT, None)
    if given is None:
        given = set()
        setattr(namespace, NONDEFAULT, given)
    given.add(dest)


def _tracking(base: type[argparse.Action]) -> type[argparse.Action]:
    class Tracking(base):  # type: ignore[misc, valid-type]
        def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
            # positionals fire even when empty (REMAINDER); only options count as "given"
            if option_string is not None or self.dest in ("training_script", "training_script_args"):
                _track(namespace, self.dest)
            super().__call__(parser, namespace, values, option_string)

    Tracking.__name__ = f"Tracking{base.__name__}"
    return Tracking


_ACTIONS = {
    None: _tracking(argparse._StoreAction),
    "store": _tracking(argparse._StoreAction),
    "store_true": _tracking(argparse._StoreTrueAction),
    "store_false": _tracking(argparse._StoreFalseAction),
    "store_const": _tracking(argparse._StoreConstAction),
    "append": _tracking(argparse._AppendAction),
    "count": _tracking(argparse._CountAction),
}


class HiddenAliasFormatter(argparse.RawDescriptionHelpFormatter):
    """Show `--num_processes`, not its `--num-processes` twin, in help output."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if action.option_strings:
            shown = [s for s in action.option_strings if not getattr(action, "_hidden_aliases", ()) or s not in action._hidden_aliases]  # type: ignore[attr-defined]
            if not shown:
                shown = list(action.option_strings)
            original = action.option_strings
            action.option_strings = shown
            try:
                return super()._format_action_invocation(action)
            finally:
                action.option_strings = original
        return super()._format_action_invocation(action)


def _with_aliases(option_strings: tuple[str, ...]) -> tuple[list[str], list[str]]:
    names = list(option_strings)
    hidden: list[str] = []
    for name in option_strings:
        if name.startswith("--") and "_" in name[2:]:
            alias = "--" + name[2:].replace("_", "-")
            if alias not in names:
                names.append(alias)
                hidden.append(alias)
    return names, hidden


class _AliasMixin:
    def add_argument(self, *args: str, **kwargs: Any) -> argparse.Action:
        names, hidden = _with_aliases(args) if args and args[0].startswith("-") else (list(args), [])
        action = super().add_argument(*names, **kwargs)  # type: ignore[misc]
        action._hidden_aliases = tuple(hidden)  # type: ignore[attr-defined]
        return action


class ArgumentGroup(_AliasMixin, argparse._ArgumentGroup):
    pass


class Parser(_AliasMixin, argparse.ArgumentParser):
    """An ArgumentParser with hidden hyphen aliases and `nondefault` tracking on every subparser."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HiddenAliasFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        for name, action in _ACTIONS.items():
            self.register("action", name, action)

    def add_argument_group(self, *args: Any, **kwargs: Any) -> ArgumentGroup:
        group = ArgumentGroup(self, *args, **kwargs)
        self._action_groups.append(group)
        return group

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001
        namespace = namespace if namespace is not None else argparse.Namespace()
        if getattr(namespace, NONDEFAULT, None) is None:
            setattr(namespace, NONDEFAULT, set())
        return super().parse_known_args(args, namespace)


def given(args: argparse.Namespace, dest: str) -> bool:
    """True when the user passed the flag whose destination is ``dest`` on the command line."""
    return dest in getattr(args, NONDEFAULT, set())
