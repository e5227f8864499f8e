"""Plain decoding with a base model: the baseline that Medusa must match token for token.

    python inference/generate.py --prompt "What is Medusa decoding?" --stream
    python inference/generate.py --base_model /path/to/openPangu-Embedded-7B --device npu --interactive
"""

import sys

import torch

from inference.cli import Session, base_parser, run_cli
from inference.engine.plain_decoding import PlainDecoder
from inference.runtime.calibration import graph_profile, step_profile
from inference.runtime.devices import AUTO, dtype_name
from inference.runtime.console import to_stderr
from inference.runtime.home import use_compile_cache
from inference.runtime.loading import load_base
from inference.runtime.runtime_choice import fastest_plain_dtype


def make_session(args, device: torch.device, dtype: torch.dtype | str | None) -> Session:
    model, tokenizer = load_base(args.base_model, device, None if dtype == AUTO else dtype)
    fastest, dtypes = model.dtype, [model.dtype]
    if dtype == AUTO:
        profile = step_profile(model, None)
        fastest, dtypes = fastest_plain_dtype(profile), list(profile.plain_ms)
    if args.compile != "off":
        use_compile_cache()
    captured = args.compile == "on"
    if args.compile == "auto" or (captured and len(dtypes) > 1):  # captured steps can order the dtypes otherwise
        graph = graph_profile(model, None, None, dtypes)
        if captured:
            graph = graph.captured_only()
        fastest, captured, _ = graph.fastest(graph.plain_ms)
    if dtype == AUTO:
        model = model.to(fastest)
        print(f"Runtime: plain decoding in {dtype_name(fastest)}, the fastest here", file=sys.stderr)
    print(f"Graph mode: {'captured' if captured else 'eager'} steps", file=sys.stderr)
    decoder = PlainDecoder(model, captured, log=to_stderr)
    return Session(model, tokenizer, decoder.decode, args)


def main(argv: list[str] | None = None) -> int:
    return run_cli(base_parser(__doc__.splitlines()[0]), make_session, argv)


if __name__ == "__main__":
    sys.exit(main())
