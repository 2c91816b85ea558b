"""Griffe extension: render the Sphinx roles of trioring's docstrings in the API reference.

The docstrings follow Trio's style and say ``:class:`~trioring.PeerFailedError``` or
``:meth:`aclose```; Markdown would show those verbatim. This turns each one into an optional
cross-reference: a link where the target has a page (found relative to the docstring's
object, as Sphinx does), plain code otherwise. ``~`` keeps only the last name, and functions
and methods get ``()``, as with Sphinx's defaults.
"""

from __future__ import annotations

import contextlib
import html
import re
from typing import TYPE_CHECKING, Any

from griffe import Alias, Extension, Object

if TYPE_CHECKING:
    from collections.abc import Iterator

    from griffe import Module

ROLE = re.compile(r":(?:func|meth|class|exc|attr|data|obj|mod):`(~?)([\w.]+)`")
#: Where users import from: links point at these names, which are the ones with pages.
PUBLIC_MODULES = ("trioring", "trioring.transports", "trioring.testing")


def _objects(obj: Object, seen: set[str]) -> Iterator[Object]:
    if obj.path in seen:
        return
    seen.add(obj.path)
    yield obj
    for member in obj.members.values():
        if not isinstance(member, Alias):
            yield from _objects(member, seen)


class SphinxRoles(Extension):
    def on_package(self, *, pkg: Module, **kwargs: Any) -> None:
        if pkg.path != "trioring":
            return
        public = self._public_names(pkg)
        for obj in _objects(pkg, set()):
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = ROLE.sub(
                    lambda match, obj=obj: self._reference(match, obj, pkg, public),
                    obj.docstring.value,
                )

    @staticmethod
    def _public_names(pkg: Module) -> dict[str, str]:
        """Canonical path -> public path, for every object re-exported by a public module
        and for the members of re-exported classes."""
        public: dict[str, str] = {}
        for module_path in PUBLIC_MODULES:
            module = pkg if module_path == pkg.path else pkg[module_path.removeprefix("trioring.")]
            for name, member in module.members.items():
                if not isinstance(member, Alias) or name.startswith("_"):
                    continue
                try:
                    target = member.final_target
                except Exception:
                    continue
                public.setdefault(target.path, f"{module_path}.{name}")
                for child in target.members:
                    public.setdefault(f"{target.path}.{child}", f"{module_path}.{name}.{child}")
        return public

    @staticmethod
    def _reference(match: re.Match[str], obj: Object, pkg: Module, public: dict[str, str]) -> str:
        short, name = match.group(1) == "~", match.group(2)
        title = name.rsplit(".", 1)[-1] if short else name
        if match.group(0).startswith((":func:", ":meth:")):
            title += "()"
        identifier = name
        scopes = [obj, obj.parent, obj.module, pkg] if not name.startswith("trioring") else []
        for scope in scopes:
            if scope is None:
                continue
            candidate = f"{scope.path}.{name}"
            try:
                pkg[candidate.removeprefix("trioring.")]
            except Exception:
                continue
            identifier = candidate
            break
        with contextlib.suppress(Exception):
            identifier = public.get(pkg[identifier.removeprefix("trioring.")].path, identifier)
        identifier = public.get(identifier, identifier)
        return (
            f'<autoref identifier="{html.escape(identifier)}" optional>'
            f"<code>{html.escape(title)}</code></autoref>"
        )
