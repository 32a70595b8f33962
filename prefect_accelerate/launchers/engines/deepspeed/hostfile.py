"""DeepSpeed hostfiles and resource filters, checked before a launch instead of failing inside the runner.

A hostfile has one `HOST slots=N` line per machine (`#` comments and blank lines are skipped; text after
the slot count is left to the launcher, as DeepSpeed does). Filters use DeepSpeed's syntax,
`NODE_SPEC[@NODE_SPEC ...]` with `NODE_SPEC = HOST[:SLOT[,SLOT ...]]`. The selection rules below are the
ones DeepSpeed's runner applies (reference spike §1.5), so the world size we predict is the one it starts.
Every error names the file and line, or the filter and the part of it that is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prefect_accelerate.errors import ConfigError

_ENTRY = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)(?:\s|$)")


@dataclass(frozen=True)
class HostEntry:
    name: str
    slots: int
    line: int


@dataclass(frozen=True)
class Hostfile:
    path: str
    hosts: tuple[HostEntry, ...]

    def slots(self) -> dict[str, int]:
        return {host.name: host.slots for host in self.hosts}

    def describe(self) -> str:
        return ", ".join(f"{host.name} slots={host.slots}" for host in self.hosts)


def parse_hostfile(text: str, path: str) -> Hostfile:
    """Hosts in file order. Raises ConfigError naming the line for a bad entry, a duplicate or slots=0."""
    hosts: list[HostEntry] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _ENTRY.match(line)
        if match is None:
            raise ConfigError(
                f"DeepSpeed hostfile {path}, line {number}: {line!r} is not a `HOST slots=N` entry. Write one machine "
                "per line, e.g. `worker-1 slots=8` (N = processes to start there); start comments with #."
            )
        name, slots = match.group("host"), int(match.group("slots"))
        if name in seen:
            raise ConfigError(
                f"DeepSpeed hostfile {path}, line {number}: host {name} is listed again (first on line {seen[name]}). "
                "DeepSpeed refuses duplicates; keep one line per machine and put all its slots there."
            )
        if slots < 1:
            raise ConfigError(
                f"DeepSpeed hostfile {path}, line {number}: {name} has slots=0, so no process would start there. "
                "Give it at least one slot, or remove the line."
            )
        seen[name] = number
        hosts.append(HostEntry(name, slots, number))
    if not hosts:
        raise ConfigError(
            f"DeepSpeed hostfile {path} lists no hosts. Add one `HOST slots=N` line per machine, e.g. `worker-1 slots=8`."
        )
    return Hostfile(path, tuple(hosts))


def read_hostfile(path: str, shown_as: str | None = None) -> Hostfile:
    """Read and check a hostfile. `shown_as` is the path as the user wrote it (for messages)."""
    label = shown_as or path
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise ConfigError(
            f"The DeepSpeed hostfile {label} does not exist. DeepSpeed would quietly fall back to this machine alone; "
            "pass --deepspeed_hostfile with a file of `HOST slots=N` lines (or set deepspeed_hostfile in the config)."
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"The DeepSpeed hostfile {label} could not be read ({error}). Check the path and its permissions.") from None
    return parse_hostfile(text, label)


def _parse_filter(text: str, kind: str, hostfile: Hostfile) -> dict[str, list[int]]:
    """{host: sorted slots ([] = the whole host)} for one filter string, checked against the hostfile."""
    pool = hostfile.slots()
    specs: dict[str, list[int]] = {}
    for part in text.split("@"):
        name, _, slot_text = part.partition(":")
        if not name:
            raise ConfigError(
                f"The DeepSpeed {kind} filter {text!r} has an empty host name in {part!r}. Use HOST[:SLOT,...] "
                "parts joined by @, e.g. worker-1@worker-2:0,1."
            )
        if name not in pool:
            raise ConfigError(
                f"The DeepSpeed {kind} filter {text!r} names host {name}, which is not in the hostfile {hostfile.path} "
                f"({hostfile.describe()}). Use a host name from that file."
            )
        slots: list[int] = []
        if slot_text:
            for item in slot_text.split(","):
                if not item.strip().isdigit():
                    raise ConfigError(
                        f"The DeepSpeed {kind} filter {text!r}: {item!r} in {part!r} is not a slot number. Slots are "
                        f"0 to {pool[name] - 1} on {name}."
                    )
                slot = int(item)
                if slot >= pool[name]:
                    raise ConfigError(
                        f"The DeepSpeed {kind} filter {text!r} asks for slot {slot} on {name}, which has slots 0 to "
                        f"{pool[name] - 1} in {hostfile.path} (line {_line(hostfile, name)})."
                    )
                slots.append(slot)
        specs.setdefault(name, [])
        if slots or not specs[name]:
            specs[name] = sorted(set(specs[name]) | set(slots)) if slots else []
    return specs


def _line(hostfile: Hostfile, name: str) -> int:
    return next(host.line for host in hostfile.hosts if host.name == name)


def select_resources(
    hostfile: Hostfile,
    *,
    include: str | None = None,
    exclude: str | None = None,
    per_node: int = 0,
) -> dict[str, list[int]]:
    """The slots DeepSpeed's runner will use on each host, in hostfile order.

    Args:
        include, exclude: DeepSpeed filters (pass at most one; the runner refuses both).
        per_node: `--num_gpus`: without a filter, every selected host runs this many processes
            (DeepSpeed does not cap it at the host's slots). 0 keeps the hostfile's slots.

    Raises:
        ConfigError: a filter names an unknown host or slot, or selects nothing.
    """
    pool = hostfile.slots()
    if include:
        chosen = {name: (slots or list(range(pool[name]))) for name, slots in _parse_filter(include, "inclusion", hostfile).items()}
    else:
        chosen = {name: list(range(count)) for name, count in pool.items()}
        if exclude:
            for name, slots in _parse_filter(exclude, "exclusion", hostfile).items():
                chosen[name] = [slot for slot in chosen[name] if slots and slot not in slots]
    active = {name: chosen[name] for name in pool if chosen.get(name)}
    if not active:
        which = f"inclusion filter {include!r}" if include else f"exclusion filter {exclude!r}"
        raise ConfigError(
            f"The DeepSpeed {which} leaves no host of {hostfile.path} ({hostfile.describe()}) to run on. Loosen the "
            "filter so at least one slot remains."
        )
    if per_node > 0 and not include and not exclude:
        active = {name: list(range(per_node)) for name in active}
    return active
