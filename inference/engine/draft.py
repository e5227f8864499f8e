"""What one Medusa step verifies: the tree drafted for it, as tensors of fixed shape."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Draft:
    """One step's tree: node tokens (node 0 is the root), each node's depth, the root-to-node path of every
    node (node ids, -1 padded: the candidate paths of the verification) and which nodes each may attend to."""

    tokens: torch.Tensor  # [T]
    position_offsets: torch.Tensor  # [1, T]
    paths: torch.Tensor  # [P, depth+1]
    tree_mask: torch.Tensor | None  # [T, T] bool; None: the static tree's, set once
