"""Medusa speculative decoding: heads propose, the base model verifies a token tree in one forward.

    python inference/medusa_generate.py --prompt "What is Medusa decoding?" --stream
    python inference/medusa_generate.py --base_model /path/to/openPangu-Embedded-7B \\
        --medusa_dir /path/to/heads --device npu --interactive
    python inference/medusa_generate.py --base_model DIR --medusa_dir DIR   # one combined directory

Greedy output is token-for-token identical to inference/generate.py; so is the distribution of sampled
output with --acceptance sample. --acceptance typical is Medusa's faster, lossy typical acceptance.
"""

import sys

import torch

from inference.cli import Session, base_parser, run_cli
from inference.engine.medusa_decoding import ACCEPTANCE_RULES, Acceptance, default_rule
from inference.runtime.arguments import non_negative_float
from inference.runtime.devices import dtype_name
from inference.runtime.errors import UserError
from medusa_choices import DEFAULT_LOOKUP, NAMED_TREES, DynamicTree
from medusa_model import MedusaModel


def build_parser():
    parser = base_parser(__doc__.splitlines()[0])
    medusa = parser.add_argument_group("Medusa")
    medusa.add_argument("--medusa_dir", help="heads directory or Hub id (or the combined directory given as "
                        "--base_model); default: heads inside --base_model, else the committed demo heads for "
                        "the demo model; heads naming their base load it when --base_model is not given")
    medusa.add_argument("--medusa_choices", default="auto",
                        help="tree: auto (the fastest here, from the heads' measured accuracy and this machine's "
                        "calibrated step costs; plain decoding if no tree pays), heads (the tree saved with the "
                        f"heads), one of {', '.join(NAMED_TREES)}, a JSON file from train/medusa_tree_builder.py, or "
                        "dynamic[:N][:lookup=K][:levels=L]: N nodes (default 16) chosen at every step from the "
                        "heads' probabilities, drafted L levels deep at most (default one per head), and up to K "
                        f"(default {DEFAULT_LOOKUP}, 0: none) tokens that followed the text's last tokens where they "
                        "occurred before; auto uses dynamic trees with lookup for heads that propose after "
                        "verification, as many levels deep as the best fixed tree of their size")
    medusa.add_argument("--acceptance", choices=ACCEPTANCE_RULES,
                        help="greedy (exact), sample (lossless sampling), typical (lossy); default: greedy when "
                        "--temperature is 0, else sample")
    medusa.add_argument("--posterior_threshold", type=non_negative_float, default=0.09,
                        help="typical acceptance: threshold")
    medusa.add_argument("--posterior_alpha", type=non_negative_float, default=0.3,
                        help="typical acceptance: entropy factor")
    return parser


def make_session(args, device: torch.device, dtype: torch.dtype | str | None) -> Session:
    if args.acceptance == "greedy" and args.temperature > 0:
        raise UserError("--acceptance greedy needs --temperature 0 (use sample or typical when sampling)")
    medusa = MedusaModel.from_pretrained(args.base_model, args.medusa_dir, device, dtype, args.medusa_choices,
                                         args.compile)
    rule = args.acceptance or default_rule(args.temperature)
    acceptance = Acceptance(rule, args.posterior_threshold, args.posterior_alpha)
    runtime = medusa.runtime
    print(f"Runtime: {runtime.reason}", file=sys.stderr)
    if medusa.tree is not None:
        if isinstance(medusa.tree, DynamicTree):
            tree = medusa.tree
            deepest = min(tree.depth(medusa.medusa_head.num_heads), tree.nodes)
            lookup = f", up to {min(tree.lookup, tree.nodes)} of them from context lookup" if tree.lookup else ""
            shape = f"chosen every step, up to {deepest} deep{lookup}"
        else:
            shape = f"depth {max(map(len, medusa.tree))}"
        print(f"Tree: {runtime.tree_tokens} tokens per step, {shape}, acceptance {rule}", file=sys.stderr)
    if runtime.options:
        sizes = "/".join(str(o.tokens) for o in sorted(runtime.options, key=lambda o: o.tokens) if o.tree is not None)
        print(f"Each step: the {sizes}-token tree or a plain step, whichever real steps show fastest", file=sys.stderr)

    def decode(request, stats):
        return medusa.decode(request, acceptance, stats)

    return Session(medusa.base_model, medusa.tokenizer, decode, args,
                   extra_fields=lambda stats: {"tree_tokens": runtime.tree_tokens, "dtype": dtype_name(runtime.dtype),
                                               "graph_mode": runtime.graph_mode,
                                               "acceptance": rule if medusa.tree is not None else "plain"})


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), make_session, argv)


if __name__ == "__main__":
    sys.exit(main())
