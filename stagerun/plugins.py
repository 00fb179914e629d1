"""The plugin registry: transports, backends, drafters and model families from entry points.

Theory of operation: every plugin, stagerun's own included, is an entry point of an installed
distribution in one of four groups: ``stagerun.transports``, ``stagerun.backends``,
``stagerun.drafters`` and ``stagerun.architectures`` (model families, named by the
``general.architecture`` of the GGUF files they read). The registry lists them once per
process (`installed`) without importing anything; a plugin is imported the first time it is
asked for, then validated against its interface in `stagerun.abc` (`_plugin_checks`: the
members it must have, coroutine or plain functions as required, and the parameters stagerun
passes) or, for a family, `stagerun.model.Family`. Whatever goes wrong, an import error, a
missing method, two distributions claiming one name, becomes a `PluginError` that names the
plugin, its distribution and the problem, raised when that plugin is asked for and listed by
``stagerun plugins``; other plugins keep working. A third-party plugin that takes a
built-in's name is ignored, with a warning naming its distribution: the built-in wins.

``STAGERUN_PLUGINS`` restricts the third-party plugins: a comma-separated list whose items are
plugin names (``bigram``), kind-qualified names (``drafter:bigram``, ``drafters:bigram``) or
distribution names (``stagerun-unix``). An item restricts only the kind of plugin it names
(``drafter:...`` the drafters; a name or a distribution, the kinds it has plugins in): of that
kind, the third-party plugins listed load and the others do not. Kinds no item names are not
restricted, and stagerun's built-ins (``tcp``, ``numpy``, ``ngram``...) always stay; an item
with a leading ``-`` (``-ws``, ``-drafter:draft-model``) excludes a plugin, built-in or not.
Items and names compare case-insensitively. Unset or empty means everything installed.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
import re
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeAlias

import attrs

from ._errors import StagerunError
from ._plugin_checks import VALIDATORS, parameters

__all__ = [
    "GROUPS",
    "PluginError",
    "PluginInfo",
    "backend",
    "build_backend",
    "build_for",
    "drafter",
    "family",
    "installed",
    "names",
    "refresh",
    "takes",
    "takes_device",
    "transport",
    "transport_for",
]

Kind: TypeAlias = Literal["transports", "backends", "drafters", "architectures"]
GROUPS: dict[Kind, str] = {
    "transports": "stagerun.transports",
    "backends": "stagerun.backends",
    "drafters": "stagerun.drafters",
    "architectures": "stagerun.architectures",
}
_SINGULAR = {
    "transports": "transport",
    "backends": "backend",
    "drafters": "drafter",
    "architectures": "architecture",
}
ENV = "STAGERUN_PLUGINS"

log = logging.getLogger("stagerun.plugins")


class PluginError(StagerunError):
    """A plugin could not be found, loaded or validated."""


@attrs.define
class PluginInfo:
    """One registered plugin and what became of it.

    Attributes:
        kind: ``transports``, ``backends``, ``drafters`` or ``architectures``.
        name: the entry point's name, the name users choose it by.
        value: ``module:attribute`` as registered.
        distribution: the distribution (package) that registered it, with its version.
        status: ``available`` (not imported yet), ``loaded``, ``broken`` or ``filtered``
            (left out by ``STAGERUN_PLUGINS``).
        problem: why it is broken.
    """

    kind: Kind
    name: str
    value: str
    distribution: str
    status: Literal["available", "loaded", "broken", "filtered"] = "available"
    problem: str | None = None
    obj: Any = attrs.field(default=None, repr=False)
    _entry_point: importlib.metadata.EntryPoint | None = attrs.field(default=None, repr=False)

    def describe(self) -> str:
        return (
            f"{_SINGULAR[self.kind]} plugin {self.name!r} ({self.value}, from {self.distribution})"
        )


_registry: dict[Kind, dict[str, PluginInfo]] | None = None


def refresh() -> None:
    """Forget what was discovered and loaded (after installing a plugin, or in tests)."""
    global _registry
    _registry = None


def _canonical(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503): case and -_. folded."""
    return re.sub(r"[-_.]+", "-", name).lower()


