"""Everything the plain and Medusa command lines share: arguments, prompt modes, output, errors."""

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from inference.engine.decoding import DecodeRequest, DecodeStats, eos_ids
from inference.engine.sampling import Sampling
from inference.runtime.arguments import ArgumentParser, add_model_args, non_negative_float, positive_int, probability
from inference.runtime.chat import IncrementalText, display_text, prompt_ids, read_prompts, stream_filter
from inference.runtime.console import end_line, stream_text, to_stderr
from inference.runtime.devices import parse_dtype, resolve_device, set_threads
from inference.runtime.errors import run_command
from inference.runtime.loading import is_pangu

Decode = Callable[[DecodeRequest, DecodeStats], Iterator[list[int]]]


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = ArgumentParser(description=description)
    add_model_args(parser)
    prompts = parser.add_argument_group("prompts (one of)")
    mode = prompts.add_mutually_exclusive_group()
    mode.add_argument("--prompt", help="one user message")
    mode.add_argument("--prompts", metavar="FILE.jsonl",
                      help="one JSON object per line with 'prompt', or MT-Bench style 'turns'; one result per line")
    mode.add_argument("--interactive", action="store_true", help="multi-turn chat; /clear resets, /exit or Ctrl-D quits")
    prompts.add_argument("--system", help="system message")
    prompts.add_argument("--no_think", action="store_true", help="OpenPangu: answer without a thinking section")
    gen = parser.add_argument_group("generation")
    gen.add_argument("--max_new_tokens", type=positive_int, default=256)
    gen.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy; > 0 samples")
    gen.add_argument("--top_p", type=probability, default=1.0, help="nucleus sampling mass when sampling, in (0, 1]")
    gen.add_argument("--seed", type=int, help="random seed when sampling")
    out = parser.add_argument_group("output")
    out.add_argument("--stream", action="store_true", help="print text as it is generated")
    out.add_argument("--json", action="store_true",
                     help="one JSON object per prompt: text, token_ids, new_tokens, seconds, tokens_per_second, ...")
    return parser


@dataclass
class Session:
    model: object
    tokenizer: object
    decode: Decode
    args: argparse.Namespace
    extra_fields: Callable[[DecodeStats], dict] = lambda stats: {}

    @property
    def pangu(self) -> bool:
        return is_pangu(self.model)

    def eos_ids(self) -> tuple[int, ...]:
        return eos_ids(self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id)

    def reply(self, messages: list[dict], stream: bool) -> dict:
        """Run one reply; print it as it streams when asked; return the JSON record."""
        args = self.args
        ids = prompt_ids(self.tokenizer, messages, no_think=args.no_think)
        request = DecodeRequest(ids, args.max_new_tokens, self.eos_ids(), Sampling(args.temperature, args.top_p), args.seed)
        stats = DecodeStats()
        text = IncrementalText(self.tokenizer, skip_special_tokens=not self.pangu)
        new_ids: list[int] = []
        held = None  # the prefill's token, shown with the first step's: that step may compile and say so first
        interrupted = False
        try:
            for step in self.decode(request, stats):
                new_ids.extend(step)
                if stream:
                    shown = stream_filter(text.push(step), self.pangu)
                    if held is None:
                        held = shown
                        continue
                    stream_text(held + shown)
                    held = ""
        except KeyboardInterrupt:
            if not stream:
                raise
            interrupted = True
        stream_text(held or "")
        if interrupted:
            to_stderr("[interrupted]")
        end_line()
        thinking, answer = display_text(self.tokenizer, new_ids, self.pangu)
        record = {"text": answer, "token_ids": new_ids, **stats.to_dict(), **self.extra_fields(stats)}
        if thinking is not None:
            record["thinking"] = thinking
        return record


def _print_record(record: dict, session: Session, streamed: bool) -> None:
    if session.args.json:
        print(json.dumps(record, ensure_ascii=False), flush=True)
        return
    if not streamed:
        if record.get("thinking"):
            print(f"<think>\n{record['thinking']}\n</think>")
        print(record["text"], flush=True)
    line = f"[{record['new_tokens']} tokens in {record['seconds']:.2f} s"
    if record.get("compile_seconds"):
        line += f" ({record['compile_seconds']:.1f} s of it compiling, left out of the rate)"
    line += f", {record['tokens_per_second']:.1f} tok/s"
    if "tree_tokens" in record:
        line += f", {record['tokens_per_step']:.2f} tokens/step"
    print(line + "]", file=sys.stderr)


def _messages(system: str | None) -> list[dict]:
    return [{"role": "system", "content": system}] if system else []


def run_prompts(session: Session, items: list[dict]) -> None:
    """Each item's turns are asked in order, each answer joining the history (MT-Bench style)."""
    for item in items:
        messages = _messages(session.args.system)
        results = []
        for turn in item["turns"]:
            messages.append({"role": "user", "content": turn})
            record = session.reply(messages, stream=session.args.stream and not session.args.json)
            messages.append({"role": "assistant", "content": record["text"]})
            results.append(record)
        if session.args.json:
            meta = {k: v for k, v in item.items() if k != "turns"}
            print(json.dumps({**meta, **(results[0] if len(results) == 1 else {"turns": results})}, ensure_ascii=False))
        else:
            for record in results:
                _print_record(record, session, streamed=session.args.stream)


def run_interactive(session: Session) -> None:
    print("Chat with the model. /clear starts over, /exit (or Ctrl-D) quits.", file=sys.stderr)
    messages = _messages(session.args.system)
    while True:
        try:
            user = input("\nYou: ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if not user:
            continue
        if user in ("/exit", "/quit"):
            return
        if user == "/clear":
            messages = _messages(session.args.system)
            print("(history cleared)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": user})
        stream_text("Assistant: ")
        record = session.reply(messages, stream=True)
        messages.append({"role": "assistant", "content": record["text"]})
        _print_record(record, session, streamed=True)


def run_cli(parser: argparse.ArgumentParser, make_session: Callable[[argparse.Namespace, torch.device, object], Session],
            argv: list[str] | None = None) -> int:
    """Parse, load, run; bad input is one line on stderr and exit status 2, never a traceback."""
    args = parser.parse_args(argv)
    if args.prompt is not None and not args.prompt.strip():
        parser.error("--prompt is empty")

    def body():
        set_threads(args.threads)
        device = resolve_device(args.device)
        session = make_session(args, device, parse_dtype(args.dtype))
        if args.interactive:
            run_interactive(session)
        elif args.prompts:
            run_prompts(session, read_prompts(args.prompts))
        else:
            prompt = args.prompt or "Explain speculative decoding in two sentences."
            run_prompts(session, [{"turns": [prompt]}])

    return run_command(body)
