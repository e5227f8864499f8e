"""Convert a Medusa model between its on-disk layouts.

    python inference/convert_medusa.py --base_model BASE --medusa_dir HEADS --out OUT --layout one_checkpoint
    python inference/convert_medusa.py --base_model ONE_CHECKPOINT_DIR --out HEADS_DIR --layout heads

Layouts: `heads` (config.json + medusa_lm_head.safetensors, naming the base), `combined` (base files
with medusa_config.json + medusa_lm_head.safetensors beside them), `one_checkpoint` (heads inside the
model safetensors as medusa_head.* keys, Medusa fields in its config.json).
"""

import argparse
import sys

from inference.errors import UserError
from medusa_choices import TreeError
from medusa_model import LAYOUTS_ON_DISK, MedusaLoadError, MedusaModel


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base_model", required=True, help="base model, or a combined / one-checkpoint directory")
    parser.add_argument("--medusa_dir", help="heads directory (omit when --base_model holds the heads)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--layout", choices=LAYOUTS_ON_DISK, required=True)
    parser.add_argument("--medusa_choices", default="heads",
                        help="tree to store with the heads (one_checkpoint): a name, a JSON file, or heads (theirs)")
    parser.add_argument("--dtype", default="bf16", help="dtype of the written base weights")
    args = parser.parse_args(argv)
    try:
        model = MedusaModel.from_pretrained(args.base_model, args.medusa_dir, device="cpu", dtype=args.dtype,
                                            tree=args.medusa_choices)
        model.save_pretrained(args.out, layout=args.layout)
    except (UserError, MedusaLoadError, TreeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.layout} layout to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
