"""Griffe extension: render the reStructuredText of trioring's docstrings in the API reference.

The docstrings follow Trio's style, which Markdown would show verbatim in three places:

* Sphinx roles, ``:class:`~trioring.PeerFailedError``` or ``:meth:`aclose```: each becomes an
  optional cross-reference, a link where the target has a page (found relative to the
  docstring's object, as Sphinx does), plain code otherwise. ``~`` keeps only the last name,
  and functions and methods get ``()``, as with Sphinx's defaults.
* Literal blocks, a paragraph ending in ``::`` and an indented block: the ``::`` goes as in
  Sphinx (``part::`` becomes ``part:``, ``part ::`` and a lone ``::`` disappear), and a
  block at the docstring's top level becomes a fenced one, marked ``python`` or ``toml``
  where it parses as that, ``text`` otherwise.
* Defaults that name a module constant (``chunk_bytes=DEFAULT_CHUNK_BYTES``): the signature
  and the parameter table show the constant's value instead (``1024 * 1024``), where it is
  a number written with literals and arithmetic only.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import html
import re
import textwrap
import tomllib
from typing import TYPE_CHECKING, Any

from griffe import Alias, Attribute, ExprName, Extension, Function, Object

if TYPE_CHECKING:
    from collections.abc import Iterator

    from griffe import Module

ROLE = re.compile(r":(?:func|meth|class|exc|attr|data|obj|mod):`(~?)([\w.]+)`")
#: A paragraph's last line that introduces a reStructuredText literal block.
LITERAL_MARKER = re.compile(r"^(?P<indent> *)(?P<text>.*?)(?P<space> ?)::$")
#: The nodes of an expression made of number literals and arithmetic only.
ARITHMETIC = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.operator, ast.unaryop)
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


def _language(code: str) -> str:
    """``python`` or ``toml`` where ``code`` parses as that, ``text`` otherwise."""
    with contextlib.suppress(SyntaxError, ValueError):
        compile(code, "<docstring>", "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        return "python"
    with contextlib.suppress(tomllib.TOMLDecodeError):
        tomllib.loads(code)
        return "toml"
    return "text"


def literal_blocks(text: str) -> str:
    """``text`` with its reStructuredText literal blocks written for Markdown."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        marker = LITERAL_MARKER.match(lines[i])
        block_start = i + 1
        while block_start < len(lines) and not lines[block_start].strip():
            block_start += 1
        block_end = block_start
        if marker is not None:
            indent = len(marker["indent"])
            while block_end < len(lines) and (
                not lines[block_end].strip()
                or len(lines[block_end]) - len(lines[block_end].lstrip()) > indent
            ):
                block_end += 1
            while block_end > block_start and not lines[block_end - 1].strip():
                block_end -= 1
        if marker is None or block_end == block_start or block_start == i + 1:
            out.append(lines[i])  # no literal block follows: not a marker
            i += 1
            continue
        prose = marker["text"]
        if prose:  # "part::" -> "part:", "part ::" -> "part"
            out.append(marker["indent"] + prose + ("" if marker["space"] else ":"))
        block = lines[block_start:block_end]
        if indent == 0:
            code = textwrap.dedent("\n".join(block))
            out += ["", f"```{_language(code)}", *code.split("\n"), "```"]
        else:
            out += [""] * (block_start - i - 1) + block
        i = block_end
    return "\n".join(out)


def _constant_default(function: Function, pkg: Module) -> None:
    """Replace each default of ``function`` that names a numeric module constant with the
    constant's value, as written where it is defined."""
    for parameter in function.parameters:
        if not isinstance(parameter.default, ExprName):
            continue
        try:
            target = pkg[parameter.default.canonical_path.removeprefix("trioring.")]
        except Exception:
            continue
        if isinstance(target, Alias):
            target = target.final_target
        if not isinstance(target, Attribute) or not target.parent or not target.parent.is_module:
            continue
        value = str(target.value)
        with contextlib.suppress(SyntaxError):
            if all(
                isinstance(node, ARITHMETIC) for node in ast.walk(ast.parse(value, mode="eval"))
            ):
                parameter.default = value


class SphinxRoles(Extension):
    def on_package(self, *, pkg: Module, **kwargs: Any) -> None:
        if pkg.path != "trioring":
            return
        public = self._public_names(pkg)
        for obj in _objects(pkg, set()):
            if isinstance(obj, Function):
                _constant_default(obj, pkg)
            if obj.docstring is not None and ":" in obj.docstring.value:
                value = literal_blocks(obj.docstring.value)
                reference = functools.partial(self._reference, obj=obj, pkg=pkg, public=public)
                obj.docstring.value = ROLE.sub(reference, value)

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