BUILTIN_DISTRIBUTION = "stagerun"


def _distributions(info: PluginInfo) -> set[str]:
    """The canonical names of the distributions that registered ``info``."""
    return {_canonical(part.strip().rsplit(" ", 1)[0]) for part in info.distribution.split(",")}


def _names(info: PluginInfo) -> set[str]:
    """Every way a ``STAGERUN_PLUGINS`` item can name ``info``, lower-cased as the items are."""
    name = info.name.lower()
    qualified = {f"{info.kind}:{name}", f"{_SINGULAR[info.kind]}:{name}"}
    return {name, *qualified, *_distributions(info)}


def _is_builtin(info: PluginInfo) -> bool:
    return _distributions(info) == {BUILTIN_DISTRIBUTION}


@attrs.frozen
class Allowlist:
    """``STAGERUN_PLUGINS`` parsed: what it lists and what it excludes (lower-cased)."""

    spec: str
    listed: frozenset[str]
    excluded: frozenset[str]

    @classmethod
    def parse(cls, spec: str) -> Allowlist:
        listed: set[str] = set()
        excluded: set[str] = set()
        for raw in spec.split(","):
            item = raw.strip().lower()
            target = excluded if item.startswith("-") else listed
            item = item.removeprefix("-").strip()
            if item:
                target |= {item, _canonical(item)}
        return cls(spec, frozenset(listed), frozenset(excluded))

    def restricts(self, kind: Kind, plugins: Iterable[PluginInfo]) -> bool:
        """Whether an item names ``kind`` or one of its plugins (then only those listed load)."""
        prefixes = (f"{kind}:", f"{_SINGULAR[kind]}:")
        return any(item.startswith(prefixes) for item in self.listed) or any(
            _names(info) & self.listed for info in plugins
        )

    def problem(self, info: PluginInfo, restricted: bool) -> str | None:
        """Why ``info`` is left out, or None if it may load."""
        names = _names(info)
        if names & self.excluded:
            return f"excluded by {ENV}={self.spec!r}"
        if restricted and not _is_builtin(info) and not names & self.listed:
            return (
                f"not listed in {ENV}={self.spec!r}, which lists the "
                f"{_SINGULAR[info.kind]} plugins to use"
            )
        return None


def _discover() -> dict[Kind, dict[str, PluginInfo]]:
    global _registry
    if _registry is not None:
        return _registry
    spec = os.environ.get(ENV, "").strip()
    allow = Allowlist.parse(spec) if spec else None
    registry: dict[Kind, dict[str, PluginInfo]] = {}
    every = importlib.metadata.entry_points()  # one scan of the installed metadata, not one a group
    for kind, group in GROUPS.items():
        found: dict[str, list[PluginInfo]] = {}
        for ep in every.select(group=group):
            dist = ep.dist
            where = f"{dist.name} {dist.version}" if dist is not None else "an unknown distribution"
            info = PluginInfo(kind, ep.name, ep.value, where, entry_point=ep)
            same = found.setdefault(ep.name, [])
            # One distribution seen twice (two path entries for one install) is one plugin.
            if not any(o.distribution == info.distribution and o.value == info.value for o in same):
                same.append(info)
        restricted = allow is not None and allow.restricts(
            kind, [info for infos in found.values() for info in infos]
        )
        plugins: dict[str, PluginInfo] = {}
        for name, infos in sorted(found.items()):
            infos.sort(key=lambda i: i.distribution)
            if allow is not None:  # each registration on its own: one of a clash can be left out
                for info in infos:
                    problem = allow.problem(info, restricted)
                    if problem is not None:
                        info.status, info.problem = "filtered", problem
            plugins[name] = _one_of(name, infos)
        registry[kind] = plugins
    _registry = registry
    return registry


