"""MkDocs hook: fill the capability table from the registry at build time, so it can never
disagree with the code."""

from __future__ import annotations

from typing import Any

MARKER = "<!-- capabilities -->"


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    import trioring

    rows = ["| name | kind | available here | why not | what it is |", "|---|---|---|---|---|"]
    for row in trioring.capabilities():
        rows.append(
            f"| `{row.name}` | {row.kind} | {'yes' if row.available else 'no'} | "
            f"{row.reason or ''} | {row.description} |"
        )
    return markdown.replace(MARKER, "\n".join(rows))
