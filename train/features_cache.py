"""The base features a feature drafter trains on, kept on disk between runs: a directory of shard files.

Each sample's features are kept by its token ids and where its answer starts, so a later run reads the ones it
has and the base model runs only over new samples. New samples go into new shards and no shard is rewritten: a
growing cache costs only its new samples' writes and no room beyond its own size, and an interrupted run keeps
every shard it finished. A shard names what its features depend on besides the samples (the base model, its
dtype, the length cap and the fused layers); a run reads the shards that match and leaves the others alone.
Shards are mapped, not read: a cache may outgrow memory.
"""

import hashlib
import json
import shutil
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from inference.runtime.errors import UserError, first_line
from inference.runtime.outputs import replace_atomic
from train.feature_drafter_training import FeatureSample, base_features, feature_samples

SHARD_SAMPLES = 2000  # samples per shard: a few minutes of the demo model's features, 0.4 GB (1.2 GB with two fused layers)


def sample_key(sample: FeatureSample) -> str:
    """What a sample's features depend on besides the base model: its token ids and where its answer starts."""
    return hashlib.sha1(sample.ids.to(torch.int64).numpy().tobytes() + str(sample.answer_start).encode()).hexdigest()


def cached_features(cache: Path | None, model, samples: list[dict], max_length: int, progress,
                    fused: tuple[int, ...]) -> list[FeatureSample]:
    """`base_features` of `samples` (with the inputs of the `fused` layers), read from the shards of `cache` that
    hold them and computed for the rest, which are written there as new shards. A drafter that fuses nothing reads
    a fused drafter's shards too (they hold the final features), and its new shards fuse the same layers, so a
    fused drafter can read them later."""
    source = {"base_model": str(model.config._name_or_path), "dtype": str(model.dtype), "max_length": max_length}
    known, layers = read_shards(cache, source, list(fused)) if cache is not None else ({}, list(fused))
    keys = [sample_key(sample) for sample in feature_samples(samples, max_length)]
    missing = [i for i, key in enumerate(keys) if key not in known]
    progress.update(len(samples) - len(missing))
    for start in range(0, len(missing), SHARD_SAMPLES):
        chunk = missing[start : start + SHARD_SAMPLES]
        computed = base_features(model, [samples[i] for i in chunk], max_length, progress, tuple(layers))
        new = dict(zip((keys[i] for i in chunk), computed))
        if cache is not None:  # from here on mapped from the shard, not held in memory
            new = write_shard(cache, {**source, "aux_layers": layers} if layers else source, new)
        known.update(new)
    if not fused:  # a fused shard's layer inputs (twice the final features at two layers) are not kept
        return [replace(known[key], aux=None) for key in keys]
    return [known[key] for key in keys]


def check_cache(cache: Path) -> None:
    """A cache path that is a file (not a directory) fails in one line that says how to keep what it holds."""
    if cache.exists() and not cache.is_dir():
        raise UserError(f"--features_cache {cache} is a file: give a directory, which keeps one file per "
                        f"{SHARD_SAMPLES} samples (a cache file of an earlier version is one of them: mkdir DIR && "
                        f"mv {cache} DIR/)")


def read_shards(cache: Path, source: dict, layers: list[int]) -> tuple[dict[str, FeatureSample], list[int]]:
    """The features in the shards of `cache` made from `source` with the fused `layers` (with any layers where
    `layers` is empty), and the layers new shards fuse: `layers`, or the layers most of the features read fuse."""
    known, fused_by = {}, Counter()
    other, unreadable = 0, []
    for shard in sorted(cache.glob("*.pt")):
        try:
            held = torch.load(shard, weights_only=False, mmap=True)
        except Exception as error:  # torch raises several kinds for a file that is not a shard
            unreadable.append(f"{shard.name} ({type(error).__name__})")
            continue
        kept = dict(held.get("source", {}))
        kept_layers = kept.pop("aux_layers", [])
        if kept != source or (layers and kept_layers != layers):
            other += 1
            continue
        known.update(held["features"])
        fused_by[tuple(kept_layers)] += len(held["features"])
    if other:
        print(f"features cache {cache}: {other} shard(s) of another base model, dtype, --max_length or fused "
              "layers left as they are", file=sys.stderr)
    if unreadable:
        print(f"features cache {cache}: unreadable, left out: {', '.join(unreadable)}", file=sys.stderr)
    return known, layers or list(max(fused_by, key=fused_by.get, default=()))


def write_shard(cache: Path, source: dict, features: dict[str, FeatureSample]) -> dict[str, FeatureSample]:
    """`features` written to a new shard of `cache`, named by what it holds (its samples and `source`, so that a shard
    of the same samples made otherwise never replaces it), and mapped back from it."""
    named = json.dumps(source, sort_keys=True) + "".join(sorted(features))
    shard = cache / f"features-{hashlib.sha1(named.encode()).hexdigest()[:16]}.pt"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        replace_atomic(shard, lambda staging: torch.save({"source": source, "features": features}, staging))
    except (OSError, RuntimeError) as error:  # torch.save reports a full disk as a RuntimeError
        free = shutil.disk_usage(next(p for p in (cache, *cache.parents) if p.exists())).free / 1e9
        raise UserError(f"--features_cache {cache}: could not write a shard ({first_line(error)}); {free:.1f} GB free "
                        "on its disk; the shards written before are kept, and a rerun computes only the rest") from None
    return torch.load(shard, weights_only=False, mmap=True)["features"]
