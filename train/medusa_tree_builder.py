"""Measure what trees the heads support: their per-rank accuracy, the best tree of each size, and what a tree
of the saved size accepts on held-out answers. Which size pays on a device is the runtime's choice
(`--medusa_choices auto`, from this accuracy and the machine's calibrated step costs), not this script's.

1. Accuracy: on held-out distillation data, how often head i's rank-r proposal is the right token.
2. Trees: for each node budget, the tree maximising the expected accepted length, assuming heads are
   right independently (a node's value is the product of its path's accuracies; greedy best-first
   expansion is optimal for that objective and keeps the tree prefix-closed).
3. Held out: for the `--nodes` tree, the tokens per step it and a dynamic tree of as many nodes give on the
   held-out answers, drafted as decoding drafts them (no independence assumed).

    python train/medusa_tree_builder.py --heads train/demo_heads --data data/heldout.jsonl --out tree.json
"""

import json
import sys

import torch

from inference.engine.medusa_decoding import MedusaDecoder
from inference.runtime.arguments import ArgumentParser, add_model_args, positive_int
from inference.runtime.errors import UserError, run_command
from inference.runtime.loading import load_base_from_args
from inference.runtime.medusa_heads import heads_config_path, load_heads, update_heads_config
from inference.runtime.outputs import check_output_file, write_atomic
from medusa_choices import DynamicTree, Tree, best_tree
from medusa_model import resolve_sources
from train.feature_drafter_training import base_features, depth_accuracy
from train.medusa_training import IGNORE, cache_hidden_states, read_samples


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, dtype_default="checkpoint", auto=False,
                   base_model_default="the base the heads' config names, else the embedded demo model")
    parser.add_argument("--heads", required=True, help="trained heads directory")
    parser.add_argument("--data", required=True, help="held-out distillation JSONL (not used in training)")
    parser.add_argument("--out", required=True, help="JSON tree for --medusa_choices")
    parser.add_argument("--max_samples", type=positive_int, default=200)
    parser.add_argument("--top_k", type=positive_int, default=10,
                        help="ranks considered per head (at most the heads' draft vocabulary)")
    parser.add_argument("--nodes", type=positive_int, default=16,
                        help="size of the tree written to --out and saved with --save_in_heads")
    parser.add_argument("--budgets", default="1,2,3,4,6,8,12,16,24,32,48,63",
                        help="tree sizes (nodes) whose expected tokens per step are reported")
    parser.add_argument("--save_in_heads", action="store_true",
                        help="also record the --nodes tree (their default with --medusa_choices heads: the fixed tree, "
                        "or a dynamic one of as many nodes where that gave more held-out tokens per step) and the "
                        "per-head per-rank accuracy (what --medusa_choices auto chooses from) in the heads' config")
    return parser.parse_args(argv)


@torch.no_grad()
def rank_accuracy(heads, model, hidden: torch.Tensor, targets: torch.Tensor, following_ids: torch.Tensor, top_k: int,
                  batch: int = 512) -> list[list[float]]:
    """acc[i][r]: fraction of positions where head i's rank-r token is the target. Heads that read tokens see
    the true ones, so for sequentially dependent heads this is the accuracy given that the path before it was
    right: exactly when a tree node's token matters."""
    hits = torch.zeros(heads.num_heads, top_k)
    counts = torch.zeros(heads.num_heads)
    proposal_lm_head = heads.proposal_lm_head(model.lm_head)
    for start in range(0, hidden.shape[0], batch):
        h = hidden[start : start + batch].to(next(heads.parameters()).device, next(heads.parameters()).dtype)
        t = targets[start : start + batch].to(h.device)
        embeds = heads.token_embeds(model.get_input_embeddings(), following_ids[start : start + batch].to(h.device))
        top = heads.token_ids(heads(h, proposal_lm_head, token_embeds=embeds).topk(top_k, dim=-1).indices)  # [heads, B, k]
        for i in range(heads.num_heads):
            valid = t[:, i] != IGNORE
            hits[i] += (top[i][valid] == t[valid, i].unsqueeze(-1)).float().sum(0).cpu()
            counts[i] += valid.sum().cpu()
    return (hits / counts.clamp(min=1).unsqueeze(-1)).tolist()


@torch.no_grad()
def drafted_acceptance(decoder: MedusaDecoder, hidden: torch.Tensor, targets: torch.Tensor,
                       following_ids: torch.Tensor, tree: Tree | DynamicTree, progress=None) -> torch.Tensor:
    """Per held-out position, the candidates a step drafted there accepts: the deepest node of the tree,
    drafted as decoding drafts it, whose path equals the base model's next tokens (its greedy answer)."""
    drafter = decoder.drafter(tree)
    depth = drafter.depth
    device = next(decoder.heads.parameters()).device
    pad = torch.full((1,), -1, dtype=torch.long, device=device)
    accepted = []
    for h, t, f in zip(hidden, targets, following_ids):
        step = drafter.from_hidden(f[:1].to(device), h.unsqueeze(0).to(device, decoder.base_model.dtype))
        candidates = torch.cat([step.tokens, pad])[step.paths][:, 1:]  # [P, depth]; pad and IGNORE match nothing
        accepted.append((candidates == t[:depth].to(device)).int().cumprod(dim=1).sum(dim=1).max())
        if progress is not None:
            progress.update()
    return torch.stack(accepted).cpu()


