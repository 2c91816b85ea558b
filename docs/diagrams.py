"""Draw the SVG diagrams of docs/explanation/algorithms.md.

    python docs/diagrams.py            # rewrite docs/explanation/diagrams/*.svg
    python docs/diagrams.py OUT_DIR    # write them somewhere else

Each diagram is computed from the algorithm's own rules (the binomial tree from
``trioring._algorithms.tree_neighbours`` itself), not drawn by hand, and the output is
byte-for-byte reproducible: ``tests/test_docs.py`` regenerates the files and compares. The
SVGs are plain (no scripts, fonts or links), so the pages need no network to show them.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from xml.sax.saxutils import escape

from trioring._algorithms import tree_neighbours

OUT = Path(__file__).parent / "explanation" / "diagrams"

FONT = "font-family:DejaVu Sans,Helvetica,Arial,sans-serif"
MONO = "font-family:DejaVu Sans Mono,Menlo,Consolas,monospace"
INK = "#263238"
MUTED = "#607d8b"
SEND = "#1565c0"
PARTIAL = "#ffe0b2"
DONE = "#c8e6c9"
ACCENT = "#e65100"


class Svg:
    """A tiny SVG writer: integer coordinates only, so the output is reproducible."""

    def __init__(self, width: int, height: int, title: str) -> None:
        self.width, self.height = width, height
        self.parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img">',
            f"<title>{escape(title)}</title>",
            "<defs>",
            self._marker("arrow", SEND),
            self._marker("arrow-muted", MUTED),
            "</defs>",
            f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        ]

    @staticmethod
    def _marker(name: str, colour: str) -> str:
        return (
            f'<marker id="{name}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
            f'markerHeight="7" orient="auto-start-reverse">'
            f'<path d="M0,0 L10,5 L0,10 z" fill="{colour}"/></marker>'
        )

    def text(
        self,
        x: int,
        y: int,
        content: str,
        *,
        size: int = 13,
        anchor: str = "middle",
        mono: bool = False,
        bold: bool = False,
        colour: str = INK,
    ) -> None:
        weight = ";font-weight:bold" if bold else ""
        self.parts.append(
            f'<text x="{x}" y="{y}" text-anchor="{anchor}" fill="{colour}" '
            f'style="{MONO if mono else FONT};font-size:{size}px{weight}">{escape(content)}</text>'
        )

    def rect(self, x: int, y: int, w: int, h: int, *, fill: str, stroke: str = MUTED) -> None:
        width = 2 if stroke == ACCENT else 1
        self.parts.append(
            f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}" stroke="{stroke}" '
            f'stroke-width="{width}"/>'
        )

    def circle(self, x: int, y: int, r: int, *, fill: str = "#eceff1") -> None:
        self.parts.append(
            f'<circle cx="{x}" cy="{y}" r="{r}" fill="{fill}" stroke="{INK}" stroke-width="1.5"/>'
        )

    def arrow(
        self,
        x1: int,
        y1: int,
        x2: int,
        y2: int,
        *,
        both: bool = False,
        muted: bool = False,
        dashed: bool = False,
    ) -> None:
        marker = "arrow-muted" if muted else "arrow"
        start = f' marker-start="url(#{marker})"' if both else ""
        dash = ' stroke-dasharray="5,4"' if dashed else ""
        self.parts.append(
            f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{MUTED if muted else SEND}" '
            f'stroke-width="1.8"{dash}{start} marker-end="url(#{marker})"/>'
        )

    def line(self, x1: int, y1: int, x2: int, y2: int, *, colour: str = "#cfd8dc") -> None:
        self.parts.append(
            f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{colour}" stroke-width="1"/>'
        )

    def render(self) -> str:
        return "\n".join([*self.parts, "</svg>", ""])


# -- ring allreduce --------------------------------------------------------------------------


def ring_allreduce(n: int = 4) -> str:
    """Reduce-scatter, then all-gather, on ``n`` ranks whose arrays are cut into ``n``
    segments; ``_algorithms.ring_allreduce``'s indices: in reduce-scatter step s rank q sends
    segment (q - s) mod n, in all-gather step t it sends segment (q - t + 1) mod n."""
    cell_w, cell_h, gap, left, top = 74, 20, 40, 112, 44
    panel_h = n * cell_h + 34
    steps = 2 * (n - 1)
    width = left + n * cell_w + (n - 1) * gap + 56
    height = top + (steps + 1) * panel_h + 30
    svg = Svg(width, height, f"Ring allreduce on {n} ranks")
    contents = [[{q} for _ in range(n)] for q in range(n)]  # contents[rank][segment]

    def column(q: int) -> int:
        return left + q * (cell_w + gap)

    for q in range(n):
        svg.text(column(q) + cell_w // 2, 22, f"rank {q}", bold=True)

    for step in range(steps + 1):
        y0 = top + step * panel_h
        received: dict[int, int] = {}  # rank -> the segment it received in this step
        if step == 0:
            title = "start: every rank holds its own array"
        elif step < n:
            s = step - 1
            title = f"reduce-scatter step {step} of {n - 1}: receive a segment, add own values"
            sends = {q: (q - s) % n for q in range(n)}
            for q, segment in sends.items():
                received[(q + 1) % n] = segment
            for q, segment in received.items():
                contents[q][segment] = contents[(q - 1) % n][segment] | contents[q][segment]
        else:
            t = step - n
            title = f"all-gather step {t + 1} of {n - 1}: receive a finished segment, copy it"
            sends = {q: (q - t + 1) % n for q in range(n)}
            for q, segment in sends.items():
                received[(q + 1) % n] = segment
            for q, segment in received.items():
                contents[q][segment] = set(contents[(q - 1) % n][segment])
        svg.text(left - 8, y0 + 14, title, anchor="start", size=12, bold=True)
        for q in range(n):
            for segment in range(n):
                x, y = column(q), y0 + 22 + segment * cell_h
                cell = contents[q][segment]
                fill = DONE if len(cell) == n else PARTIAL if len(cell) > 1 else "#ffffff"
                stroke = ACCENT if received.get(q) == segment else MUTED
                svg.rect(x, y, cell_w, cell_h, fill=fill, stroke=stroke)
                label = "+".join(str(c) for c in sorted(cell))
                svg.text(x + cell_w // 2, y + 14, label, size=11, mono=True, bold=len(cell) == n)
            if q == 0:
                for segment in range(n):
                    svg.text(
                        8, y0 + 36 + segment * cell_h, f"seg {segment}", size=10, anchor="start"
                    )
        for q, segment in received.items():
            y = y0 + 22 + segment * cell_h + cell_h // 2
            if q == 0:  # from the last rank, around the ring
                svg.arrow(column(n - 1) + cell_w + 4, y, column(n - 1) + cell_w + 40, y)
                svg.text(column(n - 1) + cell_w + 44, y + 4, "0", size=11, anchor="start")
                svg.arrow(left - 44, y, left - 4, y)
                svg.text(left - 48, y + 4, str(n - 1), size=11, anchor="end")
            else:
                svg.arrow(column(q - 1) + cell_w + 4, y, column(q) - 4, y)
    legend_y = height - 12
    svg.rect(left - 8, legend_y - 11, 14, 12, fill=PARTIAL)
    svg.text(left + 12, legend_y, "partly reduced", size=11, anchor="start")
    svg.rect(left + 122, legend_y - 11, 14, 12, fill=DONE)
    svg.text(left + 142, legend_y, "finished (all ranks)", size=11, anchor="start")
    svg.rect(left + 282, legend_y - 11, 14, 12, fill="#ffffff", stroke=ACCENT)
    svg.text(left + 302, legend_y, "received in this step", size=11, anchor="start")
    return svg.render()


# -- recursive doubling ------------------------------------------------------------------------


def recursive_doubling(n: int = 6) -> str:
    """``_algorithms.recursive_doubling_allreduce``: ranks p..n-1 fold into r - p, the first
    p (a power of two) exchange with r XOR 2^k, then the folded ranks get the result."""
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    fold_out_step = p.bit_length() + 1
    phases: list[tuple[str, str, list[tuple[int, int]], bool]] = []
    if extra:
        phases.append(("fold in", "offset 0", [(r, r - p) for r in range(p, n)], False))
    distance, step = 1, 1
    while distance < p:
        pairs = [(r, r ^ distance) for r in range(p) if r < r ^ distance]
        phases.append((f"round {step}", f"offset {step}", pairs, True))
        distance, step = distance * 2, step + 1
    if extra:
        phases.append(
            ("fold out", f"offset {fold_out_step}", [(r, r + p) for r in range(extra)], False)
        )
    row_h, left, top, phase_w = 44, 80, 58, 150
    width = left + len(phases) * phase_w + 20
    height = top + n * row_h + 16
    svg = Svg(width, height, f"Recursive doubling allreduce on {n} ranks")
    for r in range(n):
        y = top + r * row_h
        svg.text(left - 16, y + 5, f"rank {r}", anchor="end", bold=True)
        svg.line(left - 8, y, width - 16, y)
    for index, (name, offset, pairs, exchange) in enumerate(phases):
        x0 = left + index * phase_w
        svg.text(x0 + phase_w // 2, 20, name, bold=True)
        svg.text(x0 + phase_w // 2, 38, offset, size=11, colour=MUTED, mono=True)
        spread = phase_w // (len(pairs) + 1)
        for k, (a, b) in enumerate(sorted(pairs, key=lambda pair: min(pair))):
            x = x0 + spread * (k + 1)
            ya, yb = top + a * row_h, top + b * row_h
            direction = 1 if yb > ya else -1
            svg.circle(x, ya, 4, fill=SEND)
            svg.arrow(x, ya + 6 * direction, x, yb - 6 * direction, both=exchange)
            svg.circle(x, yb, 4, fill=SEND)
    return svg.render()


# -- binomial tree ---------------------------------------------------------------------------


def binomial_tree(n: int = 8, root: int = 0) -> str:
    """The broadcast tree, from ``tree_neighbours`` itself; levels are hops from the root."""
    children = {r: tree_neighbours(r, n, root)[1] for r in range(n)}
    depth = {root: 0}
    order: list[int] = []

    def visit(r: int) -> None:
        order.append(r)
        for child in children[r]:
            depth[child] = depth[r] + 1
            visit(child)

    visit(root)
    leaves = [r for r in order if not children[r]]
    x_of: dict[int, int] = {}
    slot_w, left, top, level_h = 84, 50, 44, 86

    def place(r: int) -> int:
        if not children[r]:
            x_of[r] = left + leaves.index(r) * slot_w
        else:
            xs = [place(child) for child in children[r]]
            x_of[r] = (min(xs) + max(xs)) // 2
        return x_of[r]

    place(root)
    levels = max(depth.values())
    width = left * 2 + (len(leaves) - 1) * slot_w
    height = top + levels * level_h + 40
    svg = Svg(width, height, f"Binomial broadcast tree, {n} ranks, root {root}")
    for level in range(1, levels + 1):
        y = top + level * level_h
        svg.text(8, y - level_h // 2 + 4, f"hop {level}", anchor="start", size=11, colour=MUTED)
    for r in order:
        for child in children[r]:
            x1, y1 = x_of[r], top + depth[r] * level_h
            x2, y2 = x_of[child], top + depth[child] * level_h
            length = math.hypot(x2 - x1, y2 - y1)
            dx, dy = (x2 - x1) / length, (y2 - y1) / length
            svg.arrow(
                round(x1 + dx * 20), round(y1 + dy * 20), round(x2 - dx * 21), round(y2 - dy * 21)
            )
    for r in order:
        fill = DONE if r == root else "#eceff1"
        svg.circle(x_of[r], top + depth[r] * level_h, 18, fill=fill)
        svg.text(x_of[r], top + depth[r] * level_h + 5, str(r), bold=True)
    return svg.render()


# -- dissemination barrier -------------------------------------------------------------------


def dissemination_barrier(n: int = 5) -> str:
    """``_algorithms.barrier``: in round k every rank sends a token to rank + 2^k."""
    distances = []
    d = 1
    while d < n:
        distances.append(d)
        d *= 2
    panel, radius, top = 210, 70, 40
    width, height = panel * len(distances), top + 2 * radius + 70
    svg = Svg(width, height, f"Dissemination barrier on {n} ranks")
    for k, distance in enumerate(distances):
        cx, cy = k * panel + panel // 2, top + radius + 20
        svg.text(cx, 22, f"round {k}: r \u2192 r + {distance} mod {n}", bold=True)
        points = [
            (
                round(cx + radius * math.sin(2 * math.pi * r / n)),
                round(cy - radius * math.cos(2 * math.pi * r / n)),
            )
            for r in range(n)
        ]
        for r in range(n):
            (x1, y1), (x2, y2) = points[r], points[(r + distance) % n]
            length = math.hypot(x2 - x1, y2 - y1)
            dx, dy = (x2 - x1) / length, (y2 - y1) / length
            svg.arrow(
                round(x1 + dx * 16), round(y1 + dy * 16), round(x2 - dx * 17), round(y2 - dy * 17)
            )
        for r, (x, y) in enumerate(points):
            svg.circle(x, y, 14)
            svg.text(x, y + 5, str(r), bold=True)
        svg.text(cx, height - 14, f"token offset {k}", size=11, colour=MUTED, mono=True)
    return svg.render()


# -- Bruck allgather --------------------------------------------------------------------------


def bruck_allgather(n: int = 5) -> str:
    """``_algorithms.bruck_allgather``: rank r's position j holds rank (r - j) mod n's block;
    in round k it sends its first min(d, n - d) blocks to rank r + d (d = 2^k), receiving as
    many from rank r - d at positions d..; last, one copy per block puts them in rank order."""
    rounds = []
    d = 1
    while d < n:
        rounds.append(d)
        d *= 2
    cell_w, cell_h, gap, left, top = 34, 20, 26, 150, 46
    column_w = cell_w + gap
    panel_h = n * cell_h + 40
    width = left + n * column_w + 10
    height = top + (len(rounds) + 1) * panel_h + 10
    svg = Svg(width, height, f"Bruck allgather on {n} ranks")
    for q in range(n):
        svg.text(left + q * column_w + cell_w // 2, 22, f"rank {q}", bold=True)
    held = 1
    for panel in range(len(rounds) + 1):
        y0 = top + panel * panel_h
        if panel == 0:
            title, new = "start", range(0, 1)
        else:
            distance = rounds[panel - 1]
            blocks = min(distance, n - distance)
            title = f"round {panel - 1}: r \u2192 r + {distance}"
            new = range(distance, distance + blocks)
            held = distance + blocks
        svg.text(left - 8, y0 + 14, title, anchor="end", size=12, bold=True)
        for q in range(n):
            x = left + q * column_w
            for j in range(held):
                y = y0 + j * cell_h
                stroke = ACCENT if panel and j in new else MUTED
                fill = DONE if held == n else PARTIAL
                svg.rect(x, y, cell_w, cell_h, fill=fill, stroke=stroke)
                svg.text(x + cell_w // 2, y + 14, str((q - j) % n), size=11, mono=True)
    legend_y = height - 4
    svg.rect(left - 8, legend_y - 11, 14, 12, fill="#ffffff", stroke=ACCENT)
    svg.text(
        left + 12,
        legend_y,
        "received in this round (the rank whose block it is)",
        size=11,
        anchor="start",
    )
    return svg.render()


# -- binomial gather (and scatter) ------------------------------------------------------------


def _subtrees(n: int, root: int) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Each rank's children in ``tree_neighbours``'s tree, and the ranks of its subtree (whose
    blocks it holds once its children have sent theirs), in virtual-rank order."""
    children = {r: tree_neighbours(r, n, root)[1] for r in range(n)}
    below: dict[int, list[int]] = {}

    def collect(r: int) -> list[int]:
        ranks = [r]
        for child in reversed(children[r]):  # smallest subtree first: virtual-rank order
            ranks.extend(collect(child))
        below[r] = ranks
        return ranks

    collect(root)
    return children, below


