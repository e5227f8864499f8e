"""Sparse Medusa candidate trees.

A tree is a list of rank paths (the format of upstream FasterDecoding/Medusa): `[0, 2]` is the node
reached by taking head 0's top-1 token, then head 1's top-3 token. The root (the token the base model
already chose) is implicit. A valid tree is prefix-closed (every node's parent is in it) and no deeper
than the number of Medusa heads.

Tree sizes matter per device: on a GPU or NPU a 64-node verification costs about as much as one token,
on a 2-core CPU a k-token forward costs ~1.4x a 1-token one at k=8 and ~2.3x at k=32, so small trees win.
"""

import heapq
import json
import math
from dataclasses import dataclass
from pathlib import Path

Tree = list[list[int]]

# Upstream Medusa's trees, tuned on Vicuna/Zephyr (FasterDecoding/Medusa, Apache-2.0).
# fmt: off
mc_sim_7b_63 = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0]]
vicuna_7b_stage2 = [[0], [0, 0], [1], [0, 1], [0, 0, 0], [1, 0], [2], [0, 2], [0, 0, 1], [0, 3], [3], [0, 1, 0], [2, 0], [4], [0, 0, 2], [0, 4], [1, 1], [1, 0, 0], [0, 0, 0, 0], [5], [0, 0, 3], [0, 5], [0, 2, 0], [3, 0], [0, 1, 1], [0, 6], [6], [0, 7], [0, 0, 4], [4, 0], [1, 2], [0, 8], [7], [0, 3, 0], [0, 0, 0, 1], [0, 0, 5], [2, 1], [0, 0, 6], [1, 0, 1], [0, 0, 1, 0], [2, 0, 0], [5, 0], [0, 9], [0, 1, 2], [8], [0, 4, 0], [0, 2, 1], [1, 3], [0, 0, 7], [0, 0, 0, 2], [0, 0, 8], [1, 1, 0], [0, 1, 0, 0], [6, 0], [9], [0, 1, 3], [0, 0, 0, 3], [1, 0, 2], [0, 5, 0], [3, 1], [0, 0, 2, 0], [7, 0], [1, 4]]
vicuna_13b_stage2 = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [1, 0], [2], [0, 2], [0, 0, 1], [0, 1, 0], [3], [0, 3], [2, 0], [0, 0, 2], [0, 0, 0, 0], [0, 4], [1, 0, 0], [1, 1], [4], [0, 0, 3], [0, 5], [0, 2, 0], [5], [3, 0], [0, 1, 1], [0, 6], [0, 0, 4], [0, 0, 0, 1], [0, 7], [0, 0, 5], [1, 2], [0, 0, 1, 0], [0, 3, 0], [1, 0, 1], [4, 0], [0, 0, 6], [0, 8], [2, 0, 0], [0, 9], [6], [7], [2, 1], [5, 0], [0, 1, 2], [0, 0, 0, 2], [8], [0, 4, 0], [0, 1, 0, 0], [0, 2, 1], [0, 0, 7], [1, 1, 0], [1, 3], [0, 0, 2, 0], [9], [0, 0, 8], [0, 5, 0], [0, 0, 0, 3], [0, 0, 9], [0, 1, 3], [1, 0, 2], [0, 0, 1, 1], [3, 0, 0], [1, 0, 0, 0]]
vicuna_33b_stage2 = [[0], [0, 0], [1], [0, 1], [0, 0, 0], [1, 0], [2], [0, 2], [0, 0, 1], [0, 3], [3], [0, 1, 0], [2, 0], [0, 4], [4], [0, 0, 2], [1, 1], [1, 0, 0], [0, 5], [5], [0, 0, 0, 0], [0, 0, 3], [3, 0], [0, 2, 0], [0, 6], [0, 1, 1], [6], [0, 0, 4], [0, 7], [7], [1, 2], [4, 0], [8], [0, 3, 0], [0, 0, 5], [0, 0, 0, 1], [0, 8], [2, 1], [0, 9], [1, 0, 1], [2, 0, 0], [0, 0, 6], [5, 0], [0, 0, 1, 0], [1, 3], [0, 1, 2], [0, 4, 0], [0, 0, 7], [0, 2, 1], [9], [1, 1, 0], [0, 0, 0, 2], [6, 0], [0, 0, 8], [0, 1, 0, 0], [7, 0], [0, 1, 3], [0, 5, 0], [1, 4], [0, 0, 9], [3, 1], [1, 0, 2], [2, 2]]
zephyr_stage2 = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [2, 0], [0, 0, 1], [0, 4], [5], [0, 5], [0, 1, 0], [1, 1], [6], [0, 0, 2], [3, 0], [0, 6], [7], [0, 7], [0, 8], [0, 0, 3], [1, 0, 0], [0, 9], [0, 2, 0], [1, 2], [4, 0], [8], [9], [2, 1], [0, 1, 1], [0, 0, 4], [0, 0, 0, 0], [5, 0], [0, 3, 0], [1, 3], [0, 0, 5], [0, 0, 6], [6, 0], [2, 0, 0], [1, 0, 1], [0, 1, 2], [0, 4, 0], [1, 4], [3, 1], [2, 2], [0, 0, 7], [7, 0], [0, 2, 1], [0, 0, 8], [0, 1, 3], [0, 5, 0], [1, 5], [0, 0, 9], [1, 1, 0], [0, 0, 0, 1], [0, 0, 1, 0], [4, 1], [2, 3]]
# fmt: on

