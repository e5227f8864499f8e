"""Build the candidate tree that gives the most tokens per second on the target device.

1. Accuracy: on held-out distillation data, how often head i's rank-r proposal is the right token.
2. Trees: for each node budget, the tree maximising the expected accepted length, assuming heads are
   right independently (a node's value is the product of its path's accuracies; greedy best-first
   expansion is optimal for that objective and keeps the tree prefix-closed).
3. Hardware: the latency of a (budget+1)-token tree step on the device, against a 1-token forward; every
   size is timed once per round, in turn, so drift of a shared machine hits all sizes alike.
   The chosen budget maximises expected tokens per step divided by the step's cost.

    python train/medusa_tree_builder.py --heads train/demo_heads --data data/heldout.jsonl --out tree.json
"""

import argparse
import heapq
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from inference.devices import synchronize
from inference.errors import UserError, run_command
from inference.kv_cache import KVBuffer
from inference.loading import load_base_from_args, resolve_model_dir
from inference.tree_buffers import TreeMask, build_tree_buffers
from medusa_choices import Tree
from medusa_model import MedusaLoadError, load_heads
from train.medusa_training import IGNORE, cache_hidden_states, read_samples


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--heads", required=True, help="trained heads directory")
    parser.add_argument("--data", required=True, help="held-out distillation JSONL (not used in training)")
    parser.add_argument("--out", required=True, help="JSON tree for --medusa_choices")
    parser.add_argument("--base_model", help="model directory or Hub id (default: the embedded demo model)")
    parser.add_argument("--max_samples", type=int, default=200)
    parser.add_argument("--top_k", type=int, default=10, help="ranks considered per head")
    parser.add_argument("--budgets", default="1,2,3,4,6,8,12,16,24,32,48,63", help="tree sizes (nodes) to consider")
    parser.add_argument("--context", type=int, default=256, help="cached tokens while timing forwards")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds over all sizes (median per size)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--save_in_heads", action="store_true",
                        help="also record the chosen tree in the heads' config.json (their default tree)")
    return parser.parse_args(argv)


@torch.no_grad()
def rank_accuracy(heads, model, hidden: torch.Tensor, targets: torch.Tensor, next_ids: torch.Tensor, top_k: int,
                  batch: int = 512) -> list[list[float]]:
    """acc[i][r]: fraction of positions where head i's rank-r token is the target."""
    hits = torch.zeros(heads.num_heads, top_k)
    counts = torch.zeros(heads.num_heads)
    proposal_lm_head = heads.proposal_lm_head(model.lm_head)
    for start in range(0, hidden.shape[0], batch):
        h = hidden[start : start + batch].to(next(heads.parameters()).device, next(heads.parameters()).dtype)
        t = targets[start : start + batch].to(h.device)
        embeds = heads.next_token_embeds(model.get_input_embeddings(), next_ids[start : start + batch].to(h.device))
        top = heads.token_ids(heads(h, proposal_lm_head, next_embeds=embeds).topk(top_k, dim=-1).indices)  # [heads, B, k]
        for i in range(heads.num_heads):
            valid = t[:, i] != IGNORE
            hits[i] += (top[i][valid] == t[valid, i].unsqueeze(-1)).float().sum(0).cpu()
            counts[i] += valid.sum().cpu()
    return (hits / counts.clamp(min=1).unsqueeze(-1)).tolist()


def best_tree(accuracy: list[list[float]], budget: int) -> tuple[Tree, float]:
    """The `budget`-node tree with the highest expected accepted length, and that length."""
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


@torch.inference_mode()
def step_runner(model, tokens: int, context: int, tree: Tree | None, heads=None) -> Callable[[], None]:
    """A re-runnable forward of `tokens` new tokens after `context` cached ones; with a tree, the whole
    Medusa step: tree mask, lm_head on every node and the heads on one hidden state."""
    device = model.device
    cache = KVBuffer(model.config, context + tokens, device, model.dtype)
    model.model(input_ids=torch.randint(0, model.config.vocab_size, (1, context), device=device), cache=cache)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    kwargs = {}
    if tree is not None:
        buffers = build_tree_buffers(tree, device)
        kwargs = {"attention_mask": TreeMask(buffers, context + tokens, model.dtype).for_length(context),
                  "position_ids": buffers.position_offsets + context}
        proposal_lm_head = heads.proposal_lm_head(model.lm_head)

    @torch.inference_mode()
    def run() -> None:
        cache.length = context
        hidden = model.model(input_ids=ids, cache=cache, **kwargs).last_hidden_state
        model.lm_head(hidden)
        if tree is not None:
            embeds = heads.next_token_embeds(model.get_input_embeddings(), ids[:, 0])
            heads(hidden[:, 0], proposal_lm_head, num_heads=buffers.depth, next_embeds=embeds).topk(buffers.topk, dim=-1)

    return run


