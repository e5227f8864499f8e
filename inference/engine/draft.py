"""What one Medusa step verifies: the tree drafted for it, as tensors of fixed shape."""

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class Draft:
    """One step's tree: node tokens (node 0 is the root), each node's depth, the root-to-node path of every
    node (node ids, -1 padded: the candidate paths of the verification) and which nodes each may attend to."""

    tokens: torch.Tensor  # [T]
    position_offsets: torch.Tensor  # [1, T]
    paths: torch.Tensor  # [P, depth+1]
    tree_mask: torch.Tensor | None  # [T, T] bool; None: the static tree's, set once


class Carry(NamedTuple):
    """What one step hands the next on the device: the next root token [1], the hidden state [1, H] of the
    position it follows, what the drafter drafts the next tree from (`drafted`: the heads' logits there
    [depth, V'] for fixed trees that take them from the verification, the candidates there for dynamic
    trees, else a placeholder) and the valid cache length [1]."""

    root: torch.Tensor
    hidden: torch.Tensor
    drafted: object
    length: torch.Tensor


class Verified(NamedTuple):
    """What a step's verification settled, for the drafter to draft the next step from: the tree's `tokens` [T],
    the base model's final hidden states of its nodes `node_hidden` [T, H] (and `node_aux`, the inputs of the
    layers a fused feature drafter reads, else None), where the step started (`start` [1]), the accepted `path`
    [depth+1] (node ids, -1 padded) of `count` [1] accepted candidates ending at `node` [1], the next `root` [1]
    and its position's `hidden` [1, H], and the heads' logits at every node when they ran in the verification
    (else None)."""

    tokens: torch.Tensor
    node_hidden: torch.Tensor
    node_aux: torch.Tensor | None
    start: torch.Tensor
    path: torch.Tensor
    count: torch.Tensor
    node: torch.Tensor
    root: torch.Tensor
    hidden: torch.Tensor
    all_head_logits: torch.Tensor | None
