"""Command-line parsing shared by every entry point: bad arguments are one `error:` line, not a usage block.

The value types below refuse what would otherwise run wrongly without a word (a NaN temperature samples
token 0 forever, `--num_prompts 0` ran every prompt, `--batch_size 0` nothing), so each command can say
what it takes.
"""

import argparse
import math
import os
import sys

from inference.runtime.errors import UserError


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, unless the help says it already or there is none to show (None, False:
    unset, off), so `--help` never reads "(default: torch's choice) (default: None)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or "default:" in text.lower():
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with `formatter_class` defaulting to showing defaults and errors as one line (exit status 2)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _number(kind, text: str, check, requirement: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not check(value):
        raise argparse.ArgumentTypeError(f"{text} is not {requirement}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 0, "an integer >= 0")


def non_negative_float(text: str) -> float:
    return _number(float, text, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")


def positive_float(text: str) -> float:
    return _number(float, text, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")


def probability(text: str) -> float:
    """A number in (0, 1], such as top_p."""
    return _number(float, text, lambda v: 0 < v <= 1, "in (0, 1]")


def fraction(text: str) -> float:
    """A number in [0, 1)."""
    return _number(float, text, lambda v: 0 <= v < 1, "in [0, 1)")


COMPILE_MODES = ("auto", "on", "off")
COMPILE_ENV = "OPENPANGU_MEDUSA_COMPILE"


def default_compile_mode() -> str:
    """--compile's default: $OPENPANGU_MEDUSA_COMPILE (auto | on | off), else auto (the test suite sets off, so
    only the tests of graph mode pay for compiling)."""
    mode = os.environ.get(COMPILE_ENV, "auto")
    if mode not in COMPILE_MODES:
        raise UserError(f"{COMPILE_ENV}={mode!r}: use one of {', '.join(COMPILE_MODES)}")
    return mode

DEMO_DEFAULT = "the embedded demo model, SmolLM2-135M-Instruct, prepared on first use"


def add_model_args(parser: argparse.ArgumentParser, dtype_default: str = "auto", auto: bool = True,
                   base_model_default: str = DEMO_DEFAULT) -> None:
    """--base_model, --device, --dtype and --threads, as every command line takes them. `auto` False: the
    command has no calibrated choice to make (training), so --dtype auto is not offered."""
    group = parser.add_argument_group("model and hardware")
    group.add_argument("--base_model", help=f"model directory or Hub repo id (default: {base_model_default})")
    group.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] | npu[:N]; auto prefers npu, then cuda")
    choices = ("auto", "checkpoint", "bf16", "fp16", "fp32") if auto else ("checkpoint", "bf16", "fp16", "fp32")
    group.add_argument("--dtype", default=dtype_default, choices=choices,
                       help="checkpoint: the dtype its weights are stored in"
                       + ("; auto: the fastest here, from a one-time calibration of this machine (cached in "
                          "$OPENPANGU_MEDUSA_HOME/calibration)" if auto else ""))
    group.add_argument("--threads", type=positive_int, help="CPU threads for torch (default: torch's choice)")
    if auto:
        group.add_argument("--compile", default=default_compile_mode(), choices=COMPILE_MODES,
                           help="run each decoding step as one captured graph (inductor on CPUs, CUDA graphs, "
                           "torchair on Ascend): auto (whichever a one-time timing of eager against captured "
                           "steps found faster here, timed once per machine), on (always; a dtype or tree not given "
                           "is chosen from the same timing's captured steps), or off; compiling costs ~40 s per step "
                           "shape and process on 2 CPU cores, so use off for a single short prompt. "
                           f"Default: ${COMPILE_ENV}, else auto")