# For 3-head OpenPangu heads: mc_sim_7b_63 without its depth-4 nodes (60 nodes).
openpangu_3head = [path for path in mc_sim_7b_63 if len(path) <= 3]

# Small trees for devices where every tree token costs (CPU): the first nodes of mc_sim_7b_63, which is
# ordered by estimated acceptance, so each prefix is itself a good prefix-closed tree.
tree_8 = mc_sim_7b_63[:8]
tree_16 = mc_sim_7b_63[:16]
tree_32 = mc_sim_7b_63[:32]


def chain(depth: int) -> Tree:
    """The top-1 path only: plain multi-token prediction, `depth` nodes."""
    return [[0] * d for d in range(1, depth + 1)]


NAMED_TREES: dict[str, Tree] = {
    "mc_sim_7b_63": mc_sim_7b_63,
    "vicuna_7b_stage2": vicuna_7b_stage2,
    "vicuna_13b_stage2": vicuna_13b_stage2,
    "vicuna_33b_stage2": vicuna_33b_stage2,
    "zephyr_stage2": zephyr_stage2,
    "openpangu_3head": openpangu_3head,
    "tree_8": tree_8,
    "tree_16": tree_16,
    "tree_32": tree_32,
    "chain_2": chain(2),
    "chain_3": chain(3),
    "chain_4": chain(4),
}


class TreeError(ValueError):
    """A tree that cannot be verified: not prefix-closed, too deep, or malformed."""


