"""MkDocs hook: fill in, at build time, the parts of pages that the code already knows, so
that they can never disagree with it.

* ``<!-- capabilities -->``: the capability table, from :func:`trioring.capabilities`.
* ``<!-- cli -->`` and ``<!-- cli:COMMAND -->``: the ``--help`` text of ``trioring`` or of one
  of its subcommands, from the real argparse parser.
* ``<!-- constant:MODULE.NAME -->``: the value of a module constant; ``*_BYTES`` constants
  are written in KiB/MiB (``64 KiB``).
* ``<!-- config-error:CASE -->``: the ``ConfigurationError`` that ``open_communicator`` raises
  for one of the environments in :data:`CONFIG_ERROR_CASES`.
* ``<!-- decision-table -->``: the decision table, from the tables in the docstring of
  ``trioring._collectives._decision`` (the one place where the choices are made).

An unknown subcommand or constant raises, which fails the build.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import tempfile
import textwrap
from pathlib import Path
from typing import Any

CAPABILITIES = "<!-- capabilities -->"
CLI = re.compile(r"<!-- cli(?::([a-z-]+))? -->")
CONSTANT = re.compile(r"<!-- constant:([A-Za-z_][\w.]*)\.([A-Z_][A-Z0-9_]*) -->")
CONFIG_ERROR = re.compile(r"<!-- config-error:([a-z-]+) -->")
DECISION_TABLE = "<!-- decision-table -->"
_BORDER = re.compile(r"=+(?: +=+)+")
#: Width of generated text blocks (--help: argparse would wrap to the terminal otherwise).
HELP_COLUMNS = 76
#: Rank 1 of a two-rank TCP job whose rank 0 is on another host.
_REMOTE = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
#: Environments that open_communicator refuses, by name. ``{secret_file}`` is replaced with the
#: path of a file holding a good secret, of mode 0644.
CONFIG_ERROR_CASES: dict[str, dict[str, str]] = {
    "no-secret": _REMOTE,
    "short-secret": {**_REMOTE, "TRIORING_SECRET": "hunter2"},
    "secret-file-mode": {**_REMOTE, "TRIORING_SECRET_FILE": "{secret_file}"},
}
#: How the secret file's temporary path is shown in the pages.
SHOWN_SECRET_FILE = "/home/me/.trioring-secret"


def capability_table() -> str:
    import trioring

    rows = ["| name | kind | available here | why not | what it is |", "|---|---|---|---|---|"]
    for row in trioring.capabilities():
        rows.append(
            f"| `{row.name}` | {row.kind} | {'yes' if row.available else 'no'} | "
            f"{row.reason or ''} | {row.description} |"
        )
    return "\n".join(rows)


def decision_rows(doc: str) -> list[tuple[str, ...]]:
    """The rows of the reStructuredText simple tables in ``doc``, header rows left out; a
    line whose first column is blank continues the row above it."""
    rows: list[list[str]] = []
    lines = doc.splitlines()
    borders = 0
    starts: list[int] = []
    for line in lines:
        if _BORDER.fullmatch(line.strip()):
            if borders % 3 == 0:
                starts = [m.start() for m in re.finditer(r"=+", line)]
            borders += 1
            continue
        if borders % 3 != 2 or not line.strip():
            continue  # outside a table, or its header
        cells = [
            line[start : starts[i + 1] if i + 1 < len(starts) else None].strip()
            for i, start in enumerate(starts)
        ]
        if cells[0] or not rows:
            rows.append(cells)
        else:
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells, strict=True)]
    return [tuple(cell.replace("``", "`") for cell in row) for row in rows]


def decision_table() -> str:
    from trioring._collectives import _decision

    assert _decision.__doc__ is not None
    table = [
        "| Collective | When (the first row that matches wins) | Algorithm (name for forcing) |"
    ]
    table.append("|---|---|---|")
    for collective, condition, algorithm in decision_rows(_decision.__doc__):
        table.append(f"| {collective} | {condition} | {algorithm} |")
    return "\n".join(table)


def cli_parsers() -> dict[str, argparse.ArgumentParser]:
    """The ``trioring`` parser (key ``""``) and each subcommand's parser, by name."""
    from trioring._cli import _build_parser

    parser = _build_parser()
    parsers = {"": parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers.update(action.choices)
    return parsers


def cli_help(command: str) -> str:
    parsers = cli_parsers()
    if command not in parsers:
        known = ", ".join(name for name in parsers if name)
        raise ValueError(f"<!-- cli:{command} -->: no such subcommand (known: {known})")
    parser = parsers[command]
    if hasattr(parser, "color"):  # Python 3.14+ may colour help for a terminal
        parser.color = False
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(HELP_COLUMNS)
    try:
        text = parser.format_help()
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    return f"```text\n{text.rstrip()}\n```"


def format_constant(name: str, value: object) -> str:
    if name.endswith("_BYTES") and isinstance(value, int):
        for unit, size in (("MiB", 1024**2), ("KiB", 1024)):
            if value >= size and value % size == 0:
                return f"{value // size} {unit}"
        return f"{value} bytes"
    return repr(value)


def constant(module: str, name: str) -> str:
    return format_constant(name, getattr(importlib.import_module(module), name))


def config_error(case: str) -> str:
    from trioring import ConfigurationError
    from trioring._config import resolve

    if case not in CONFIG_ERROR_CASES:
        raise ValueError(
            f"<!-- config-error:{case} -->: no such case ({', '.join(CONFIG_ERROR_CASES)})"
        )
    with tempfile.TemporaryDirectory() as directory:
        secret_file = Path(directory) / "secret"
        secret_file.write_text("0123456789abcdef" * 4)
        secret_file.chmod(0o644)
        env = {
            k: v.replace("{secret_file}", str(secret_file))
            for k, v in CONFIG_ERROR_CASES[case].items()
        }
        try:
            resolve(
                rank=None,
                world_size=None,
                master_addr=None,
                master_port=None,
                transport=None,
                env=env,
            )
        except ConfigurationError as exc:
            message = str(exc).replace(str(secret_file), SHOWN_SECRET_FILE)
            wrapped = textwrap.fill(
                f"trioring.ConfigurationError: {message}",
                width=HELP_COLUMNS,
                subsequent_indent="    ",
                break_long_words=False,
                break_on_hyphens=False,
            )
            return f"```text\n{wrapped}\n```"
    raise ValueError(f"<!-- config-error:{case} -->: open_communicator accepted {env}")


def render(markdown: str) -> str:
    """Replace every marker in ``markdown``."""
    if CAPABILITIES in markdown:
        markdown = markdown.replace(CAPABILITIES, capability_table())
    if DECISION_TABLE in markdown:
        markdown = markdown.replace(DECISION_TABLE, decision_table())
    markdown = CLI.sub(lambda m: cli_help(m.group(1) or ""), markdown)
    markdown = CONFIG_ERROR.sub(lambda m: config_error(m.group(1)), markdown)
    return CONSTANT.sub(lambda m: constant(m.group(1), m.group(2)), markdown)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return render(markdown)
