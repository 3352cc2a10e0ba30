"""A workflow's graph laid out on the server, for inline SVG (like the dashboard's chart):
no script, no CDN, and nothing a browser runs from a job's data.

A small layered layout: a job's column is the longest path to it from a job that waits
for nothing, so every edge points right; within a column, a job sits near the jobs it
waits for (the mean of their rows), which keeps a chain on one line and a fan-in level
with its parents. The drawing is capped (``MAX_DRAWN``): past it a page shows a table.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from django_jobs.models import JobStatus

# Past this many jobs a workflow is not drawn: the picture would be a blur and its
# markup megabytes.
MAX_DRAWN = 300
NODE_WIDTH, NODE_HEIGHT = 160, 40
GAP_X, GAP_Y, PAD = 56, 14, 8
# Characters of a task's name a node shows; the whole path is in its title.
LABEL_CHARS = 20
KNOWN_STATUSES = frozenset(JobStatus.values)


@dataclass(frozen=True)
class GraphJob:
    """What a node shows of its job."""

    id: int
    task_path: str
    status: str
    # Its page (the admin's job page), where the node links.
    url: str = ""


@dataclass(frozen=True)
class Node:
    id: int
    x: int
    y: int
    label: str
    status: str
    # The class its colour comes from: the status, or "unknown" for a value no state has
    # (rows can be edited by hand).
    tone: str
    title: str
    url: str = ""


@dataclass(frozen=True)
class Edge:
    parent: int
    child: int
    path: str


@dataclass(frozen=True)
class Drawing:
    nodes: list[Node]
    edges: list[Edge]
    width: int
    height: int
    node_width: int = NODE_WIDTH
    node_height: int = NODE_HEIGHT


def short_name(task_path: str, limit: int = LABEL_CHARS) -> str:
    """The task's own name (``app.tasks.send`` → ``send``), cut to ``limit`` characters."""
    name = task_path.rsplit(".", 1)[-1] or task_path
    return name if len(name) <= limit else name[: limit - 1] + "\u2026"


def ranks(ids: Sequence[int], edges: Iterable[tuple[int, int]]) -> dict[int, int]:
    """Each job's column: the longest path to it from a job with no parent among ``ids``.

    Jobs caught in a cycle (a graph the enqueue refuses, so only a row edited by hand)
    get a column of their own after the others instead of hanging the layout."""
    parents: dict[int, set[int]] = defaultdict(set)
    children: dict[int, list[int]] = defaultdict(list)
    known = set(ids)
    for parent, child in edges:
        if parent in known and child in known and parent != child:
            if parent not in parents[child]:
                parents[child].add(parent)
                children[parent].append(child)
    left = {job: len(parents[job]) for job in ids}
    rank = dict.fromkeys(ids, 0)
    frontier = sorted(job for job in ids if left[job] == 0)
    done = 0
    while frontier:
        following = []
        for job in frontier:
            done += 1
            for child in children[job]:
                rank[child] = max(rank[child], rank[job] + 1)
                left[child] -= 1
                if left[child] == 0:
                    following.append(child)
        frontier = sorted(following)
    if done < len(ids):
        last = max((rank[job] for job in ids if left[job] == 0), default=-1) + 1
        for job in ids:
            if left[job]:
                rank[job] = last
    return rank


def layout(jobs: Sequence[GraphJob], edges: Iterable[tuple[int, int]]) -> Drawing:
    """Place ``jobs`` (``(parent, child)`` edges among them) in columns by rank."""
    edges = list(edges)
    ids = [job.id for job in jobs]
    rank = ranks(ids, edges)
    parents: dict[int, list[int]] = defaultdict(list)
    for parent, child in edges:
        if parent in rank and child in rank:
            parents[child].append(parent)
    columns: dict[int, list[int]] = defaultdict(list)
    for job_id in sorted(ids):
        columns[rank[job_id]].append(job_id)
    row: dict[int, float] = {}
    for column in sorted(columns):
        members = columns[column]

        def near_parents(job_id: int) -> tuple[float, int]:
            placed = [row[p] for p in parents[job_id] if p in row]
            return (sum(placed) / len(placed) if placed else -1.0, job_id)

        for index, job_id in enumerate(sorted(members, key=near_parents)):
            row[job_id] = index
    position = {
        job_id: (
            PAD + rank[job_id] * (NODE_WIDTH + GAP_X),
            PAD + int(row[job_id]) * (NODE_HEIGHT + GAP_Y),
        )
        for job_id in ids
    }
    nodes = [
        Node(
            id=job.id,
            x=position[job.id][0],
            y=position[job.id][1],
            label=short_name(job.task_path),
            status=job.status,
            tone=job.status if job.status in KNOWN_STATUSES else "unknown",
            title=f"#{job.id} {job.task_path}: {job.status}",
            url=job.url,
        )
        for job in jobs
    ]
    drawn = [
        Edge(parent, child, edge_path(position[parent], position[child]))
        for parent, child in dict.fromkeys(edges)
        if parent in position and child in position and parent != child
    ]
    width = max((x for x, _ in position.values()), default=0) + NODE_WIDTH + PAD
    height = max((y for _, y in position.values()), default=0) + NODE_HEIGHT + PAD
    return Drawing(nodes=nodes, edges=drawn, width=width, height=height)


def edge_path(parent: tuple[int, int], child: tuple[int, int]) -> str:
    """From the parent's right side to the child's left, a curve (a line if the child
    is not to its right: a cycle's column)."""
    x1, y1 = parent[0] + NODE_WIDTH, parent[1] + NODE_HEIGHT // 2
    x2, y2 = child[0], child[1] + NODE_HEIGHT // 2
    if x2 <= x1:
        return f"M{x1},{y1} L{x2},{y2}"
    middle = (x1 + x2) // 2
    return f"M{x1},{y1} C{middle},{y1} {middle},{y2} {x2},{y2}"
