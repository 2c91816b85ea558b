"""The documentation: its runnable examples run and print what the pages say, its generated
parts (diagrams, CLI help, environment variables) match the code, and the site builds."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import ModuleType

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
EXAMPLES = DOCS / "examples"
#: A snippet include in block form; ruff's Markdown formatter leaves it alone (it rewrites
#: the one-line form `--8<-- "file"` inside Python fences into `--8 < --"file"`).
SNIPPET_BLOCK = re.compile(r"^--8<--\n(.*?)\n--8<--$", re.MULTILINE | re.DOTALL)


def _environment() -> dict[str, str]:
    # With PYTHONUNBUFFERED, print() writes a line and its newline separately, so lines of
    # ranks sharing one pipe (--no-tag-output) could interleave mid-line.
    return {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}


def _run(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=_environment(),
        check=False,
    )


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _documented_output(page: Path) -> list[str]:
    """The lines of the first ```text block after the first `trioring run` command."""
    text = page.read_text()
    block = re.search(r"```sh\ntrioring run .*?```\n\n.*?```text\n(.*?)```", text, re.DOTALL)
    assert block is not None, page
    return block.group(1).splitlines()


# -- the examples ------------------------------------------------------------------------------


def test_first_allreduce_under_trioring_run(tmp_path: Path) -> None:
    result = _run(
        *("-m", "trioring", "run", "-n", "4", "--no-tag-output"),
        str(EXAMPLES / "first_allreduce.py"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "mean over 4 ranks: [1.5 2.5 3.5" in result.stdout
    documented = _documented_output(DOCS / "tutorials" / "first-allreduce.md")
    assert result.stdout.splitlines() == documented


def test_local_world_example(tmp_path: Path) -> None:
    result = _run(str(EXAMPLES / "local_world.py"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "every rank got [6. 6. 6. 6.]" in result.stdout


def test_trio_app_under_trioring_run(tmp_path: Path) -> None:
    """Rank 3 stalls 3 s before step 2; rank 0's 1 s deadline fires inside step 2's first
    allreduce. Rank 0 raises TooSlowError, the others PeerAbortedError naming rank 0, all
    their communicators are broken, and every rank recovers on a new communicator. The page
    shows exactly these lines (in some order)."""
    result = _run(
        *("-m", "trioring", "run", "-n", "4", "--no-tag-output"),
        str(EXAMPLES / "trio_app.py"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    documented = _documented_output(DOCS / "tutorials" / "trio-app.md")
    assert len(documented) == 15, documented
    missing = [line for line in documented if line not in lines]
    assert not missing, f"update docs/tutorials/trio-app.md? {missing}\n{result.stdout}"
    # Only the heartbeat may add lines (a step that is slow for other reasons).
    extra = [line for line in lines if line not in documented and "is taking over" not in line]
    assert not extra, f"update docs/tutorials/trio-app.md? {extra}\n{result.stdout}"
    for step in range(4):
        assert sum(line.startswith(f"step {step}: loss") for line in lines) == 1, result.stdout


def test_pytest_trio_example(tmp_path: Path) -> None:
    """The example runs with pytest in a directory of its own, without this project's pytest
    configuration, as it would for a reader."""
    shutil.copy(EXAMPLES / "test_with_pytest_trio.py", tmp_path)
    result = _run(
        *("-m", "pytest", "-q", "-p", "no:cacheprovider", "test_with_pytest_trio.py"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 passed" in result.stdout, result.stdout


def test_transport_plugin_example(tmp_path: Path) -> None:
    result = _run(
        *("-m", "trioring", "run", "-n", "2", "--transport", "tcp", "--no-tag-output"),
        str(EXAMPLES / "counting_transport.py"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert f"rank {rank} over 'counting-tcp': sent 4.0 MB" in result.stdout.splitlines()
    documented = _documented_output(DOCS / "how-to" / "transport-plugin.md")
    assert sorted(result.stdout.splitlines()) == sorted(documented)


def test_every_example_is_tested() -> None:
    tested = {
        "first_allreduce.py",
        "local_world.py",
        "trio_app.py",
        "test_with_pytest_trio.py",
        "counting_transport.py",
    }
    assert {path.name for path in EXAMPLES.glob("*.py")} == tested


# -- the pages -----------------------------------------------------------------------------------


def _pages() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(DOCS.rglob("*.md"))}


def test_snippet_includes_are_intact() -> None:
    """Every include is in block form, names a file that exists, and no include was mangled
    into something the snippets extension does not recognise (which renders as raw text)."""
    for path, text in _pages().items():
        mangled = [
            line for line in text.splitlines() if "8<" not in line and re.search(r"-\s*8\s*<", line)
        ]
        assert not mangled, (path, mangled)
        assert '--8<-- "' not in text, f"{path}: use the block form of --8<-- (see SNIPPET_BLOCK)"
        for block in SNIPPET_BLOCK.findall(text):
            for target in block.splitlines():
                file = target.split(":", 1)[0]
                assert (ROOT / file).is_file(), (path, target)


def test_every_example_is_included() -> None:
    included = {
        Path(target.split(":", 1)[0]).name
        for text in _pages().values()
        for block in SNIPPET_BLOCK.findall(text)
        for target in block.splitlines()
    }
    assert {path.name for path in EXAMPLES.glob("*.py")} <= included


def test_diagrams_are_up_to_date(tmp_path: Path) -> None:
    """docs/diagrams.py reproduces the committed SVGs byte for byte (after a change to an
    algorithm or to the script, run `python docs/diagrams.py`)."""
    result = _run(str(DOCS / "diagrams.py"), str(tmp_path), cwd=ROOT)
    assert result.returncode == 0, result.stderr
    committed = DOCS / "explanation" / "diagrams"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in committed.glob("*.svg")
    )
    for fresh in tmp_path.iterdir():
        assert fresh.read_bytes() == (committed / fresh.name).read_bytes(), fresh.name
    page = (DOCS / "explanation" / "algorithms.md").read_text()
    for fresh in tmp_path.iterdir():
        assert f"(diagrams/{fresh.name})" in page, fresh.name


def test_cli_reference_covers_every_subcommand() -> None:
    hooks = _hooks()
    page = (DOCS / "reference" / "cli.md").read_text()
    for name in hooks.cli_parsers():
        marker = f"<!-- cli:{name} -->" if name else "<!-- cli -->"
        assert marker in page, marker
    rendered = hooks.render(page)
    assert "<!-- cli" not in rendered
    assert "usage: trioring run -n N" in rendered


def test_every_trioring_variable_is_documented() -> None:
    used = {
        name
        for path in (ROOT / "src" / "trioring").rglob("*.py")
        for name in re.findall(r"\bTRIORING_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())
    }
    page = (DOCS / "reference" / "environment.md").read_text()
    documented = set(re.findall(r"`(TRIORING_[A-Z0-9_]+)`", page))
    assert used, "no TRIORING_* names found in src/trioring"
    assert used <= documented, sorted(used - documented)


def test_generated_parts_render() -> None:
    """Every marker the build hook fills in renders (the build would fail otherwise)."""
    hooks = _hooks()
    for path, text in _pages().items():
        rendered = hooks.render(text)
        assert not re.search(r"<!-- (capabilities|cli|constant|config-error)\b", rendered), path


def test_site_builds(tmp_path: Path) -> None:
    """`mkdocs build --strict` succeeds, and the API reference pages are not empty."""
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**_environment(), "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for page, names in {
        "reference/communicator": ["allreduce", "broadcast", "barrier", "aclose"],
        "reference/open-communicator": ["open_communicator", "ReduceOp"],
        "reference/errors": ["PeerAbortedError", "CommunicatorBrokenError"],
        "reference/transports": ["Transport", "Connection", "Listener"],
        "reference/testing": ["open_local_world"],
        "reference/capabilities": ["capabilities", "register_transport"],
    }.items():
        html = (site / page / "index.html").read_text()
        for name in names:
            assert re.search(rf'id="trioring\.([\w.]+\.)?{name}"', html), (page, name)
        # Sphinx roles in docstrings are rendered (docs/griffe_roles.py), except in the
        # source listings.
        prose = re.sub(r'<details class="mkdocstrings-source">.*?</details>', "", html, flags=re.S)
        assert not re.search(r":(func|meth|class|attr|data|exc|mod):`", prose), page
    page_dir = site / "explanation" / "algorithms"
    images = re.findall(r'<img [^>]*src="([^"]+)"', (page_dir / "index.html").read_text())
    assert len(images) == 4, images
    for image in images:
        assert image.endswith(".svg"), image
        assert (page_dir / image).resolve().is_file(), image
