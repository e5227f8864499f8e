"""Heads from a checkpoint of train/train_medusa.py, so a run stopped early (out of time, or an earlier step
that measured better) keeps what it learned: the checkpoint's `heads.*` weights become a heads directory
with the run's config (train_medusa.py writes it into --out, as medusa_run_config.json, before training starts).

    python train/export_checkpoint.py --checkpoint runs/heads/checkpoint-2000 --out runs/heads-step2000
"""

import json
import sys
from pathlib import Path

from inference.runtime.arguments import ArgumentParser
from inference.runtime.errors import UserError, run_command
from inference.runtime.medusa_heads import MedusaConfig, heads_from_state, read_medusa_config, save_heads
from inference.runtime.outputs import check_output_dir
from train.medusa_training import RUN_CONFIG

PREFIX = "heads."


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a checkpoint-N directory inside a train_medusa.py --out")
    parser.add_argument("--out", required=True, help="heads directory to write")
    return parser.parse_args(argv)


def export_checkpoint(checkpoint: Path, out: Path) -> int:
    """Save the heads of `checkpoint` to `out`; returns the checkpoint's training step."""
    from safetensors.torch import load_file

    run_config = checkpoint.parent / RUN_CONFIG
    if run_config.is_file():
        try:
            config = MedusaConfig.from_dict(json.loads(run_config.read_text()))
        except json.JSONDecodeError as error:
            raise UserError(f"{run_config} is not valid JSON: {error}") from None
    else:  # runs that wrote their config.json before training
        config = read_medusa_config(checkpoint.parent)
    weights = checkpoint / "model.safetensors"
    if config is None or not weights.is_file():
        raise UserError(f"{checkpoint} is not a checkpoint of train_medusa.py (needs {weights.name} and the run's "
                        f"{RUN_CONFIG} in {checkpoint.parent})")
    state = {k[len(PREFIX):]: v for k, v in load_file(str(weights)).items() if k.startswith(PREFIX)}
    heads = heads_from_state(config, state, config.hidden_size, config.vocab_size, str(weights))
    save_heads(heads.float(), out)
    return json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]


def main(argv=None) -> int:
    args = parse_args(argv)

    def body():
        check_output_dir(args.out)
        step = export_checkpoint(Path(args.checkpoint), Path(args.out))
        print(f"heads of training step {step} saved to {args.out}", file=sys.stderr)

    return run_command(body, "interrupted")


if __name__ == "__main__":
    sys.exit(main())
