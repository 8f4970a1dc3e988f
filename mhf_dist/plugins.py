"""The registries `model.family` and `model.backbone.kind` are validated against (`FAMILIES`,
`BACKBONES`), below both the config and the models: `models/registry.py` fills them, and nothing here
imports config or model code. The built-in names are listed here (a test checks them against
`models/registry.py`), so a config validates without the models loaded (`mhf config` imports no torch).

An installed package's module is loaded by its `mhf_dist.families` entry point on the first lookup of
a name not registered yet, in the driver and every Ray worker alike; a family registered by a driver's
own code reaches its Ray workers with the run (`outside_registrations`, `register_missing`). An outside
package declares its module in its own `pyproject.toml`:

    [project.entry-points."mhf_dist.families"]
    mine = "my_package.mhf_families"    # calls mhf_dist.models.registry.register_family on import
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points
from typing import Any

from mhf_dist.errors import ConfigError

BUILTIN_FAMILIES = (
    "mhf",
    "qwen3",
    "qwen3_matched",
    "triple_latent",
    "triple_slot",
    "triple_hybrid",
    "gated_hybrid",
    "transformer_plus_triple",
)
BUILTIN_BACKBONES = ("qwen3", "triple_latent", "triple_slot", "triple_hybrid", "gated_hybrid")
ENTRY_POINT_GROUP = "mhf_dist.families"
HOW_TO_REGISTER = (
    "call mhf_dist.models.registry.{function} in a module an `mhf_dist.families` entry point names "
    "(README: Adding a model family)"
)


class Registry(Mapping[str, Any]):
    """Names in registration order -> the entries `models/registry.py` gives them."""

    def __init__(self, what: str, register_function: str, builtin: tuple[str, ...]) -> None:
        self.what, self.register_function, self.builtin = what, register_function, builtin
        self._entries: dict[str, Any] = {}

    def add(self, name: str, entry: Any) -> None:
        if name in self._entries:
            raise ConfigError(f"{self.what} {name!r} is already registered; give yours another name")
        self._entries[name] = entry

    def entry(self, name: str) -> Any:
        """The entry of `name`; an unregistered name is a one-line `ConfigError`."""
        if name not in self._entries:
            load_entry_points()
        if name not in self._entries:
            raise ConfigError(self.unknown(name))
        return self._entries[name]

    def unknown(self, name: str) -> str:
        how = HOW_TO_REGISTER.format(function=self.register_function)
        return f"unknown {self.what} {name!r}; registered: {', '.join(self)}; to add one, {how}"

    def outside(self) -> dict[str, Any]:
        """The entries registered beyond the built-in ones."""
        return {name: entry for name, entry in self._entries.items() if name not in self.builtin}

    def __contains__(self, name: object) -> bool:
        if name in self.builtin or name in self._entries:
            return True
        load_entry_points()
        return name in self._entries

    def __getitem__(self, name: str) -> Any:
        if name not in self:
            raise KeyError(name)
        return self.entry(name)

    def __iter__(self) -> Iterator[str]:
        load_entry_points()
        return iter([*self.builtin, *self.outside()])

    def __len__(self) -> int:
        return len(list(iter(self)))  # not list(self): that asks __len__ for a size hint


FAMILIES = Registry("model family", "register_family", BUILTIN_FAMILIES)
BACKBONES = Registry("backbone kind", "register_backbone", BUILTIN_BACKBONES)


def load_entry_points() -> None:
    """Import the module of every `mhf_dist.families` entry point (cheap after the first call)."""
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry_point.load()
        except Exception as err:  # any error a plugin's import raises: it is the plugin's, not ours
            raise ConfigError(
                f"entry point {entry_point.name!r} of {ENTRY_POINT_GROUP} ({entry_point.value}) does not "
                f"import: {type(err).__name__}: {err}; fix or uninstall the package that declares it"
            ) from None


def outside_registrations() -> dict[str, dict[str, Any]]:
    """What this process registered beyond the built-ins, per registry, for a run's Ray workers (which
    have not run the driver's code; cloudpickle sends a `__main__` script's functions by value)."""
    return {registry.what: registry.outside() for registry in (FAMILIES, BACKBONES)}


def register_missing(registrations: Mapping[str, Mapping[str, Any]]) -> None:
    """In a worker: register what the driver had and this process has not (entry points load first)."""
    load_entry_points()
    for registry in (FAMILIES, BACKBONES):
        for name, entry in registrations.get(registry.what, {}).items():
            if name not in registry._entries:
                registry.add(name, entry)