def interleaved_ms(runners: dict, repeats: int, device, progress=None) -> dict:
    """Median ms of each runner over `repeats` rounds that run every runner once, in turn, after one
    warm-up round: drift of a shared machine (clock, a neighbour's load) then hits every size alike."""
    times = {key: [] for key in runners}
    for round_index in range(repeats + 1):
        for key, run in runners.items():
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            if round_index:
                times[key].append(time.perf_counter() - start)
        if progress is not None:
            progress.update()
    return {key: 1000 * statistics.median(values) for key, values in times.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    def body():
        model, _, _ = load_base_from_args(args)
        device = model.device
        try:
            heads = load_heads(resolve_model_dir(args.heads), model.config.hidden_size, model.config.vocab_size)
        except MedusaLoadError as error:
            raise UserError(str(error)) from None
        heads = heads.to(device=device, dtype=model.dtype).eval()
        samples = read_samples(args.data)[: args.max_samples]
        progress = tqdm(total=len(samples), desc="held-out hidden states", unit="sample", file=sys.stderr)
        hidden, targets, next_ids = cache_hidden_states(model, samples, heads.num_heads, 2048, progress)
        progress.close()
        accuracy = rank_accuracy(heads, model, hidden, targets, next_ids, args.top_k)
        budgets = sorted({int(b) for b in args.budgets.split(",") if b.strip()})
        trees = {budget: best_tree(accuracy, budget) for budget in budgets}
        runners = {"plain": step_runner(model, 1, args.context, None)}
        runners |= {budget: step_runner(model, len(tree) + 1, args.context, tree, heads) for budget, (tree, _) in trees.items()}
        with tqdm(total=args.repeats + 1, desc="timing trees", unit="round", file=sys.stderr) as progress:
            step_ms = interleaved_ms(runners, args.repeats, device, progress)
        plain_ms = step_ms["plain"]
        candidates = []
        for budget, (tree, expected) in trees.items():
            candidates.append({"budget": len(tree), "expected_tokens_per_step": round(1 + expected, 4),
                               "step_ms": round(step_ms[budget], 3),
                               "expected_speedup": round((1 + expected) * plain_ms / step_ms[budget], 4), "tree": tree})
        best = max(candidates, key=lambda c: c["expected_speedup"])
        print(f"{'nodes':>5} {'E[tokens/step]':>14} {'step ms':>8} {'E[speedup]':>10}   (plain token {plain_ms:.2f} ms)")
        for c in candidates:
            mark = "  <- chosen" if c is best else ""
            print(f"{c['budget']:>5} {c['expected_tokens_per_step']:>14.3f} {c['step_ms']:>8.2f} {c['expected_speedup']:>9.3f}x{mark}")
        for i, row in enumerate(accuracy):
            print(f"head {i}: top-1 {row[0]:.3f}  top-{args.top_k} {sum(row):.3f}", file=sys.stderr)
        result = {**best, "plain_token_ms": round(plain_ms, 3), "device": str(device),
                  "dtype": str(model.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                  "head_rank_accuracy": [[round(a, 4) for a in row] for row in accuracy],
                  "candidates": [{k: v for k, v in c.items() if k != "tree"} for c in candidates]}
        with open(args.out, "w") as file:
            json.dump(result, file)
            file.write("\n")
        if args.save_in_heads:
            config_path = resolve_model_dir(args.heads) / "config.json"
            config = json.loads(config_path.read_text())
            config["medusa_choices"] = best["tree"]
            config_path.write_text(json.dumps(config, indent=2) + "\n")
        print(f"tree of {best['budget']} nodes written to {args.out} "
              f"(expected {best['expected_tokens_per_step']:.2f} tokens per step)", file=sys.stderr)

    return run_command(body, "interrupted")


if __name__ == "__main__":
    sys.exit(main())
