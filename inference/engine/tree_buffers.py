"""Static tensors describing a Medusa tree, built once per (tree, device, dtype).

Node 0 is the root (the token the base model already chose); node i > 0 is `tree[i-1]` in
(depth, ranks) order. With `topk` candidates per head, the heads' proposals are flattened as
`[root, head0 top-k..., head1 top-k..., ...]` and `tree_indices` picks each node's token from it.
Sequentially dependent heads draft level by level instead (`levels`): head d-1 runs once per node of
level d-1 that has children, reading that node's path, and each node of level d takes one of its
parent's top-k tokens.
"""

from dataclasses import dataclass

import torch

from medusa_choices import Tree, ranks_taken, validate_tree


@dataclass(frozen=True)
class TreeLevel:
    """How level d (1-based) of the tree is drafted by head d-1 from the nodes of level d-1."""

    topk: int  # candidates taken per parent (max rank + 1 at this level)
    parent_paths: torch.Tensor  # [parents, d] node ids root .. parent of each parent that has children here
    select: torch.Tensor  # [nodes of level d] index into the parents' flattened [parents, topk] candidates


@dataclass(frozen=True)
class TreeBuffers:
    topk: int  # candidates taken from each head (max rank + 1)
    depth: int  # deepest level, = number of heads used
    tree_indices: torch.Tensor  # [T] index into [root, head0 topk, head1 topk, ...]
    position_offsets: torch.Tensor  # [1, T] depth of each node
    retrieve_indices: torch.Tensor  # [P, depth+1] node ids along each root-to-leaf path, -1 padded
    tree_mask: torch.Tensor  # [T, T] bool, node i may attend to node j (j is i or an ancestor of i)
    levels: tuple[TreeLevel, ...]  # per level, for sequentially dependent heads

    @property
    def size(self) -> int:
        """Tokens verified per step (the root included)."""
        return self.tree_indices.shape[0]


def build_tree_buffers(tree: Tree, device: torch.device | str = "cpu") -> TreeBuffers:
    paths = validate_tree(tree)
    node_of = {(): 0} | {tuple(p): i + 1 for i, p in enumerate(paths)}
    topk = ranks_taken(paths)
    depth = max(len(p) for p in paths)
    size = len(paths) + 1

    tree_indices = [0] + [1 + (len(p) - 1) * topk + p[-1] for p in paths]
    offsets = [0] + [len(p) for p in paths]
    mask = torch.eye(size, dtype=torch.bool)
    for path in paths:
        node = node_of[tuple(path)]
        for d in range(len(path)):
            mask[node, node_of[tuple(path[:d])]] = True

    leaves = [p for p in paths if not any(len(q) == len(p) + 1 and q[:-1] == p for q in paths)]
    retrieve = [[node_of[tuple(leaf[:d])] for d in range(len(leaf) + 1)] for leaf in leaves]
    retrieve = [r + [-1] * (depth + 1 - len(r)) for r in retrieve]

    def as_long(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    levels = []
    for d in range(1, depth + 1):
        here = [p for p in paths if len(p) == d]
        parents = sorted({tuple(p[:-1]) for p in here})
        slot = {parent: i for i, parent in enumerate(parents)}
        level_topk = max(p[-1] for p in here) + 1
        levels.append(TreeLevel(
            topk=level_topk,
            parent_paths=as_long([[node_of[parent[:j]] for j in range(d)] for parent in parents]),
            select=as_long([slot[tuple(p[:-1])] * level_topk + p[-1] for p in here]),
        ))

    return TreeBuffers(
        topk=topk,
        depth=depth,
        tree_indices=as_long(tree_indices),
        position_offsets=as_long(offsets).unsqueeze(0),
        retrieve_indices=as_long(retrieve),
        tree_mask=mask.to(device),
        levels=tuple(levels),
    )
