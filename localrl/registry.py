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

A plug-in owns its settings: its ``settings`` (or ``settings=``), a dataclass of ``localrl.config.setting`` fields,
become fields of every config as it registers (flags, TOML keys, a section of ``localrl train -h``); its
``check_settings(cfg)`` (a class attribute, or ``check=`` for a function)
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

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

from localrl.config import FIELDS, add_settings
from localrl.errors import UserError, user_callable


class Registry:
    """Factories by name, for one kind of plug-in (``kind``, named by the config field ``field``); the built-ins
    are the registrations made by the modules of ``package``."""

    def __init__(self, kind: str, field: str, package: str):
        self.kind, self.field, self.package = kind, field, package
        # the name of the plug-in a config selects (its field's value, unless the registry picks one itself, as
        # the samplers' does when the field is empty)
        self.selected: Callable[[Any], str] = lambda cfg: getattr(cfg, field)
        self._plugins: dict[str, Any] = {}
        self._presets: dict[str, dict[str, Any]] = {}
        self._checks: dict[str, Callable | None] = {}
        self._selected_checks: dict[str, Callable | None] = {}  # name -> its checks when the run selects it
        self._owns: dict[str, tuple[str, ...]] = {}  # name -> the fields that mean something only when it is selected
        self._arguments: dict[str, str] = {}  # name -> what its argument is (plug-ins named NAME:ARGUMENT)
        self._about: dict[str, str] = {}  # name -> what it is, in a line
        self._discovered = False

    def register(self, name: str, plugin: Any = None, *, preset: dict[str, Any] | None = None,
                 check: Callable | None = None, check_selected: Callable | None = None,
                 owns: tuple[str, ...] | None = None, settings: type | None = None, argument: str | None = None,
                 about: str | None = None):
        """Register ``plugin`` as ``name`` (its ``settings``, ``preset``, ``check_settings``, ``check_selected`` and
        ``owns``, unless given here); without ``plugin``, a decorator that registers what it decorates.
        ``settings``: a dataclass of config fields (``localrl.config.setting``) that become fields of every
        config, owned by this plug-in (a class's own ``settings`` attribute, not one it inherits). ``argument``:
        what the plug-in is given after its name (``NAME:ARGUMENT``), when it needs one. ``about``: what it is, in
        a line (``localrl train -h`` lists the plug-ins with it; a class's own ``about`` attribute otherwise).
        Registering a name again replaces the earlier plug-in (a module imported twice, a test's own)."""
        if not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r}: must be non-empty, without ':'")

        def add(p):
            self._add(name, p, preset=preset, check=check, check_selected=check_selected, owns=owns,
                      settings=settings, about=about)
            if argument:
                self._arguments[name] = argument
            else:
                self._arguments.pop(name, None)
            return p

        return add if plugin is None else add(plugin)

    def _add(self, name: str, p: Any, *, preset=None, check=None, check_selected=None, owns=None,
             settings=None, about=None) -> None:
        own = settings if settings is not None else _own(p, "settings")
        self._about[name] = about if about is not None else _own(p, "about") or ""
        add_settings(f"{self.field} {name}", own)
        self._plugins[name] = p
        self._presets[name] = dict(preset if preset is not None else getattr(p, "preset", None) or {})
        self._checks[name] = check if check is not None else getattr(p, "check_settings", None)
        self._selected_checks[name] = (check_selected if check_selected is not None
                                       else getattr(p, "check_selected", None))
        self._owns[name] = tuple(owns if owns is not None else getattr(p, "owns", ())) + tuple(
            f.name for f in (dataclasses.fields(own) if own is not None else ()))

    def unregister(self, name: str) -> None:
        """Forget ``name`` (a test's own plug-in, once the test is done)."""
        for table in (self._plugins, self._presets, self._checks, self._selected_checks, self._owns, self._arguments,
                      self._about):
            table.pop(name, None)
        add_settings(f"{self.field} {name}", None)

    def preset(self, name: str) -> dict[str, Any]:
        """What selecting the registered plug-in ``name`` changes from the defaults ({} for any other name)."""
        self._discover()
        return dict(self._presets.get(self._registered(name), {}))

    def check_settings(self, cfg) -> None:
        """Every registered plug-in's own checks of ``cfg`` and, for the one the run selects, its
        ``check_selected``, then any field some plug-in owns set while the run selects one that does not own it: a
        UserError naming the field (a plug-in's own words first)."""
        self._discover()
        for check in list(self._checks.values()):
            if check is not None:
                check(cfg)
        selected = self._registered(self.selected(cfg))
        if self._selected_checks.get(selected) is not None:
            self._selected_checks[selected](cfg)
        allowed = set(self._owns.get(selected, ()))
        for field in sorted({f for fields in self._owns.values() for f in fields} - allowed):
            if getattr(cfg, field) != FIELDS[field].default:
                owners = sorted(name for name, fields in self._owns.items() if field in fields)
                raise UserError(f"config field {field}: needs {self.field} {' or '.join(owners)}", field=field)

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        package = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{self.package}.{info.name}")

    def names(self) -> list[str]:
        """The registered names (not the ``package.module:function`` ones named so far)."""
        self._discover()
        return sorted(n for n in self._plugins if ":" not in n)

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
        raise UserError(f"config field {self.field}: {name!r} is not a known {self.kind} (one of "
                        f"{', '.join(self.names())}, or package.module:function)", field=self.field)

    def _registered(self, name: str) -> str:
        """The registered name ``name`` selects: itself, or the ``NAME`` of ``NAME:ARGUMENT``. A
        ``package.module:function`` is imported and registered under that name the first time it is named, with
        its settings, preset and checks, as a plug-in registered by a decorator (a UserError if it cannot be)."""
        head, sep, _ = name.partition(":")
        if sep and head in self._arguments:
            return head
        if sep and name not in self._plugins:
            self._add(name, user_callable(name, self.kind, self.field))
        return name

    def resolve(self, name: str) -> str:
        """The registered name ``name`` selects (a ``package.module:function`` imported and registered now, with its
        settings; a UserError if it cannot be)."""
        self._discover()
        return self._registered(name)

    def argument(self, name: str) -> str:
        """The ``ARGUMENT`` of ``NAME:ARGUMENT`` (empty when there is none)."""
        self._discover()
        head, sep, rest = name.partition(":")
        return rest.strip() if sep and head in self._arguments else ""

    def listing(self) -> list[tuple[str, str]]:
        """(how it is named, what it is) of each registered plug-in: ``NAME`` or ``NAME:ARGUMENT``."""
        return [(f"{n}:{self._arguments[n]}" if n in self._arguments else n, self._about.get(n, ""))
                for n in self.names()]

    def known(self, name: str) -> bool:
        return ":" in name or name in self.names()

    def items(self) -> list[tuple[str, Callable]]:
        self._discover()
        return list(self._plugins.items())


def _own(plugin: Any, attribute: str) -> Any:
    """A class's own ``attribute`` (not one it inherits: a subclass is another plug-in), a function's attribute."""
    return vars(plugin).get(attribute) if isinstance(plugin, type) else getattr(plugin, attribute, None)
