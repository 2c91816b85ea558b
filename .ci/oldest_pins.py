"""Print the oldest versions of trioring's runtime dependencies that pyproject.toml allows,
as pip requirements (``trio==0.31`` for ``trio>=0.31``), for `make test-oldest`."""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads(Path(__file__).parent.parent.joinpath("pyproject.toml").read_text())
pins = []
for requirement in project["project"]["dependencies"]:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)(,.*)?", requirement)
    if match is None:
        sys.exit(f"error: {requirement!r} has no lower bound of the form name>=version")
    pins.append(f"{match[1]}=={match[2]}")
print(" ".join(pins))