def _is_int(value) -> bool:
    """An int that is not a bool (JSON's true and false are ints to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def validate_tree(tree: Tree, num_heads: int | None = None) -> Tree:
    """Check and normalise a tree (list of lists of non-negative ints); returns it sorted by (depth, path)."""
    if not isinstance(tree, (list, tuple)) or not tree:
        raise TreeError("a Medusa tree must be a non-empty list of rank paths such as [[0], [0, 0], [1]]")
    paths = []
    for path in tree:
        if not isinstance(path, (list, tuple)) or not path or not all(_is_int(r) and r >= 0 for r in path):
            raise TreeError(f"tree node {path!r} is not a non-empty list of non-negative integer ranks")
        paths.append(list(path))
    seen = {tuple(p) for p in paths}
    if len(seen) != len(paths):
        raise TreeError("the tree lists a node more than once")
    for path in paths:
        if len(path) > 1 and tuple(path[:-1]) not in seen:
            raise TreeError(f"the tree is not prefix-closed: node {path} has no parent {path[:-1]}")
    depth = max(len(p) for p in paths)
    if num_heads is not None and depth > num_heads:
        raise TreeError(f"the tree is {depth} levels deep but there are only {num_heads} Medusa heads")
    return sorted(paths, key=lambda p: (len(p), p))


# Context-lookup candidates per dynamic step (inference/engine/context_lookup.py), chosen on held-out data.
DEFAULT_LOOKUP = 12


@dataclass(frozen=True)
class DynamicTree:
    """A tree of `nodes` nodes chosen anew at every step from the heads' own probabilities (as EAGLE-2 does),
    instead of one fixed shape: level by level, the `expand` most likely nodes get their `top_k` most likely
    children, and the `nodes` most likely nodes of all (likelihood = product of the probabilities on the
    path) are verified. Confident steps get deep chains, uncertain ones wide levels, for the same cost.
    `lookup` more candidates come from the text so far (inference/engine/context_lookup.py): a chain of up to that
    many tokens below the root, which competes for the same `nodes`. `levels` caps the levels drafted (None: one
    per head): each costs a drafter call, and a small tree rarely keeps the deepest. The defaults were chosen on
    held-out data (train/demo_heads/README.md)."""

    nodes: int = 16
    top_k: int = 8
    expand: int = 4
    lookup: int = DEFAULT_LOOKUP
    levels: int | None = None

    def __post_init__(self):
        values = (self.nodes, self.top_k, self.expand, self.lookup)
        if not all(_is_int(v) for v in values) or self.nodes < 1 or self.top_k < 1 \
                or not 1 <= self.expand <= self.top_k or self.lookup < 0 \
                or not (self.levels is None or _is_int(self.levels) and self.levels >= 1):
            raise TreeError("a dynamic tree needs integers nodes >= 1, top_k >= 1, 1 <= expand <= top_k, lookup >= 0 "
                            "and levels >= 1 (or None)")
        # a chain longer than the tree cannot be verified: its tokens past the node count would only cost
        object.__setattr__(self, "lookup", min(self.lookup, self.nodes))

    def __len__(self) -> int:
        return self.nodes

    def __str__(self) -> str:
        lookup = "" if self.lookup == min(DEFAULT_LOOKUP, self.nodes) else f":{LOOKUP}={self.lookup}"
        shape = "" if (self.top_k, self.expand) == (DynamicTree.top_k, DynamicTree.expand) \
            else f":top_k={self.top_k}:expand={self.expand}"
        levels = "" if self.levels is None else f":{LEVELS}={self.levels}"
        return f"{DYNAMIC}:{self.nodes}{lookup}{shape}{levels}"

    def head_levels(self, num_heads: int) -> int:
        """Levels the heads draft: one per head, `levels` at most."""
        return num_heads if self.levels is None else min(self.levels, num_heads)

    def depth(self, num_heads: int) -> int:
        """Levels of the deepest possible node: the heads' levels, or the lookup chain where that is longer."""
        return max(self.head_levels(num_heads), self.lookup)

    def candidates(self, depth: int) -> int:
        """Nodes scored per step when drafting `depth` levels: top_k at level 1, expand * top_k below."""
        return self.top_k + (depth - 1) * self.expand * self.top_k

    def fits(self, num_heads: int) -> bool:
        """Whether `num_heads` heads score at least `nodes` candidates."""
        return self.nodes <= self.candidates(self.head_levels(num_heads))

    def checked(self, num_heads: int) -> "DynamicTree":
        if not self.fits(num_heads):
            levels = self.head_levels(num_heads)
            raise TreeError(f"a dynamic tree of {self.nodes} nodes needs more candidates than the heads score over "
                            f"{levels} level{'' if levels == 1 else 's'} ({self.candidates(levels)} with top_k "
                            f"{self.top_k}, expand {self.expand})")
        return self


DYNAMIC = "dynamic"
LOOKUP = "lookup"
LEVELS = "levels"


def ranks_taken(tree: Tree | DynamicTree) -> int:
    """The most proposals a node of `tree` takes from one head: the highest rank + 1 (top_k, dynamic)."""
    return tree.top_k if isinstance(tree, DynamicTree) else 1 + max(max(path) for path in tree)


