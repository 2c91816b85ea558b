"""The documentation: its runnable examples run and print what the pages say, its generated
parts (diagrams, CLI help, environment variables) match the code, and the site builds."""

from __future__ import annotations

import html as htmllib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from launched import load_module

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
    module: ModuleType = load_module("docs_hooks", DOCS / "hooks.py")
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


def _documented_output_of(page: Path, script: str) -> list[str]:
    """The lines of the ```text block after the `trioring run -n N SCRIPT` command."""
    pattern = rf"```sh\ntrioring run -n \d+ {re.escape(script)}\n```\n\n```text\n(.*?)```"
    block = re.search(pattern, page.read_text(), re.DOTALL)
    assert block is not None, (page, script)
    return block.group(1).splitlines()


def test_sharded_optimizer_under_trioring_run(tmp_path: Path) -> None:
    """The tutorial's training: the loss goes down, and every rank checked that the
    parameters are bitwise identical across ranks and match the one-process reference."""
    result = _run(
        *("-m", "trioring", "run", "-n", "4", "--no-tag-output"),
        str(EXAMPLES / "sharded_optimizer.py"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    losses = [float(line.split()[-1]) for line in lines if line.startswith("step ")]
    assert len(losses) == 8, lines
    assert losses == sorted(losses, reverse=True), losses
    assert losses[-1] < losses[0] / 10, losses
    assert "parameters bitwise identical on 4 ranks" in lines
    documented = _documented_output_of(
        DOCS / "tutorials" / "beyond-allreduce.md", "sharded_optimizer.py"
    )
    assert lines == documented


def test_sharded_evaluation_under_trioring_run(tmp_path: Path) -> None:
    """The tutorial's second part: scan gives each rank its offset in the shared file,
    gather brings the metrics to rank 0, and the file holds every rank's rows."""
    result = _run(
        *("-m", "trioring", "run", "-n", "4", "--no-tag-output"),
        str(EXAMPLES / "sharded_evaluation.py"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    documented = _documented_output_of(
        DOCS / "tutorials" / "beyond-allreduce.md", "sharded_evaluation.py"
    )
    assert result.stdout.splitlines() == documented
    predictions = np.load(tmp_path / "predictions.npy")
    assert predictions.shape == (30,)
    assert np.isfinite(predictions).all()


def test_from_torch_example_under_trioring_run(tmp_path: Path) -> None:
    """The how-to's port of torch.distributed calls runs, with every rank's checks, at
    several world sizes, and prints what the page shows at 4."""
    for n in (1, 3, 4):
        result = _run(
            *("-m", "trioring", "run", "-n", str(n), "--no-tag-output"),
            str(EXAMPLES / "from_torch.py"),
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"allgatherv sizes: {list(range(n))}" in result.stdout.splitlines()
    documented = _documented_output_of(DOCS / "how-to" / "from-mpi4py-or-torch.md", "from_torch.py")
    assert result.stdout.splitlines() == documented


def test_objects_example_under_trioring_run(tmp_path: Path) -> None:
    """The how-to's object collectives and object message run at several world sizes
    (every rank refuses the set before any I/O and carries on), and print what the page
    shows at 4."""
    for n in (1, 3, 4):
        result = _run(
            *("-m", "trioring", "run", "-n", str(n), "--no-tag-output"),
            str(EXAMPLES / "objects.py"),
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "still usable: True" in result.stdout.splitlines()
        assert f"hist sums: {[float(r + 1) for r in range(n)]}" in result.stdout.splitlines()
        summary = {"from": n - 1, "ranks": list(range(n))}
        assert f"summary: {summary}" in result.stdout.splitlines()
    documented = _documented_output_of(DOCS / "how-to" / "objects.md", "objects.py")
    assert result.stdout.splitlines() == documented


def _run_on_unix(script: str, n: int, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`trioring run -n N --transport unix` on an example, so that its sub-communicators
    agree on the one-host paths too."""
    return _run(
        *("-m", "trioring", "run", "-n", str(n), "--transport", "unix", "--no-tag-output"),
        str(EXAMPLES / script),
        cwd=cwd,
    )


def _check_on_unix(script: str, worlds: tuple[int, ...], line: str, how_to: str, cwd: Path) -> None:
    """``script`` under :func:`_run_on_unix` at each of ``worlds``: it exits 0 and prints
    ``line``, and at the last world prints exactly what the how-to page ``how_to`` shows."""
    for n in worlds:
        result = _run_on_unix(script, n, cwd)
        assert result.returncode == 0, result.stdout + result.stderr
        assert line in result.stdout.splitlines(), result.stdout
    documented = _documented_output_of(DOCS / "how-to" / how_to, script)
    assert result.stdout.splitlines() == documented


def test_pipeline_example_under_trioring_run(tmp_path: Path) -> None:
    """The how-to's pipeline: micro-batches of 1.125 MiB (rendezvous messages) pass through
    every stage and come back to rank 0 in order, equal to the one-process computation, at
    several world sizes, and the page shows the output at 4."""
    for n in (2, 3, 4):
        result = _run_on_unix("pipeline.py", n, tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        lines = result.stdout.splitlines()
        assert f"6 micro-batches through {n} stages" in lines, lines
        assert sum(line.endswith("same as one process: True") for line in lines) == 6, lines
    documented = _documented_output_of(DOCS / "how-to" / "send-recv.md", "pipeline.py")
    assert lines == documented


def test_halo_exchange_example_under_trioring_run(tmp_path: Path) -> None:
    """The how-to's halo exchange gives the one-process result bit for bit at every world
    size that divides the domain, a world of one (sends to itself) included."""
    _check_on_unix(
        "halo_exchange.py",
        (1, 2, 3, 4),
        "same as one process, bit for bit: True",
        "send-recv.md",
        tmp_path,
    )


def test_bucketing_example_under_trioring_run(tmp_path: Path) -> None:
    """The how-to's flat buffer: one allreduce of it gives every rank, bit for bit, what one
    allreduce per array gives, at several world sizes (a world of one included), and the
    page shows the output at 4. Its timing option runs too (its numbers are not checked:
    speed is the benchmarks' business)."""
    _check_on_unix(
        "bucketing.py",
        (1, 2, 3, 4),
        "one allreduce gives what 48 allreduces give: True",
        "speed.md",
        tmp_path,
    )
    timed = _run(
        *("-m", "trioring", "run", "-n", "2", "--no-tag-output"),
        str(EXAMPLES / "bucketing.py"),
        "--time",
        cwd=tmp_path,
    )
    assert timed.returncode == 0, timed.stdout + timed.stderr
    lines = timed.stdout.splitlines()
    for way in ("one call per array", "one call in all"):
        assert any(
            line.startswith(f"{way}: ") and line.endswith(" us (median of 50)") for line in lines
        ), lines


def test_work_queue_example_under_trioring_run(tmp_path: Path) -> None:
    """The how-to's work queue does every task once, whichever worker takes it, with one
    worker and with more workers than tasks, and prints what the page shows at 4."""
    for n in (2, 4, 16):
        result = _run_on_unix("work_queue.py", n, tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"12 tasks done by {n - 1} workers" in result.stdout.splitlines()
    result = _run_on_unix("work_queue.py", 4, tmp_path)
    documented = _documented_output_of(DOCS / "how-to" / "send-recv.md", "work_queue.py")
    assert result.stdout.splitlines() == documented


def test_groups_example_under_trioring_run(tmp_path: Path) -> None:
    """The tutorial: per-group averages, world averages and a background allgather on a
    dup, at once; every replica ends identical, at several world sizes, and the page shows
    the output at 4."""
    for n in (2, 6, 4):
        result = _run_on_unix("groups.py", n, tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"replicas identical on {n} ranks: True" in result.stdout.splitlines()
    documented = _documented_output_of(DOCS / "tutorials" / "groups.md", "groups.py")
    assert result.stdout.splitlines() == documented


def test_local_world_example(tmp_path: Path) -> None:
    result = _run(str(EXAMPLES / "local_world.py"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "every rank got [6. 6. 6. 6.]" in result.stdout


def test_trio_app_under_trioring_run(tmp_path: Path) -> None:
    """Rank 3 stalls 3 s in step 2; rank 0's 1 s deadline fires inside step 2's first
    allreduce. Rank 0 raises TooSlowError, the others PeerAbortedError naming rank 0, all
    their communicators are broken, and every rank recovers on a new communicator after
    backing off. The page shows exactly these lines (in some order)."""
    result = _run(
        *("-m", "trioring", "run", "-n", "4", "--no-tag-output"),
        str(EXAMPLES / "trio_app.py"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    documented = _documented_output(DOCS / "tutorials" / "trio-app.md")
    assert len(documented) == 20, documented
    missing = [line for line in documented if line not in lines]
    assert not missing, f"update docs/tutorials/trio-app.md? {missing}\n{result.stdout}"
    # Only the heartbeat may add lines (a step that is slow for other reasons).
    extra = [line for line in lines if line not in documented and "is taking over" not in line]
    assert not extra, f"update docs/tutorials/trio-app.md? {extra}\n{result.stdout}"
    for step in range(4):
        assert sum(line.startswith(f"step {step}: loss") for line in lines) == 1, result.stdout


def _trio_app_variant(tmp_path: Path, replacements: dict[str, str]) -> Path:
    """A copy of the tutorial's example with some of its text replaced (each old text must
    be there once)."""
    text = (EXAMPLES / "trio_app.py").read_text()
    for old, new in replacements.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / "trio_app.py"
    path.write_text(text)
    return path


def _trio_app_constant(name: str) -> float:
    match = re.search(rf"^{name} = ([\d.]+) ", (EXAMPLES / "trio_app.py").read_text(), re.M)
    assert match is not None, name
    return float(match.group(1))


def test_trio_app_gives_up_on_a_stall_that_repeats(tmp_path: Path) -> None:
    """With rank 3 stalling in every attempt at step 2, every rank fails MAX_ATTEMPTS times,
    backs off in between, then gives up and re-raises: the job fails instead of reopening
    communicators forever."""
    max_attempts = int(_trio_app_constant("MAX_ATTEMPTS"))
    backoff_s = _trio_app_constant("BACKOFF_S")
    assert _trio_app_constant("STALLS") < max_attempts
    example = _trio_app_variant(tmp_path, {"STALLS = 1 ": "STALLS = 99 "})
    result = _run(
        *("-m", "trioring", "run", "-n", "4", "--no-tag-output"), str(example), cwd=tmp_path
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    lines = result.stdout.splitlines()
    assert not any(line.startswith("step 2: loss") for line in lines), output
    # Ranks stopped by the launcher may lose their buffered output; the ones that gave up
    # by themselves exited normally and printed everything.
    gave_up = [
        int(m[1]) for line in lines if (m := re.match(r"rank (\d): step 2: giving up$", line))
    ]
    assert gave_up, output
    for rank in range(4):
        retries = [line for line in lines if line.startswith(f"rank {rank}: step 2: retrying")]
        assert len(retries) <= max_attempts - 1, output
        if rank in gave_up:
            delays = [float(line.split()[-2]) for line in retries]
            assert delays == [backoff_s * 2**i for i in range(max_attempts - 1)], output
            failures = [line for line in lines if re.match(rf"rank {rank}: step 2: \w+Error", line)]
            assert len(failures) == max_attempts, output
    assert "CollectiveMismatchError" not in output


def test_trio_app_deadline_outside_a_collective(tmp_path: Path) -> None:
    """With the deadline on rank 3 instead, it fires during rank 3's stall, outside any
    collective: rank 3's communicator is not broken, the error handler calls no collective
    on it (a barrier there would meet the peers' allreduce: CollectiveMismatchError), the
    peers see rank 3 leave (PeerFailedError), and every rank recovers."""
    example = _trio_app_variant(
        tmp_path, {"STEP_DEADLINE_S if comm.rank == 0": "STEP_DEADLINE_S if comm.rank == 3"}
    )
    result = _run(
        *("-m", "trioring", "run", "-n", "4", "--no-tag-output"), str(example), cwd=tmp_path
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    lines = result.stdout.splitlines()
    assert "rank 3: step 2: TooSlowError; communicator broken: False" in lines, output
    assert "rank 3: step 2: every later call raises CommunicatorBrokenError" not in lines
    for rank in range(3):  # told by rank 3's closed connection, or by a peer that saw it
        told = re.compile(rf"rank {rank}: step 2: Peer(Failed|Aborted)Error from rank \d")
        assert any(told.match(line) for line in lines), output
    for step in range(4):
        assert sum(line.startswith(f"step {step}: loss") for line in lines) == 1, output
    assert "CollectiveMismatchError" not in output


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
        "sharded_optimizer.py",
        "sharded_evaluation.py",
        "from_torch.py",
        "objects.py",
        "pipeline.py",
        "halo_exchange.py",
        "work_queue.py",
        "groups.py",
        "bucketing.py",
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
        assert not re.search(
            r"<!-- (capabilities|cli|constant|config-error|decision-table)\b", rendered
        ), path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for the tests below with `mkdocs build --strict`."""
    site = tmp_path_factory.mktemp("docs") / "site"
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
    return site


def _prose(html: str) -> str:
    """A built page without its source listings (which show docstrings as written)."""
    return re.sub(r'<details class="mkdocstrings-source">.*?</details>', "", html, flags=re.S)


def _text(html: str) -> str:
    """What a reader sees of a built page's article: its text, without tags."""
    article = re.search(r"<article[^>]*>(.*?)</article>", html, re.S)
    assert article is not None
    return htmllib.unescape(re.sub(r"<[^>]+>", "", _prose(article.group(1))))


def test_site_builds(site: Path) -> None:
    """`mkdocs build --strict` succeeds, and the API reference pages are not empty."""
    for page, names in {
        "reference/communicator": [
            "allreduce",
            "broadcast",
            "barrier",
            "allgather",
            "allgatherv",
            "send",
            "recv",
            "recv_any",
            "sendrecv",
            "send_object",
            "recv_object",
            "split",
            "dup",
            "aclose",
        ],
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
        assert not re.search(r":(func|meth|class|attr|data|exc|mod):`", _prose(html)), page
    page_dir = site / "explanation" / "algorithms"
    images = re.findall(r'<img [^>]*src="([^"]+)"', (page_dir / "index.html").read_text())
    assert len(images) == len(list((DOCS / "explanation" / "diagrams").glob("*.svg"))), images
    for image in images:
        assert image.endswith(".svg"), image
        assert (page_dir / image).resolve().is_file(), image


def test_reference_pages_read_as_markdown(site: Path) -> None:
    """No reStructuredText shows through in the API reference: no literal-block marker
    (`part::`, a lone `::`), no private module as a heading or contents entry, and defaults
    that name a constant show its value (docs/griffe_roles.py)."""
    for page in sorted((site / "reference").glob("*/index.html")):
        html = page.read_text()
        text = _text(html)
        assert not re.search(r"::\s*$", text, re.M), (page, re.findall(r".*::\s*$", text, re.M))
        # Headings and the table of contents name only public objects.
        headings = re.findall(r"<h[1-6][^>]*>(.*?)</h[1-6]>", _prose(html), re.S)
        entries = re.findall(r'<a href="#[^"]*" class="md-nav__link">(.*?)</a>', html, re.S)
        for title in headings + entries:
            title = htmllib.unescape(re.sub(r"<[^>]+>", "", title)).strip()
            assert not re.search(r"(^|\.)_[a-z]", title), (page, title)
    testing = (site / "reference" / "testing" / "index.html").read_text()
    text = _text(testing)
    assert "part:" in text, text  # "takes part::" became "takes part:"
    signature = re.search(r"open_local_world\((.*?)\)\s*->", text, re.S)
    assert signature is not None, text
    assert "DEFAULT_CHUNK_BYTES" not in signature.group(1), signature.group(1)
    # The last parameter: a trailing comma only when the signature is formatted over several
    # lines (mkdocstrings does that when a formatter is installed, as in the dev extra).
    default = re.search(r"chunk_bytes: int = ([^,]+?),?\s*$", signature.group(1))
    assert default is not None, signature.group(1)
    from trioring._communicator import DEFAULT_CHUNK_BYTES

    assert eval(default.group(1)) == DEFAULT_CHUNK_BYTES, default.group(1)
    # The default's column of the parameter table shows it too.
    row = re.search(r"<td>\s*<code>chunk_bytes</code>\s*</td>.*?</tr>", _prose(testing), re.S)
    assert row is not None
    assert f"<code>{default.group(1)}</code>" in row.group(0), row.group(0)
    errors = _text((site / "reference" / "errors" / "index.html").read_text())
    assert errors.lstrip().startswith("Errors"), errors[:200]
    assert "derives from TrioringError:" in errors, errors[:500]


def test_literal_blocks() -> None:
    """reStructuredText literal blocks, as Sphinx reads them, become Markdown."""
    roles = load_module("griffe_roles", DOCS / "griffe_roles.py")
    code = "\n\n    await comm.barrier()\n"
    fenced = "\n\n```python\nawait comm.barrier()\n```\n"
    assert roles.literal_blocks(f"Like this::{code}") == f"Like this:{fenced}"
    assert roles.literal_blocks(f"Like this ::{code}") == f"Like this{fenced}"
    assert roles.literal_blocks(f"Text.\n\n::{code}") == f"Text.\n{fenced}"
    assert roles.literal_blocks("A tree::\n\n    a\n    └── b") == (
        "A tree:\n\n```text\na\n└── b\n```"
    )
    assert roles.literal_blocks('Entry point::\n\n    [a."b"]\n    c = "d"') == (
        'Entry point:\n\n```toml\n[a."b"]\nc = "d"\n```'
    )
    # Not followed by an indented block: left alone, as Sphinx does.
    assert roles.literal_blocks("a::\nb") == "a::\nb"
    assert roles.literal_blocks("C++ uses a::b::") == "C++ uses a::b::"
    # Inside a section (indented): only the marker changes.
    nested = "Args:\n    x: like this::\n\n        f(x)\n    y: why"
    assert roles.literal_blocks(nested) == "Args:\n    x: like this:\n\n        f(x)\n    y: why"


def test_site_ships_no_scripts(site: Path) -> None:
    """The build scripts under docs/ (hooks, griffe extension, diagrams) and the examples,
    which the pages include, are not pages: the site has no .py files."""
    assert sorted(str(p.relative_to(site)) for p in site.rglob("*.py")) == []
    assert (DOCS / "hooks.py").is_file()  # still there, for mkdocs.yml's hooks


def test_code_blocks_wrap(site: Path) -> None:
    """Long code lines wrap instead of being cut off at the edge of the column (a 1280 px
    window shows about 80 columns of code): a stylesheet says so, and every page loads it."""
    css = (site / "stylesheets" / "extra.css").read_text()
    rule = re.search(r"\.md-typeset pre > code\s*\{([^}]*)\}", css)
    assert rule is not None, css
    assert re.search(r"white-space:\s*pre-wrap", rule.group(1)), rule.group(1)
    for page in site.rglob("index.html"):
        assert re.search(r'<link [^>]*href="[./]*stylesheets/extra\.css"', page.read_text()), page


def test_performance_page_stands_on_its_own(site: Path) -> None:
    """The page states the project's targets; it does not send the reader to an issue."""
    for text in (
        (DOCS / "performance.md").read_text(),
        (ROOT / "bench" / "results" / "targets.md").read_text(),
        _text((site / "performance" / "index.html").read_text()),
    ):
        assert not re.search(r"\bissue\s*#?\d", text, re.I), re.findall(r".*issue.*", text, re.I)
    assert "performance targets" in _text((site / "performance" / "index.html").read_text())


def test_decision_table_page_lists_every_algorithm() -> None:
    """The algorithms page's decision table is generated from the decision module's own
    table, and that table names every algorithm that forcing accepts."""
    from trioring._collectives import _decision

    hooks = _hooks()
    assert _decision.__doc__ is not None
    rows = hooks.decision_rows(_decision.__doc__)
    named: dict[str, set[str]] = {}
    for collective, _, algorithm in rows:
        named.setdefault(collective, set()).update(re.findall(r"`(\w+)`", algorithm))
    for collective, algorithms in _decision.ALGORITHMS.items():
        if collective.endswith("v") and not named.get(collective):
            continue  # "as allgather": the uneven variant follows its even one's rows
        assert set(algorithms) <= named[collective] | named.get(collective[:-1], set()), collective
    page = hooks.render((DOCS / "explanation" / "algorithms.md").read_text())
    assert '| allgather | "shm" and each rank\'s block' in page