def _one_of(name: str, infos: list[PluginInfo]) -> PluginInfo:
    """The plugin that ``name`` means when several distributions register it.

    A built-in wins over third-party plugins of its name (a warning names them), so installing
    a package never takes ``tcp`` or ``numpy`` away; two third-party plugins of one name are an
    error until one is uninstalled or left out with ``STAGERUN_PLUGINS``.
    """
    usable = [i for i in infos if i.status != "filtered"]
    if not usable:
        return infos[0]
    builtins = [i for i in usable if _is_builtin(i)]
    if builtins and len(builtins) < len(usable):
        shadowing = [i for i in usable if not _is_builtin(i)]
        log.warning(
            "the %s plugin %r of %s is ignored: stagerun's built-in %s of that name wins "
            "(rename the plugin, or uninstall it or leave it out with %s=-DISTRIBUTION)",
            _SINGULAR[builtins[0].kind],
            name,
            " and ".join(f"{i.distribution} ({i.value})" for i in shadowing),
            _SINGULAR[builtins[0].kind],
            ENV,
        )
        usable = builtins
    info = usable[0]
    if len(usable) > 1:
        claims = " and ".join(f"{i.distribution} ({i.value})" for i in usable)
        info.status = "broken"
        info.problem = (
            f"the name {name!r} is registered by {claims}; uninstall one, "
            f"or leave one out with {ENV}=-DISTRIBUTION"
        )
        info.distribution = ", ".join(i.distribution for i in usable)
    return info


def installed(kind: Kind | None = None) -> list[PluginInfo]:
    """Every registered plugin (of one kind), with its status; imports nothing."""
    registry = _discover()
    kinds: Iterable[Kind] = (kind,) if kind is not None else GROUPS
    return [info for k in kinds for info in registry[k].values()]


def names(kind: Kind) -> list[str]:
    """The names of the plugins of ``kind`` that may be loaded (not broken, not filtered)."""
    return [i.name for i in installed(kind) if i.status in ("available", "loaded")]


def _load(
    kind: Kind, name: str, validate: Callable[[Any, str], tuple[Any, list[str]]] | None = None
) -> PluginInfo:
    plugins = _discover()[kind]
    info = plugins.get(name)
    if info is None:
        choices = ", ".join(names(kind)) or "none"
        raise PluginError(f"no {_SINGULAR[kind]} plugin named {name!r}; available: {choices}")
    if info.status in ("broken", "filtered"):
        raise PluginError(f"{info.describe()} is unusable: {info.problem}")
    if info.status == "loaded":
        return info
    assert info._entry_point is not None
    try:
        obj = info._entry_point.load()
    except Exception as exc:
        info.status = "broken"
        info.problem = f"importing it failed: {type(exc).__name__}: {exc}"
        raise PluginError(f"{info.describe()} is unusable: {info.problem}") from exc
    if validate is not None:  # the kind's owner makes and checks it (model families)
        obj, problems = validate(obj, name)
    else:
        problems = VALIDATORS[kind](obj)
    if problems:
        info.status = "broken"
        info.problem = "; ".join(problems)
        raise PluginError(f"{info.describe()} is unusable: {info.problem}")
    info.status = "loaded"
    info.obj = obj
    return info


def transport(name: str) -> Any:
    """A new instance of the transport plugin ``name`` (``tcp``, ``ws``, ...)."""
    return _load("transports", name).obj()


def transport_for(address: str) -> Any:
    """A new instance of the transport that serves ``address``'s scheme (``tcp`` if none).

    The plugin named like the scheme is tried first (``tcp``, ``ws``); otherwise every
    transport is loaded to read its schemes. Two plugins serving one scheme is an error.
    """
    scheme, sep, _rest = address.partition("://")
    scheme = scheme if sep else "tcp"
    usable = [i for i in installed("transports") if i.status in ("available", "loaded")]
    by_name = next((i for i in usable if i.name == scheme), None)
    if by_name is not None:
        cls = _load("transports", by_name.name).obj
        if scheme in cls.schemes:
            return cls()
    serving: list[PluginInfo] = []
    for info in usable:
        try:
            loaded = _load("transports", info.name)
        except PluginError:
            continue
        if scheme in loaded.obj.schemes:
            serving.append(loaded)
    if len(serving) > 1:
        raise PluginError(
            f"{scheme}:// addresses are served by "
            + " and ".join(i.describe() for i in serving)
            + f"; leave one out with {ENV}"
        )
    if not serving:
        known = sorted(
            {s for i in installed("transports") if i.obj is not None for s in i.obj.schemes}
        )
        raise PluginError(
            f"no transport plugin serves {scheme}:// addresses (as in {address!r}); "
            f"installed schemes: {', '.join(known) or 'none'}"
        )
    return serving[0].obj()


