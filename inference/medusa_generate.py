"""Medusa speculative decoding: heads propose, the base model verifies a token tree in one forward.

    python inference/medusa_generate.py --prompt "What is Medusa decoding?" --stream
    python inference/medusa_generate.py --base_model /path/to/openPangu-Embedded-7B \\
        --medusa_dir /path/to/heads --device npu --interactive
    python inference/medusa_generate.py --base_model DIR --medusa_dir DIR   # one combined directory

Greedy output is token-for-token identical to inference/generate.py; so is the distribution of sampled
output with --acceptance sample. --acceptance typical is Medusa's faster, lossy typical acceptance.
"""

import sys

from inference.cli import Session, base_parser, run_cli
from inference.demo_model import DEMO_HEADS_DIR
from inference.errors import UserError
from inference.loading import load_base, resolve_model_dir
from inference.medusa_decoding import ACCEPTANCE_RULES, Acceptance, default_rule
from medusa_choices import NAMED_TREES, TreeError, load_tree
from medusa_model import COMBINED_CONFIG, MedusaLoadError, MedusaModel, is_one_checkpoint, load_heads


def build_parser():
    parser = base_parser(__doc__.splitlines()[0])
    medusa = parser.add_argument_group("Medusa")
    medusa.add_argument("--medusa_dir", help="heads directory or Hub id (or the combined directory given as "
                        "--base_model); default: the committed demo heads for the demo model")
    medusa.add_argument("--medusa_choices", help=f"tree: one of {', '.join(NAMED_TREES)}, or a JSON file from "
                        "train/medusa_tree_builder.py (default: the heads' own tree, else tree_8 on CPU and "
                        "mc_sim_7b_63 on accelerators)")
    medusa.add_argument("--acceptance", choices=ACCEPTANCE_RULES,
                        help="greedy (exact), sample (lossless sampling), typical (lossy); default: greedy when "
                        "--temperature is 0, else sample")
    medusa.add_argument("--posterior_threshold", type=float, default=0.09, help="typical acceptance: threshold")
    medusa.add_argument("--posterior_alpha", type=float, default=0.3, help="typical acceptance: entropy factor")
    return parser


def load_medusa(args, device, dtype) -> MedusaModel:
    """Base model plus heads: --medusa_dir, else heads beside the base (combined directory), else the demo
    heads for the demo model, else untrained heads (still exact, about one token per step)."""
    try:
        medusa_dir = args.medusa_dir
        if medusa_dir is None and args.base_model is None and (DEMO_HEADS_DIR / "config.json").is_file():
            medusa_dir = str(DEMO_HEADS_DIR)
        model, tokenizer, base_dir = load_base(args.base_model, device, dtype)
        if medusa_dir is None and ((base_dir / COMBINED_CONFIG).is_file() or is_one_checkpoint(base_dir)):
            medusa_dir = str(base_dir)
        if medusa_dir is None:
            print("No Medusa heads given: using untrained heads (exact output, about 1 token per step).",
                  file=sys.stderr)
            medusa = MedusaModel.untrained(model, tokenizer=tokenizer)
        else:
            heads_dir = resolve_model_dir(medusa_dir)
            heads = load_heads(heads_dir, model.config.hidden_size, model.config.vocab_size)
            medusa = MedusaModel(model, heads, tokenizer)
            draft = heads.config.medusa_draft_vocab_size
            proposals = f", proposing from {draft} tokens" if draft else ""
            print(f"Medusa heads: {heads_dir} ({heads.num_heads} heads, {heads.config.medusa_head_layout}, "
                  f"input {heads.config.medusa_head_input}{proposals})", file=sys.stderr)
        if args.medusa_choices:
            medusa.tree = load_tree(args.medusa_choices, medusa.medusa_head.num_heads)
    except (MedusaLoadError, TreeError) as error:
        raise UserError(str(error)) from None
    return medusa


def make_session(args, device, dtype) -> Session:
    if args.acceptance == "greedy" and args.temperature > 0:
        raise UserError("--acceptance greedy needs --temperature 0 (use sample or typical when sampling)")
    medusa = load_medusa(args, device, dtype)
    rule = args.acceptance or default_rule(args.temperature)
    acceptance = Acceptance(rule, args.posterior_threshold, args.posterior_alpha)
    tree_size = len(medusa.tree) + 1
    print(f"Tree: {tree_size} tokens per step, depth {max(map(len, medusa.tree))}, acceptance {rule}", file=sys.stderr)

    def decode(request, stats):
        return medusa.decoder.decode(request, medusa.tree, acceptance, stats)

    return Session(medusa.base_model, medusa.tokenizer, decode, args,
                   extra_fields=lambda stats: {"tree_tokens": tree_size, "acceptance": rule})


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), make_session, argv)


if __name__ == "__main__":
    sys.exit(main())
