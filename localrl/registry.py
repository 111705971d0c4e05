"""Plug-ins by name: the objectives, samplers and environments a run is assembled from.

A registry maps a name to a factory. The built-in plug-ins register themselves in the module that
defines them (``@objectives.register("sft")`` above the class), and the registry finds them by
importing every module of its package the first time a name is looked up, so adding a built-in is
one new file. A user's plug-in is registered the same way from their own code, or named in the
config as ``package.module:function`` (as a user's reward is), so it needs no edit of localrl:

    from localrl.objectives import Objective, objectives

    @objectives.register("mine")
    class Mine(Objective):
        def step(self, ctx, step): ...

    localrl train --objective mine          # (from a process that imported the module above)
    localrl train --objective mypkg.obj:Mine

A plug-in owns its settings: its ``check_settings(cfg)`` (a class attribute, or ``check=`` for a function)
checks the config fields that are its own, whether or not the run selects it, and its ``check_selected(cfg)`` (or
``check_selected=``) the combinations it cannot run with, when the run selects it (so that no plug-in compares
the config with its own name); its ``owns`` (or ``owns=``) names the fields that mean something only when it is
selected, and the registry refuses any of them set away from its default while the run selects another plug-in (a
field set for a plug-in the run does not use is a mistake); its ``preset`` (or ``preset=``) is what selecting it
changes from the defaults unless the file or the flags set it.
``localrl.training.settings`` (``check_config``, ``build_config``) asks the registries for both.

A plug-in registered with ``argument=`` is named with one: ``NAME:ARGUMENT`` (``--env world:tiny-shell-world``), and
reads it with ``argument(name)``. A registered name before the ``:`` wins over a ``package.module:function`` of the
same spelling.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

from localrl.errors import UserError, user_callable


class Registry:
    """Factories by name, for one kind of plug-in (``kind``, named by the config field ``field``); the built-ins
    are the registrations made by the modules of ``package``."""

    def __init__(self, kind: str, field: str, package: str):
        self.kind, self.field, self.package = kind, field, package
        self._plugins: dict[str, Any] = {}
        self._presets: dict[str, dict[str, Any]] = {}
        self._checks: dict[str, Callable | None] = {}
        self._selected_checks: dict[str, Callable | None] = {}  # name -> its checks when the run selects it
        self._owns: dict[str, tuple[str, ...]] = {}  # name -> the fields that mean something only when it is selected
        self._arguments: dict[str, str] = {}  # name -> what its argument is (plug-ins named NAME:ARGUMENT)
        self._discovered = False

    def register(self, name: str, plugin: Any = None, *, preset: dict[str, Any] | None = None,
                 check: Callable | None = None, check_selected: Callable | None = None,
                 owns: tuple[str, ...] | None = None, argument: str | None = None):
        """Register ``plugin`` as ``name`` (its ``preset``, ``check_settings``, ``check_selected`` and ``owns``, unless
        given here); without
        ``plugin``, a decorator that registers what it decorates. ``argument``: what the plug-in is given after
        its name (``NAME:ARGUMENT``), when it needs one. Registering a name again replaces the earlier plug-in (a
        module imported twice, a test's own)."""
        if not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r}: must be non-empty, without ':'")

        def add(p):
            self._plugins[name] = p
            self._presets[name] = dict(preset if preset is not None else getattr(p, "preset", None) or {})
            self._checks[name] = check if check is not None else getattr(p, "check_settings", None)
            self._selected_checks[name] = (check_selected if check_selected is not None
                                           else getattr(p, "check_selected", None))
            self._owns[name] = tuple(owns if owns is not None else getattr(p, "owns", ()))
            if argument:
                self._arguments[name] = argument
            else:
                self._arguments.pop(name, None)
            return p

        return add if plugin is None else add(plugin)

    def unregister(self, name: str) -> None:
        """Forget ``name`` (a test's own plug-in, once the test is done)."""
        for table in (self._plugins, self._presets, self._checks, self._selected_checks, self._owns, self._arguments):
            table.pop(name, None)

    def preset(self, name: str) -> dict[str, Any]:
        """What selecting the registered plug-in ``name`` changes from the defaults ({} for any other name)."""
        self._discover()
        return dict(self._presets.get(self._registered(name), {}))

    def check_settings(self, cfg) -> None:
        """A field some plug-in owns, set while the run selects one that does not own it, then every registered
        plug-in's own checks of ``cfg`` and, for the one the run selects by name, its ``check_selected``: a UserError
        naming the field."""
        from localrl.config import FIELDS

        self._discover()
        selected = self._registered(getattr(cfg, self.field))
        allowed = set(self._owns.get(selected, ()))
        for field in sorted({f for fields in self._owns.values() for f in fields} - allowed):
            if getattr(cfg, field) != FIELDS[field].default:
                owners = sorted(name for name, fields in self._owns.items() if field in fields)
                raise UserError(f"config field {field}: needs {self.field} {' or '.join(owners)}", field=field)
        for name, check in list(self._checks.items()):
            if check is not None:
                check(cfg)
            if name == selected and self._selected_checks.get(name) is not None:
                self._selected_checks[name](cfg)

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        package = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{self.package}.{info.name}")

    def names(self) -> list[str]:
        self._discover()
        return sorted(self._plugins)

    def get(self, name: str) -> Any:
        """The plug-in registered as ``name``, or the callable a ``package.module:function`` name points at;
        anything else stops the run in one line naming the config field and the names there are."""
        self._discover()
        registered = self._registered(name)
        if registered in self._arguments and not self.argument(name):
            what = self._arguments[registered]
            raise UserError(f"config field {self.field}: {self.kind} {registered!r} needs its {what}: "
                            f"{registered}:{what}", field=self.field)
        if registered in self._plugins:
            return self._plugins[registered]
        if ":" in name:
            return user_callable(name, self.kind, self.field)
        raise UserError(f"config field {self.field}: {name!r} is not a known {self.kind} (one of "
                        f"{', '.join(self.names())}, or package.module:function)", field=self.field)

    def _registered(self, name: str) -> str:
        """The registered name ``name`` selects: itself, or the ``NAME`` of ``NAME:ARGUMENT``."""
        head, sep, _ = name.partition(":")
        return head if sep and head in self._arguments else name

    def argument(self, name: str) -> str:
        """The ``ARGUMENT`` of ``NAME:ARGUMENT`` (empty when there is none)."""
        self._discover()
        head, sep, rest = name.partition(":")
        return rest.strip() if sep and head in self._arguments else ""

    def known(self, name: str) -> bool:
        return ":" in name or name in self.names()

    def items(self) -> list[tuple[str, Callable]]:
        self._discover()
        return list(self._plugins.items())
