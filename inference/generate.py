"""Plain decoding with a base model: the baseline that Medusa must match token for token.

    python inference/generate.py --prompt "What is Medusa decoding?" --stream
    python inference/generate.py --base_model /path/to/openPangu-Embedded-7B --device npu --interactive
"""

import sys

from inference.calibration import step_profile
from inference.cli import Session, base_parser, run_cli
from inference.devices import DTYPES
from inference.loading import load_base
from inference.plain_decoding import plain_decode
from inference.runtime_choice import fastest_plain_dtype


def make_session(args, device, dtype) -> Session:
    model, tokenizer, _ = load_base(args.base_model, device, dtype)
    if dtype is None:
        fastest = fastest_plain_dtype(step_profile(model, None))
        model = model.to(DTYPES[fastest])
        print(f"Runtime: plain decoding in {fastest}, the fastest here", file=sys.stderr)
    return Session(model, tokenizer, lambda request, stats: plain_decode(model, request, stats), args)


def main(argv: list[str] | None = None) -> int:
    return run_cli(base_parser(__doc__.splitlines()[0]), make_session, argv)


if __name__ == "__main__":
    sys.exit(main())
