"""``python -m trioring``: the same command line as the ``trioring`` script."""

from __future__ import annotations

from trioring._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
