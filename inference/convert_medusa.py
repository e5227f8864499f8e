"""Convert a Medusa model between its on-disk layouts.

    python inference/convert_medusa.py --base_model BASE --medusa_dir HEADS --out OUT --layout one_checkpoint
    python inference/convert_medusa.py --base_model ONE_CHECKPOINT_DIR --out HEADS_DIR --layout heads
    python inference/convert_medusa.py --base_model BASE --medusa_dir HEADS --out VLLM_DIR --layout vllm

Layouts: `heads` (config.json + medusa_lm_head.safetensors, naming the base), `combined` (base files
with medusa_config.json + medusa_lm_head.safetensors beside them), `one_checkpoint` (heads inside the
model safetensors as medusa_head.* keys, Medusa fields in its config.json), `vllm` (the directory vLLM's
Medusa speculator loads: config.json with the Medusa keys only and model.safetensors, names checked).
"""

import sys

from inference.runtime.arguments import ArgumentParser, add_model_args
from inference.runtime.devices import parse_dtype, resolve_device, set_threads
from inference.runtime.errors import run_command
from inference.runtime.outputs import check_output_dir
from medusa_model import SAVE_LAYOUTS, MedusaModel


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, dtype_default="bf16", auto=False,
                   base_model_default="the base the heads name, else the demo model; or a combined / one-checkpoint "
                   "directory")
    parser.add_argument("--medusa_dir", help="heads directory (omit when --base_model holds the heads)")
    parser.add_argument("--out", required=True, help="directory to write (never a model's own directory, "
                        "unless --force)")
    parser.add_argument("--layout", choices=SAVE_LAYOUTS, required=True)
    parser.add_argument("--medusa_choices", default="heads",
                        help="tree to store with the heads (one_checkpoint): a name, a JSON file, or heads (theirs)")
    parser.add_argument("--force", action="store_true", help="write into a directory that holds a base model")
    args = parser.parse_args(argv)

    def body():
        check_output_dir(args.out, force=args.force)
        set_threads(args.threads)
        # converting decodes nothing: no step is timed eager against captured (minutes of compiling)
        model = MedusaModel.from_pretrained(args.base_model, args.medusa_dir, resolve_device(args.device),
                                            parse_dtype(args.dtype), args.medusa_choices, compile="off")
        model.save_pretrained(args.out, layout=args.layout)
        print(f"wrote {args.layout} layout to {args.out}", file=sys.stderr)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
