"""Train Medusa heads on a frozen base model with the HF Trainer (accelerate / DeepSpeed ready).

    python train/train_medusa.py --data data/distill.jsonl --out train/demo_heads --num_heads 4 \\
        --cache_hidden --epochs 2 --threads 2

Loss = sum over heads of weight_i * CE(head i at t, token t+2+i), prompt tokens masked. With
--cache_hidden the frozen base model runs once per sample and training touches only the heads (the
fast path on CPU); without it the base runs in every step on padded batches (GPU/NPU, multi-device).
Per-head top-1/top-5 accuracy is logged; the heads are saved as safetensors + config.json that
inference/medusa_generate.py --medusa_dir loads directly.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from inference.runtime.arguments import (ArgumentParser, add_model_args, fraction, non_negative_float,
                                         non_negative_int, positive_float, positive_int)
from inference.runtime.demo_model import DEMO_NAME
from inference.runtime.devices import resolve_device
from inference.runtime.errors import UserError, run_command
from inference.runtime.loading import load_base_from_args
from inference.runtime.medusa_heads import LAYOUTS, MEDUSA_HEAD_INPUTS, MedusaConfig, MedusaHeads, save_heads, write_heads_config
from inference.runtime.outputs import check_output_dir, write_atomic
from medusa_choices import load_tree
from train.medusa_training import (RUN_CONFIG, CachedPositions, MedusaTrainingModule, SequenceDataset,
                                   cached_answer_hidden_states, draft_vocabulary, pad_sequences, position_rows,
                                   read_samples, split_held_out)


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, dtype_default="checkpoint", auto=False)  # the base's dtype; heads train in fp32
    parser.add_argument("--data", required=True, nargs="+", help="JSONL file(s) from train/gen_distill_data.py")
    parser.add_argument("--out", required=True, help="directory for the heads (and Trainer checkpoints); heads already "
                        "there are replaced only when training ends")
    parser.add_argument("--num_heads", type=positive_int, default=4)
    parser.add_argument("--num_layers", type=non_negative_int, default=1, help="ResBlocks per head")
    parser.add_argument("--layout", choices=LAYOUTS, default="shared_lm_head")
    parser.add_argument("--head_input", choices=MEDUSA_HEAD_INPUTS, default="hidden",
                        help="hidden_and_next_token: heads also read the embedding of token t+1 (the tree's root); "
                        "hidden_and_path: head i reads tokens t+1 .. t+1+i (sequentially dependent, Hydra-style)")
    parser.add_argument("--soft_targets", action="store_true",
                        help="learn the base model's whole distribution for each target (its logits), not only its token")
    parser.add_argument("--draft_vocab_size", type=positive_int,
                        help="train and propose over the K most frequent answer tokens only (a draft vocabulary): "
                        "K/V of the vocabulary projection's cost, in training and at inference")
    parser.add_argument("--head_decay", type=non_negative_float, default=0.8, help="loss weight of head i is decay**i")
    parser.add_argument("--epochs", type=positive_float, default=2.0)
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument("--batch_size", type=positive_int, default=256, help="positions (cached) or sequences per device")
    parser.add_argument("--grad_accum", type=positive_int, default=1)
    parser.add_argument("--max_length", type=positive_int, default=2048)
    parser.add_argument("--eval_fraction", type=fraction, default=0.05, help="held-out samples for accuracy, in [0, 1)")
    parser.add_argument("--cache_hidden", action="store_true",
                        help="run the frozen base once and train on its hidden states (kept beside each data file as "
                        "<data>.hidden.pt and reused while the file and base model are unchanged)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    parser.add_argument("--deepspeed", help="DeepSpeed config (e.g. train/deepspeed.json)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tree", help="tree to record in the heads' config (name or JSON file from the tree builder)")
    return parser.parse_args(argv)


def process_device(name: str, local_rank: str | None) -> str:
    """Under torchrun every process trains on its own accelerator: `npu`, `cuda` or `auto` get index LOCAL_RANK
    (otherwise every rank would load the base model onto device 0)."""
    if local_rank is None or name == "cpu" or ":" in name:
        return name
    kind = name if name in ("npu", "cuda") else resolve_device(name).type
    return name if kind == "cpu" else f"{kind}:{local_rank}"


def draft_tokens(args, train_samples: list[dict], vocab_size: int) -> list[int] | None:
    """The tokens heads trained with --draft_vocab_size propose from: the most frequent in the training answers."""
    if args.draft_vocab_size is None:
        return None
    if args.layout != "shared_lm_head":
        raise UserError("--draft_vocab_size needs shared_lm_head heads")
    return draft_vocabulary(train_samples, args.draft_vocab_size, vocab_size)


def build_trainer_class():
    from transformers import Trainer

    class MedusaTrainer(Trainer):
        """Adds per-head top-1/top-5 accuracy of the training batches to every log line."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            module = getattr(model, "module", model)
            self._accuracy = getattr(self, "_accuracy", [])
            self._accuracy.append(module.last_accuracy)
            return (outputs["loss"], outputs) if return_outputs else outputs["loss"]

        def log(self, logs, *args, **kwargs):
            batches = getattr(self, "_accuracy", [])
            if batches:
                for i in range(len(batches[0])):
                    count = sum(b[i][2] for b in batches)
                    if count:
                        logs[f"head{i}_top1"] = round(sum(b[i][0] for b in batches) / count, 4)
                        logs[f"head{i}_top5"] = round(sum(b[i][1] for b in batches) / count, 4)
                self._accuracy = []
            super().log(logs, *args, **kwargs)

    return MedusaTrainer