AUTO_BACKEND = "auto"
"""The default backend name: ``ggml`` where it runs, else ``numpy`` (see `resolve_backend`)."""

_said_why: set[str] = set()


def resolve_backend(name: str) -> str:
    """The backend ``name`` means: ``auto`` is ``ggml`` where it runs here, else ``numpy``.

    Choosing numpy for ``auto`` logs once why ggml is not used. Other names are returned as
    they are.
    """
    if name != AUTO_BACKEND:
        return name
    try:
        why = _why_not("ggml")
    except PluginError as exc:
        why = str(exc)
    if why is None:
        return "ggml"
    if why not in _said_why:
        _said_why.add(why)
        log.warning("the ggml backend is not available (%s); computing with numpy", why)
    return "numpy"


def _why_not(name: str) -> str | None:
    """Why backend ``name`` cannot run on this machine (its ``unavailable()``), or None."""
    check = getattr(_load("backends", name).obj, "unavailable", None)
    return check() if callable(check) else None


def backend(name: str) -> Any:
    """The backend class registered as ``name`` (``ggml``, ``numpy``, ...; ``auto`` resolved).

    Raises:
        PluginError: no such backend, a broken one, or one that cannot run on this machine.
    """
    name = resolve_backend(name)
    why = _why_not(name)
    if why is not None:
        raise PluginError(f"the {name} backend cannot run here: {why}; choose --backend numpy")
    return _load("backends", name).obj


def build_backend(
    name: str,
    model: Any,
    layers: tuple[int, int] | None,
    *,
    threads: int | None,
    device: str | None = None,
    flash_attention: bool | None = None,
) -> Any:
    """Construct backend ``name`` for a layer range; ``device`` and ``flash_attention`` go to
    backends that take them (None: the backend's default).

    Raises:
        PluginError: one was asked for and this backend has no such parameter.
    """
    cls = backend(name)
    options: dict[str, Any] = {}
    for option, value in (("device", device), ("flash_attention", flash_attention)):
        if value is None:
            continue
        if not takes(name, option):
            what = option.replace("_", " ")
            raise PluginError(f"the {name} backend has no {what} option (asked for {value!r})")
        options[option] = value
    return cls(model, layers, threads=threads, **options)


def build_for(stage: Any, model: Any) -> Any:
    """`build_backend` with a stage's own settings: those of a `StagePlan` or a `StageCompute`
    (its ``backend``, ``layers``, ``threads``, ``device`` and ``flash_attention``)."""
    return build_backend(
        stage.backend,
        model,
        stage.layers,
        threads=stage.threads,
        device=stage.device,
        flash_attention=stage.flash_attention,
    )


def takes(name: str, option: str) -> bool:
    """Whether backend ``name`` accepts the keyword ``option`` (``device``, ...)."""
    params = parameters(backend(name).__init__) or {}
    return option in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def takes_device(name: str) -> bool:
    """Whether backend ``name`` accepts a ``device`` keyword (``--device``)."""
    return takes(name, "device")


def drafter(name: str) -> Any:
    """The drafter class registered as ``name`` (``ngram``, ``draft-model``, ...)."""
    return _load("drafters", name).obj


def family(name: str) -> Any:
    """The model family (`stagerun.model.Family`) registered for architecture ``name``.

    The entry point's object is a ``Family`` or a callable returning one, named ``name``
    (`stagerun.model.make_family` checks it: the model package owns the type).
    """
    from .model._families import make_family  # the model package imports this one lazily

    return _load("architectures", name, make_family).obj
