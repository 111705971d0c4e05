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
        self._discovered = False

    def register(self, name: str, plugin: Any = None):
        """Register ``plugin`` as ``name``; without ``plugin``, a decorator that registers what it decorates.
        Registering a name again replaces the earlier plug-in (a module imported twice, a test's own)."""
        if not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r}: must be non-empty, without ':'")

        def add(p):
            self._plugins[name] = p
            return p

        return add if plugin is None else add(plugin)

    def unregister(self, name: str) -> None:
        """Forget ``name`` (a test's own plug-in, once the test is done)."""
        self._plugins.pop(name, None)

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
        if name in self._plugins:
            return self._plugins[name]
        if ":" in name:
            return user_callable(name, self.kind, self.field)
        raise UserError(f"config field {self.field}: {name!r} is not a known {self.kind} (one of "
                        f"{', '.join(self.names())}, or package.module:function)", field=self.field)

    def known(self, name: str) -> bool:
        return ":" in name or name in self.names()

    def items(self) -> list[tuple[str, Callable]]:
        self._discover()
        return list(self._plugins.items())