def feature_drafter_trees(args, drafter, model, heads_dir, samples: list[dict], budgets: list[int]) -> None:
    """The feature drafter's accuracy per level and rank, drafted as decoding drafts (its own features below the
    first level) along the held-out answers, and the dynamic tree it drafts (it drafts no fixed tree)."""
    features = base_features(model, samples, 2048, aux_layers=drafter.aux_layers)
    accuracy = depth_accuracy(drafter, model, features, drafter.num_heads, args.top_k)
    candidates = [{"budget": budget, "expected_tokens_per_step": round(1 + best_tree(accuracy, budget)[1], 4)}
                  for budget in budgets]
    for i, row in enumerate(accuracy):
        print(f"level {i + 1}: top-1 {row[0]:.3f}  top-{args.top_k} {sum(row):.3f}", file=sys.stderr)
    tree = DynamicTree(args.nodes)
    result = {"budget": args.nodes, "tree": str(tree), "device": str(model.device),
              "dtype": str(model.dtype).removeprefix("torch."), "head_rank_accuracy": accuracy, "candidates": candidates}
    write_atomic(args.out, json.dumps(result) + "\n")
    if args.save_in_heads:
        update_heads_config(heads_config_path(heads_dir), {"medusa_choices": str(tree), "medusa_head_accuracy": accuracy})
    print(f"{tree} recorded in {args.out}{' and the drafter config' if args.save_in_heads else ''}", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    def body():
        check_output_file(args.out)
        try:
            budgets = sorted({int(b) for b in args.budgets.split(",") if b.strip()})
        except ValueError:
            budgets = []
        if not budgets or budgets[0] < 1:
            raise UserError(f"--budgets {args.budgets}: give positive node counts, e.g. 4,8,16")
        # The base as everywhere else: --base_model, else the one the heads' config names (else the demo model)
        args.base_model, heads_dir = resolve_sources(args.base_model, args.heads)
        model, _ = load_base_from_args(args)
        device = model.device
        heads = load_heads(heads_dir, model.config.hidden_size, model.config.vocab_size)
        heads = heads.to(device=device, dtype=model.dtype).eval()
        if args.top_k > heads.proposal_size:
            raise UserError(f"--top_k {args.top_k} is more ranks than the heads have ({heads.proposal_size} tokens "
                            "in their draft vocabulary)")
        samples = read_samples(args.data)[: args.max_samples]
        if heads.config.medusa_head_input == "features":
            return feature_drafter_trees(args, heads, model, heads_dir, samples, budgets)
        progress = tqdm(total=len(samples), desc="held-out hidden states", unit="sample", file=sys.stderr)
        hidden, targets, following_ids = cache_hidden_states(model, samples, heads.num_heads, 2048, progress)
        progress.close()
        accuracy = rank_accuracy(heads, model, hidden, targets, following_ids, args.top_k)
        candidates = [{"budget": budget, "expected_tokens_per_step": round(1 + best_tree(accuracy, budget)[1], 4)}
                      for budget in budgets]
        tree, expected = best_tree(accuracy, args.nodes)
        drafted = {"tree": tree}
        # heads sharing the verification's lm_head pass would pay a second one for a dynamic tree
        if heads.propose_after_verification and DynamicTree(args.nodes).fits(heads.num_heads):
            # the heads' own nodes: the held-out positions have no text before them to look up
            drafted["dynamic"] = DynamicTree(args.nodes, lookup=0)
        decoder = MedusaDecoder(model, heads)
        with tqdm(total=len(hidden) * len(drafted), desc="drafting held-out steps", unit="step",
                  file=sys.stderr) as progress:
            held_out_tokens = {name: round(1 + drafted_acceptance(decoder, hidden, targets, following_ids, kind,
                                                                  progress).float().mean().item(), 4)
                               for name, kind in drafted.items()}
        print(f"{'nodes':>5} {'E[tokens/step]':>14}")
        for c in candidates:
            print(f"{c['budget']:>5} {c['expected_tokens_per_step']:>14.3f}")
        for i, row in enumerate(accuracy):
            print(f"head {i}: top-1 {row[0]:.3f}  top-{args.top_k} {sum(row):.3f}", file=sys.stderr)
        print(f"held-out tokens per step, drafted as decoding drafts: {args.nodes}-node tree "
              f"{held_out_tokens['tree']:.3f}" + (f", dynamic {args.nodes}-node tree {held_out_tokens['dynamic']:.3f}"
                                                  if "dynamic" in held_out_tokens else ""), file=sys.stderr)
        result = {"budget": len(tree), "tree": tree, "expected_tokens_per_step": round(1 + expected, 4),
                  "device": str(device), "dtype": str(model.dtype).removeprefix("torch."),
                  "head_rank_accuracy": [[round(a, 4) for a in row] for row in accuracy],
                  "held_out_tokens_per_step": held_out_tokens, "candidates": candidates}
        write_atomic(args.out, json.dumps(result) + "\n")
        if args.save_in_heads:
            config_path = heads_config_path(heads_dir)
            dynamic_better = held_out_tokens.get("dynamic", 0.0) > held_out_tokens["tree"]
            # saved with the default context lookup, which decoding has the text for
            update_heads_config(config_path, {"medusa_choices": str(DynamicTree(args.nodes)) if dynamic_better else tree,
                                              "medusa_head_accuracy": result["head_rank_accuracy"]})
            print(f"recorded in {config_path}: the {'dynamic' if dynamic_better else 'fixed'} {args.nodes}-node tree",
                  file=sys.stderr)
        print(f"tree of {len(tree)} nodes written to {args.out} (expected {1 + expected:.2f} tokens per step)",
              file=sys.stderr)

    return run_command(body, "interrupted")


if __name__ == "__main__":
    sys.exit(main())
