"""Train a feature drafter (EAGLE-style: a decoder layer or a few over the base model's features) on a frozen base
model.

    python train/train_feature_drafter.py --data data/sharegpt.jsonl --out train/demo_drafter --levels 6 \\
        --draft_vocab_from train/demo_heads --epochs 4 --unroll 2 --threads 2 --dtype bf16

The base model runs once over every sample (its features stay in memory); the drafter then trains by teacher
forcing (train/feature_drafter_training.py). Held-out samples give the per-level, per-rank accuracy of drafting
as decoding does, saved with the drafter for the runtime's choice of tree. The result is a heads directory
(config.json + medusa_lm_head.safetensors) that inference/medusa_generate.py --medusa_dir loads.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from inference.runtime.arguments import (ArgumentParser, add_model_args, fraction, non_negative_float, positive_float,
                                         positive_int)
from inference.runtime.demo_model import DEMO_NAME
from inference.runtime.errors import UserError, run_command
from inference.runtime.feature_drafter import FeatureDrafter, feature_layer_fields, new_feature_drafter, start_from
from inference.runtime.loading import load_base_from_args
from inference.runtime.medusa_heads import load_heads, save_heads
from inference.runtime.outputs import check_output_dir, write_atomic
from train.feature_drafter_training import DrafterLoss, base_features, depth_accuracy, feature_samples, train_drafter
from train.features_cache import cached_features, check_cache
from train.medusa_training import distinct, draft_vocabulary, read_samples, split_held_out


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, dtype_default="checkpoint", auto=False)  # the base's dtype; the drafter trains in fp32
    parser.add_argument("--data", required=True, nargs="+", help="JSONL file(s) from train/gen_distill_data.py")
    parser.add_argument("--out", required=True, help="directory for the drafter (what is there is replaced only when "
                        "training ends)")
    parser.add_argument("--levels", type=positive_int, default=6, help="how many levels deep the drafter drafts")
    vocab = parser.add_mutually_exclusive_group()
    vocab.add_argument("--draft_vocab_size", type=positive_int,
                       help="propose from the K most frequent answer tokens only (K/V of the projection's cost)")
    vocab.add_argument("--draft_vocab_from", help="propose from the draft vocabulary of these heads (a heads directory)")
    parser.add_argument("--init", help="start from this feature drafter's weights (a drafter directory) to train it "
                        "further; it proposes from the draft vocabulary the options above give, else from its own (the held-out "
                        "accuracy may then count samples the first run trained on)")
    parser.add_argument("--aux_layers", type=layer_list,
                        help="fuse the inputs of these base layers (comma-separated indices, e.g. 10,20 of 30) into the "
                        "text's features, after EAGLE-3; default: --init's, else none (the final features only)")
    parser.add_argument("--layers", type=positive_int,
                        help="decoder layers of the drafter; default: --init's, else 1 (layers added to --init's start "
                        "as identities, so training starts from what --init drafts)")
    parser.add_argument("--epochs", type=positive_float, default=4.0)
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument("--tokens_per_batch", type=positive_int, default=4096, help="padded tokens per batch")
    parser.add_argument("--unroll", type=positive_int, default=1,
                        help="training passes per batch, each after the first reading the drafter's own features")
    parser.add_argument("--token_weight", type=non_negative_float, default=0.1,
                        help="weight of the soft-target token loss beside the feature regression")
    parser.add_argument("--max_length", type=positive_int, default=512)
    parser.add_argument("--eval_fraction", type=fraction, default=0.05, help="held-out samples for accuracy, in [0, 1)")
    parser.add_argument("--online_features", action="store_true",
                        help="run the frozen base model in every training step instead of keeping its features in "
                        "memory (for large models: a 7B model's features take 8 KB per token)")
    parser.add_argument("--features_cache", metavar="DIR", help="keep the base features in this directory, each "
                        "sample's by its token ids, and reuse them while the base model, its dtype and --max_length are "
                        "the same (training again skips the base model; data added later computes only the new "
                        "samples' and adds them as new files)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def layer_list(text: str) -> list[int]:
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        layers = []
    if not layers or min(layers) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer indices >= 1")
    return sorted(set(layers))


def aux_layers(args, model, initial: FeatureDrafter | None) -> tuple[int, ...]:
    """The base layers the drafter fuses: --aux_layers, else --init's; each an index of a layer of `model`."""
    layers = tuple(args.aux_layers or (initial.aux_layers if initial is not None else ()))
    if initial is not None and initial.aux_layers and layers != initial.aux_layers:
        raise UserError(f"--aux_layers {list(layers)}: --init's drafter fuses {list(initial.aux_layers)}")
    if any(i >= model.config.num_hidden_layers for i in layers):
        raise UserError(f"--aux_layers: the base model has layers 1..{model.config.num_hidden_layers - 1} to fuse "
                        f"(an index >= 1 names the input of that layer), not {list(layers)}")
    return layers