@torch.no_grad()
def evaluate_accuracy(module: MedusaTrainingModule, dataset, batch_size: int) -> list[dict]:
    """Per-head top-1/top-5 accuracy on held-out positions or sequences."""
    totals = None
    for start in range(0, len(dataset), batch_size):
        items = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        if "hidden_states" in items[0]:
            batch = {key: torch.stack([x[key] for x in items]) for key in items[0]}
        else:
            batch = pad_sequences(items, 0)
        device = next(module.heads.parameters()).device
        module(**{k: v.to(device) for k, v in batch.items()})
        acc = module.last_accuracy
        totals = acc if totals is None else [tuple(a + b for a, b in zip(t, x)) for t, x in zip(totals, acc)]
    return [{"head": i, "top1": round(t[0] / t[2], 4) if t[2] else 0.0, "top5": round(t[1] / t[2], 4) if t[2] else 0.0,
             "positions": t[2]} for i, t in enumerate(totals or [])]


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm
    from transformers import TrainingArguments

    started = time.time()

    def body():
        check_output_dir(args.out)
        torch.manual_seed(args.seed)
        args.device = process_device(args.device, os.environ.get("LOCAL_RANK"))
        model, tokenizer = load_base_from_args(args)
        device = model.device
        files = [(Path(path), read_samples(path)) for path in args.data]
        if args.cache_hidden:
            progress = tqdm(total=sum(len(s) for _, s in files), desc="caching hidden states", unit="sample")
            for path, file_samples in files:
                rows = cached_answer_hidden_states(model, path, file_samples, args.max_length, progress)
                for sample, hidden_rows in zip(file_samples, rows):
                    sample["answer_hidden"] = hidden_rows
            progress.close()
        samples = [sample for _, file_samples in files for sample in file_samples]
        train_samples, eval_samples = split_held_out(samples, args.eval_fraction, args.seed)
        hidden, vocab = model.config.hidden_size, model.config.vocab_size
        # stored resolved, so the heads do not depend on the working directory or a name's meaning
        tree = load_tree(args.tree, args.num_heads) if args.tree else None
        draft_ids = draft_tokens(args, train_samples, vocab)
        config = MedusaConfig(args.num_heads, args.num_layers, args.layout, hidden, vocab,
                              args.base_model or DEMO_NAME, tree, args.head_input,
                              len(draft_ids) if draft_ids else None)
        heads = MedusaHeads(config, hidden, vocab).to(device)
        heads.init_from_lm_head(model.lm_head)
        if draft_ids:
            heads.draft_vocab.copy_(torch.tensor(draft_ids))
        # beside the checkpoints, so those of a run stopped early can be exported (train/export_checkpoint.py)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_heads_config(config, Path(args.out) / RUN_CONFIG)
        weights = [args.head_decay**i for i in range(args.num_heads)]
        if args.cache_hidden:
            train_set, eval_set = (
                CachedPositions(*position_rows(part, [s["answer_hidden"] for s in part], args.num_heads, args.max_length),
                                soft_targets=args.soft_targets)
                for part in (train_samples, eval_samples))
            module = MedusaTrainingModule(heads, model.lm_head, model.get_input_embeddings(), None, weights,
                                          args.soft_targets)
            collator = None
        else:
            train_set = SequenceDataset(train_samples, args.num_heads, args.max_length)
            eval_set = SequenceDataset(eval_samples, args.num_heads, args.max_length)
            module = MedusaTrainingModule(heads, model.lm_head, model.get_input_embeddings(), model, weights,
                                          args.soft_targets)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            collator = lambda batch: pad_sequences(batch, pad)  # noqa: E731
        print(f"{len(train_samples)} training / {len(eval_samples)} held-out samples, "
              f"{len(train_set)} training items", file=sys.stderr)
        bf16 = device.type != "cpu" or torch.backends.mkldnn.is_available()
        training_args = TrainingArguments(
            output_dir=args.out, num_train_epochs=args.epochs, learning_rate=args.lr,
            per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
            lr_scheduler_type="cosine", warmup_steps=0.03, weight_decay=0.0, logging_steps=20,
            save_strategy="steps", save_steps=500, save_total_limit=2, report_to=[], bf16=bf16,
            dataloader_num_workers=0, remove_unused_columns=False, seed=args.seed, deepspeed=args.deepspeed,
            use_cpu=device.type == "cpu",
        )
        if not args.cache_hidden:
            model.to(training_args.device)  # the frozen base follows the device the Trainer puts the heads on
        trainer = build_trainer_class()(model=module, args=training_args, train_dataset=train_set, data_collator=collator)
        resume = args.resume and any(Path(args.out).glob("checkpoint-*"))
        trainer.train(resume_from_checkpoint=True if resume else None)
        heads.eval()
        accuracy = evaluate_accuracy(module, eval_set, args.batch_size) if len(eval_set) else []
        save_heads(heads.float().cpu(), args.out)
        report = {
            "data": args.data, "samples": len(samples), "train_samples": len(train_samples),
            "held_out_samples": len(eval_samples), "train_items": len(train_set), "epochs": args.epochs,
            "steps": trainer.state.global_step, "seconds": round(time.time() - started, 1),
            "held_out_accuracy": accuracy, "args": {k: v for k, v in vars(args).items()},
        }
        write_atomic(Path(args.out) / "training_report.json", json.dumps(report, indent=2) + "\n")
        for row in accuracy:
            print(f"head {row['head']}: held-out top-1 {row['top1']:.3f}, top-5 {row['top5']:.3f}", file=sys.stderr)
        print(f"heads saved to {args.out}", file=sys.stderr)

    return run_command(body, f"interrupted: rerun with --resume to continue from the last checkpoint in {args.out}")


if __name__ == "__main__":
    sys.exit(main())