def _span(ranks: list[int]) -> str:
    """``[4, 5]`` as "4-5", ``[3]`` as "3" (the ranks of a subtree are consecutive)."""
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}\u2013{ranks[-1]}"


def binomial_gather(n: int = 6, root: int = 0) -> str:
    """The gather tree, from ``tree_neighbours`` itself (the broadcast's tree, walked towards
    the root): a rank sends its parent the blocks of its whole subtree, once its own children
    have sent theirs; a scatter sends the same blocks the other way."""
    children, below = _subtrees(n, root)
    depth = {root: 0}
    order: list[int] = []

    def visit(r: int) -> None:
        order.append(r)
        for child in children[r]:
            depth[child] = depth[r] + 1
            visit(child)

    visit(root)
    leaves = [r for r in order if not children[r]]
    x_of: dict[int, int] = {}
    slot_w, left, top, level_h = 120, 40, 70, 96

    def place(r: int) -> int:
        if not children[r]:
            x_of[r] = left + leaves.index(r) * slot_w
        else:
            xs = [place(child) for child in children[r]]
            x_of[r] = (min(xs) + max(xs)) // 2
        return x_of[r]

    place(root)
    levels = max(depth.values())
    width = left * 2 + (len(leaves) - 1) * slot_w + 90
    height = top + levels * level_h + 30
    svg = Svg(width, height, f"Binomial gather on {n} ranks to root {root}")
    svg.text(width // 2, 22, f"gather to rank {root}", bold=True)
    svg.text(
        width // 2, 42, "(a scatter sends the same blocks the other way)", size=11, colour=MUTED
    )
    for r in order:
        for child in children[r]:
            x1, y1 = x_of[child], top + depth[child] * level_h
            x2, y2 = x_of[r], top + depth[r] * level_h
            length = math.hypot(x2 - x1, y2 - y1)
            dx, dy = (x2 - x1) / length, (y2 - y1) / length
            svg.arrow(
                round(x1 + dx * 20), round(y1 + dy * 20), round(x2 - dx * 21), round(y2 - dy * 21)
            )
            # Beside the sender: the blocks it sends (its subtree's, in rank order).
            blocks = f"block{'s' if len(below[child]) > 1 else ''} {_span(below[child])}"
            svg.text(x1 + 24, y1 + 5, blocks, size=11, anchor="start", mono=True, colour=SEND)
    for r in order:
        fill = DONE if r == root else "#eceff1"
        svg.circle(x_of[r], top + depth[r] * level_h, 18, fill=fill)
        svg.text(x_of[r], top + depth[r] * level_h + 5, str(r), bold=True)
    return svg.render()


# -- alltoall: pairwise exchange and Bruck -----------------------------------------------------

STEP_FILLS = ["#bbdefb", "#c8e6c9", "#ffe0b2", "#f8bbd0", "#d1c4e9", "#b2ebf2", "#fff9c4"]


def pairwise_alltoall(n: int = 5) -> str:
    """``_algorithms.pairwise_alltoall``: in step k (1 <= k < n) rank r sends its block for
    rank r + k and receives rank r - k's block; the matrix shows when each block moves."""
    step_of: dict[tuple[int, int], int] = {(r, r): 0 for r in range(n)}  # (from, to) -> step
    for step in range(1, n):
        for r in range(n):
            pair = (r, (r + step) % n)
            assert pair not in step_of, pair
            step_of[pair] = step
    assert len(step_of) == n * n
    cell, left, top = 64, 118, 70
    width = left + n * cell + 20
    height = top + n * cell + 64
    svg = Svg(width, height, f"Pairwise exchange alltoall on {n} ranks")
    svg.text(left + n * cell // 2, 20, "to rank", bold=True)
    svg.text(16, top + n * cell // 2, "from rank", anchor="start", bold=True)
    for c in range(n):
        svg.text(left + c * cell + cell // 2, top - 12, str(c), bold=True)
    for r in range(n):
        svg.text(left - 12, top + r * cell + cell // 2 + 5, str(r), anchor="end", bold=True)
        for c in range(n):
            step = step_of[(r, c)]
            x, y = left + c * cell, top + r * cell
            fill = "#ffffff" if step == 0 else STEP_FILLS[(step - 1) % len(STEP_FILLS)]
            svg.rect(x, y, cell, cell, fill=fill)
            label = "copy" if step == 0 else f"step {step}"
            svg.text(x + cell // 2, y + cell // 2 + 4, label, size=11, mono=True)
    svg.text(
        left - 100,
        height - 30,
        f"step k: rank r sends to r + k and receives from r \u2212 k (mod {n}),",
        size=11,
        anchor="start",
    )
    svg.text(
        left - 100,
        height - 12,
        "each block once; the block for itself is a local copy",
        size=11,
        anchor="start",
    )
    return svg.render()


def bruck_alltoall(n: int = 5) -> str:
    """``_algorithms.bruck_alltoall``: position j of rank r's buffer first holds its block
    for rank r + j; in round k (d = 2^k) it sends the positions with bit k set to rank r + d
    and receives as many from rank r - d into the same positions; last, a rotation puts the
    blocks in rank order. A cell "a>b" is the block that rank a sends to rank b."""
    work = [[(r, (r + j) % n) for j in range(n)] for r in range(n)]
    panels: list[tuple[str, list[list[tuple[int, int]]], set[int]]] = [
        ("start: position j holds the block for rank r + j", [row[:] for row in work], set())
    ]
    d = 1
    while d < n:
        chosen = {j for j in range(n) if j & d}
        new = [row[:] for row in work]
        for r in range(n):
            for j in chosen:
                new[(r + d) % n][j] = work[r][j]
        work = new
        title = (
            f"round {d.bit_length() - 1}: positions with bit {d.bit_length() - 1} set go to r + {d}"
        )
        panels.append((title, [row[:] for row in work], chosen))
        d *= 2
    for r in range(n):
        assert all(work[r][j] == ((r - j) % n, r) for j in range(n)), work[r]
    final = [[work[r][(r - i) % n] for i in range(n)] for r in range(n)]
    panels.append(("last: a rotation puts the blocks in rank order", final, set()))
    cell_w, cell_h, gap, left, top = 44, 20, 18, 92, 46
    column_w = cell_w + gap
    panel_h = n * cell_h + 40
    width = max(left + n * column_w + 10, 500)
    height = top + len(panels) * panel_h + 14
    svg = Svg(width, height, f"Bruck alltoall on {n} ranks")
    for q in range(n):
        svg.text(left + q * column_w + cell_w // 2, 22, f"rank {q}", bold=True)
    for index, (title, contents, received) in enumerate(panels):
        y0 = top + index * panel_h
        svg.text(8, y0 + 14, title, anchor="start", size=12, bold=True)
        for j in range(n):
            label = "pos" if index < len(panels) - 1 else "from"
            svg.text(8, y0 + 36 + j * cell_h, f"{label} {j}", size=10, anchor="start")
        for q in range(n):
            x = left + q * column_w
            for j in range(n):
                y = y0 + 22 + j * cell_h
                source, dest = contents[q][j]
                fill = DONE if dest == q else "#ffffff"
                stroke = ACCENT if j in received else MUTED
                svg.rect(x, y, cell_w, cell_h, fill=fill, stroke=stroke)
                svg.text(x + cell_w // 2, y + 14, f"{source}\u2192{dest}", size=11, mono=True)
    legend_y = height - 6
    svg.rect(8, legend_y - 11, 14, 12, fill=DONE)
    svg.text(
        28,
        legend_y,
        "a\u2192b: rank a's block for rank b; green: at its destination",
        size=11,
        anchor="start",
    )
    svg.rect(width - 150, legend_y - 11, 14, 12, fill="#ffffff", stroke=ACCENT)
    svg.text(width - 130, legend_y, "received this round", size=11, anchor="start")
    return svg.render()


# -- recursive doubling scan -------------------------------------------------------------------


def recursive_doubling_scan(n: int = 6) -> str:
    """``_algorithms.recursive_doubling_scan``: in round k rank r exchanges its partial
    result with rank r XOR 2^k if that rank exists, folding a lower partner's partial into
    both its result and its partial, a higher partner's into its partial only."""
    result = [{r} for r in range(n)]
    partial = [{r} for r in range(n)]
    phases: list[tuple[int, list[tuple[int, int]], list[set[int]]]] = []
    mask = 1
    while mask < n:
        pairs = [(r, r ^ mask) for r in range(n) if r < r ^ mask < n]
        incoming = [set(partial[r ^ mask]) if r ^ mask < n else set() for r in range(n)]
        for r in range(n):
            partner = r ^ mask
            if partner >= n:
                continue
            if partner < r:
                result[r] |= incoming[r]
            partial[r] |= incoming[r]
        phases.append((mask, pairs, [set(s) for s in result]))
        mask *= 2
    assert result == [set(range(r + 1)) for r in range(n)], result

    def label(ranks: set[int]) -> str:
        ordered = sorted(ranks)
        assert ordered == list(range(ordered[0], ordered[-1] + 1)), ordered
        return _span(ordered)

    row_h, left, top, start_w, phase_w, box_w = 40, 76, 62, 70, 170, 50
    width = left + start_w + len(phases) * phase_w + 16
    height = top + n * row_h + 34
    svg = Svg(width, height, f"Recursive doubling scan on {n} ranks")

    def box(x: int, y: int, ranks: set[int], r: int) -> None:
        fill = DONE if ranks == set(range(r + 1)) else PARTIAL
        svg.rect(x, y - 10, box_w, 20, fill=fill)
        svg.text(x + box_w // 2, y + 4, label(ranks), size=11, mono=True)

    for r in range(n):
        y = top + r * row_h
        svg.text(left - 14, y + 5, f"rank {r}", anchor="end", bold=True)
        svg.line(left - 6, y, width - 12, y)
        box(left, y, {r}, r)
    svg.text(left + box_w // 2, 22, "start", bold=True)
    for index, (mask, pairs, results) in enumerate(phases):
        x0 = left + start_w + index * phase_w
        svg.text(x0 + phase_w // 2, 22, f"round {index}: r \u2194 r XOR {mask}", bold=True)
        spread = (phase_w - box_w - 20) // (len(pairs) + 1)
        for k, (a, b) in enumerate(pairs):
            x = x0 + spread * (k + 1)
            ya, yb = top + a * row_h, top + b * row_h
            svg.circle(x, ya, 4, fill=SEND)
            svg.arrow(x, ya + 6, x, yb - 6, both=True)
            svg.circle(x, yb, 4, fill=SEND)
        for r in range(n):
            box(x0 + phase_w - box_w - 10, top + r * row_h, results[r], r)
    legend_y = height - 10
    svg.rect(left, legend_y - 11, 14, 12, fill=PARTIAL)
    svg.text(left + 20, legend_y, "result so far: the ranks reduced", size=11, anchor="start")
    svg.rect(left + 250, legend_y - 11, 14, 12, fill=DONE)
    svg.text(left + 270, legend_y, "finished: ranks 0..r", size=11, anchor="start")
    return svg.render()


# -- recursive doubling allgather --------------------------------------------------------------


def recursive_doubling_allgather(n: int = 8) -> str:
    """Recursive doubling allgather on a power of two: in round k rank r exchanges all it
    holds with rank r XOR 2^k, so it then holds the blocks of the aligned 2^(k+1) ranks
    around it."""
    assert n & (n - 1) == 0, n
    held = [{r} for r in range(n)]
    panels: list[tuple[str, list[set[int]], list[set[int]]]] = [
        ("start", [set(h) for h in held], [set() for _ in range(n)])
    ]
    mask = 1
    while mask < n:
        incoming = [set(held[r ^ mask]) for r in range(n)]
        for r in range(n):
            held[r] |= incoming[r]
        round_k = mask.bit_length() - 1
        panels.append((f"round {round_k}: r \u2194 r XOR {mask}", [set(h) for h in held], incoming))
        mask *= 2
    assert all(h == set(range(n)) for h in held)
    cell_w, cell_h, gap, left, top = 30, 18, 14, 150, 46
    column_w = cell_w + gap
    panel_h = n * cell_h + 30
    width = left + n * column_w + 10
    height = top + len(panels) * panel_h + 14
    svg = Svg(width, height, f"Recursive doubling allgather on {n} ranks")
    svg.text(left - 10, 22, "rank", anchor="end", bold=True)
    for q in range(n):
        svg.text(left + q * column_w + cell_w // 2, 22, str(q), bold=True)
    for index, (title, contents, received) in enumerate(panels):
        y0 = top + index * panel_h
        svg.text(left - 10, y0 + 14, title, anchor="end", size=12, bold=True)
        for q in range(n):
            x = left + q * column_w
            for block in sorted(contents[q]):
                y = y0 + block * cell_h
                fill = DONE if len(contents[q]) == n else PARTIAL
                stroke = ACCENT if block in received[q] else MUTED
                svg.rect(x, y, cell_w, cell_h, fill=fill, stroke=stroke)
                svg.text(x + cell_w // 2, y + 13, str(block), size=11, mono=True)
    legend_y = height - 6
    svg.rect(left - 8, legend_y - 11, 14, 12, fill="#ffffff", stroke=ACCENT)
    svg.text(
        left + 12,
        legend_y,
        "received in this round (block b is rank b's, at row b)",
        size=11,
        anchor="start",
    )
    return svg.render()


# -- reduce as reduce-scatter, then gather -----------------------------------------------------


def reduce_scatter_gather(n: int = 4, root: int = 0) -> str:
    """``_algorithms.reduce_scatter_gather``: a reduce-scatter leaves rank i with block i
    of the result; then every other rank sends its block straight to the root, which
    receives them all at once, each into its place."""
    full = "+".join(str(q) for q in range(n))
    held: list[dict[int, str]] = [{s: str(q) for s in range(n)} for q in range(n)]
    panels: list[tuple[str, list[dict[int, str]], list[set[int]]]] = []
    panels.append(("start: every rank's whole array", [dict(h) for h in held], [set()] * n))
    held = [{q: full} for q in range(n)]
    panels.append(("reduce-scatter: rank i finishes block i", [dict(h) for h in held], [set()] * n))
    senders = [q for q in range(n) if q != root]
    received: list[set[int]] = [set() for _ in range(n)]
    for q in senders:
        held[root][q] = held[q][q]
        received[root].add(q)
    title = f"gather: {', '.join(map(str, senders))} \u2192 {root}, all at once"
    panels.append((title, [dict(h) for h in held], received))
    assert set(held[root]) == set(range(n))
    cell_w, cell_h, gap, left, top = 74, 20, 40, 60, 44
    panel_h = n * cell_h + 40
    width = left + n * (cell_w + gap) + 10
    height = top + len(panels) * panel_h + 24
    svg = Svg(width, height, f"Reduce on {n} ranks: reduce-scatter, then gather to rank {root}")

    def column(q: int) -> int:
        return left + q * (cell_w + gap)

    for q in range(n):
        svg.text(column(q) + cell_w // 2, 22, f"rank {q}", bold=True)
    for index, (title, contents, received) in enumerate(panels):
        y0 = top + index * panel_h
        svg.text(8, y0 + 14, title, anchor="start", size=12, bold=True)
        for segment in range(n):
            svg.text(8, y0 + 36 + segment * cell_h, f"block {segment}", size=10, anchor="start")
        for q in range(n):
            for segment, label in contents[q].items():
                x, y = column(q), y0 + 22 + segment * cell_h
                fill = DONE if label == full else "#ffffff"
                stroke = ACCENT if segment in received[q] else MUTED
                svg.rect(x, y, cell_w, cell_h, fill=fill, stroke=stroke)
                svg.text(x + cell_w // 2, y + 14, label, size=11, mono=True, bold=label == full)
    legend_y = height - 8
    svg.rect(left - 8, legend_y - 11, 14, 12, fill=DONE)
    svg.text(left + 12, legend_y, "reduced over all ranks", size=11, anchor="start")
    svg.rect(left + 182, legend_y - 11, 14, 12, fill="#ffffff", stroke=ACCENT)
    svg.text(left + 202, legend_y, "received by the root", size=11, anchor="start")
    return svg.render()


DIAGRAMS = {
    "ring-allreduce.svg": ring_allreduce,
    "recursive-doubling.svg": recursive_doubling,
    "binomial-tree.svg": binomial_tree,
    "dissemination-barrier.svg": dissemination_barrier,
    "bruck-allgather.svg": bruck_allgather,
    "binomial-gather.svg": binomial_gather,
    "pairwise-alltoall.svg": pairwise_alltoall,
    "bruck-alltoall.svg": bruck_alltoall,
    "recursive-doubling-scan.svg": recursive_doubling_scan,
    "recursive-doubling-allgather.svg": recursive_doubling_allgather,
    "reduce-scatter-gather.svg": reduce_scatter_gather,
}


def write_all(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in DIAGRAMS.items():
        path = out / name
        path.write_text(draw(), encoding="utf-8", newline="\n")
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write_all(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(path)