def parse_dynamic(name: str) -> DynamicTree | None:
    """`dynamic` (16 nodes), `dynamic:N`, and either with any of `:lookup=K` (K context-lookup candidates, 0 for
    none), `:top_k=K`, `:expand=E` and `:levels=L` (L drafted levels at most) as a DynamicTree
    (`dynamic:5:top_k=1:expand=1:lookup=0` is a chain of 5); None for any other name."""
    prefix, *fields = name.split(":")
    if prefix != DYNAMIC:
        return None
    values = {"nodes": DynamicTree.nodes, LOOKUP: DEFAULT_LOOKUP, "top_k": DynamicTree.top_k, "expand": DynamicTree.expand,
              LEVELS: None}
    if fields and fields[0].isdigit():
        values["nodes"] = int(fields.pop(0))
    for field in fields:
        key, _, value = field.partition("=")
        if key not in ("top_k", "expand", LOOKUP, LEVELS) or not value.isdigit():
            raise TreeError(f"{name!r}: a dynamic tree is written dynamic[:N][:lookup=K][:top_k=K][:expand=E][:levels=L] "
                            "(N nodes, K of them at most from context lookup, L drafted levels at most; e.g. dynamic:16 "
                            "or dynamic:16:lookup=0)")
        values[key] = int(value)
    if f"{LOOKUP}=" in name and values[LOOKUP] > values["nodes"]:
        raise TreeError(f"{name!r}: a lookup chain of {values[LOOKUP]} tokens does not fit in {values['nodes']} nodes "
                        "(lookup=K needs K <= N; a longer chain cannot be verified)")
    return DynamicTree(values["nodes"], values["top_k"], min(values["expand"], values["top_k"]), values[LOOKUP],
                       values[LEVELS])


def load_tree(name_or_file: str, num_heads: int | None = None) -> Tree | DynamicTree:
    """A named tree from this module, `dynamic[:N]` (a `DynamicTree`), or a JSON file (a list of paths, or
    {"tree": [...]})."""
    dynamic = parse_dynamic(name_or_file)
    if dynamic is not None:
        return dynamic if num_heads is None else dynamic.checked(num_heads)
    if name_or_file in NAMED_TREES:
        return validate_tree(NAMED_TREES[name_or_file], num_heads)
    path = Path(name_or_file)
    if not path.is_file():
        raise TreeError(f"unknown tree {name_or_file!r}: use one of {', '.join(NAMED_TREES)}, "
                        f"{DYNAMIC}[:N] or a JSON file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise TreeError(f"{path} is not valid JSON: {error}") from None
    return validate_tree(data["tree"] if isinstance(data, dict) and "tree" in data else data, num_heads)


def best_tree(accuracy: list[list[float]], budget: int) -> tuple[Tree, float]:
    """The `budget`-node tree with the highest expected accepted length, and that length.

    `accuracy[i][r]`: how often head i's rank-r proposal is the right token. Heads are taken to be right
    independently, so a node's value is the product of its path's accuracies; best-first expansion is
    optimal for that objective and keeps the tree prefix-closed.
    """
    depth, top_k = len(accuracy), len(accuracy[0])
    frontier = [(-accuracy[0][r], [r]) for r in range(top_k)]
    heapq.heapify(frontier)
    tree, expected = [], 0.0
    while frontier and len(tree) < budget:
        value, path = heapq.heappop(frontier)
        tree.append(path)
        expected += -value
        if len(path) < depth:
            for r in range(top_k):
                heapq.heappush(frontier, (value * accuracy[len(path)][r], path + [r]))
    return tree, expected


def expected_accepted(tree: Tree, accuracy: list[list[float]]) -> float:
    """Expected accepted candidates per step of `tree` under the same independence model as `best_tree`;
    ranks beyond those measured count as never right."""
    def node_value(path: list[int]) -> float:
        if len(path) > len(accuracy):
            return 0.0
        return math.prod(accuracy[d][r] if r < len(accuracy[d]) else 0.0 for d, r in enumerate(path))

    return sum(node_value(path) for path in tree)