def decoder_layers(args, initial: FeatureDrafter | None) -> int:
    """The drafter's decoder layers: --layers, else --init's, else 1; never fewer than --init's."""
    known = len(initial.layers) if initial is not None else 1
    if args.layers is not None and initial is not None and args.layers < known:
        raise UserError(f"--layers {args.layers}: --init's drafter has {known} decoder layers (a drafter can add "
                        "layers to the one it starts from, not drop them)")
    return args.layers or known


def initial_drafter(args, model) -> FeatureDrafter | None:
    """The drafter --init names, checked to have the layer a new drafter for `model` would have."""
    if not args.init:
        return None
    drafter = load_heads(args.init, model.config.hidden_size, model.config.vocab_size)
    if not isinstance(drafter, FeatureDrafter) or drafter.fields != feature_layer_fields(model.config):
        raise UserError(f"--init {args.init} is not a feature drafter for this base model")
    return drafter


def proposal_tokens(args, samples: list[dict], model, initial: FeatureDrafter | None) -> list[int] | None:
    if initial is not None and not (args.draft_vocab_from or args.draft_vocab_size):
        return None if initial.draft_vocab is None else initial.draft_vocab.tolist()
    if args.draft_vocab_from:
        heads = load_heads(args.draft_vocab_from, model.config.hidden_size, model.config.vocab_size)
        if heads.draft_vocab is None:
            raise UserError(f"the heads in {args.draft_vocab_from} have no draft vocabulary")
        return heads.draft_vocab.tolist()
    if args.draft_vocab_size:
        return draft_vocabulary(samples, args.draft_vocab_size, model.config.vocab_size)
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    started = time.time()

    def body():
        check_output_dir(args.out)
        cache = Path(args.features_cache) if args.features_cache else None
        if cache is not None:
            check_cache(cache)
        torch.manual_seed(args.seed)
        model, _ = load_base_from_args(args)
        initial = initial_drafter(args, model)
        fused = aux_layers(args, model, initial)
        layers = decoder_layers(args, initial)  # checked before the features, which take minutes
        read = [s for path in args.data for s in read_samples(path)]
        samples = distinct(read)
        train_samples, eval_samples = split_held_out(samples, args.eval_fraction, args.seed)
        if args.online_features:
            train_features = feature_samples(train_samples, args.max_length)
            eval_features = base_features(model, eval_samples, args.max_length, aux_layers=fused)
        else:
            with tqdm(total=len(samples), desc="base features", unit="sample") as progress:
                features = cached_features(cache, model, eval_samples + train_samples, args.max_length, progress, fused)
            train_features, eval_features = features[len(eval_samples):], features[: len(eval_samples)]
        featured = time.time()
        draft_ids = proposal_tokens(args, train_samples, model, initial)
        drafter = new_feature_drafter(model, args.levels, args.base_model or DEMO_NAME, draft_ids, fused, layers)
        if initial is not None:  # its layers' weights (the fields match); the draft vocabulary is this run's
            start_from(drafter, initial)
        drafter = drafter.to(model.device)
        loss_fn = DrafterLoss(drafter, model, args.unroll, args.token_weight)
        history = []
        with tqdm(desc="training", unit="batch") as progress:
            steps = train_drafter(loss_fn, train_features, args.epochs, args.lr, args.tokens_per_batch, args.seed,
                                  progress, lambda step, loss, stats: history.append({"step": step, "loss": round(loss, 4),
                                                                                      **{k: round(v, 4) for k, v in stats.items()}}))
        trained = time.time()
        drafter.eval()
        accuracy = depth_accuracy(drafter, model, eval_features, args.levels) if eval_features else None
        drafter.config.medusa_head_accuracy = accuracy
        save_heads(drafter.float().cpu(), args.out)
        report = {
            "data": args.data, "samples": len(samples), "repeats_dropped": len(read) - len(samples),
            "train_samples": len(train_samples),
            "held_out_samples": len(eval_samples), "train_tokens": sum(len(f.ids) for f in train_features),
            "steps": steps, "seconds_features": round(featured - started, 1),
            "seconds_training": round(trained - featured, 1), "seconds": round(time.time() - started, 1),
            "held_out_accuracy": accuracy, "history": history, "args": vars(args),
        }
        write_atomic(Path(args.out) / "training_report.json", json.dumps(report, indent=2) + "\n")
        for level, row in enumerate(accuracy or []):
            print(f"level {level + 1}: held-out top-1 {row[0]:.3f}, top-5 {sum(row[:5]):.3f}", file=sys.stderr)
        print(f"drafter saved to {args.out}", file=sys.stderr)

    return run_command(body, "interrupted: nothing was saved; rerun the command")


if __name__ == "__main__":
    sys.exit(main())
