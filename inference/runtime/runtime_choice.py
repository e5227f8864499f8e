"""Choosing the dtype and tree for the hardware at hand, from its measured step costs.

Medusa's gain is (expected tokens per step) / (step time) against 1 / (plain token time). The expected
tokens of a tree come from the heads' per-head, per-rank accuracy measured on held-out data by
train/medusa_tree_builder.py and saved with the heads; the times come from the machine's calibration
profile. Plain decoding runs in its own fastest dtype; when no (dtype, tree) is expected to beat it,
Medusa falls back to plain decoding, never a silent slowdown.
"""

from dataclasses import dataclass, replace

import torch

from inference.engine.step_schedule import StepOption
from inference.runtime.calibration import GraphProfile, StepProfile
from inference.runtime.devices import dtype_name
from medusa_choices import DynamicTree, Tree, best_tree, expected_accepted

# A tree must be expected to beat plain decoding by this much before it is used. The estimate takes heads to
# be right independently and times steps at a fixed context: for the demo heads on MT-Bench prompts it
# overstated the measured speed-up by 5% on a CPU with native bf16 (1.61x expected, 1.54x measured) and by
# 17% with bf16 limited to AVX2 kernels (1.19x expected, 1.02x measured).
MIN_EXPECTED_SPEEDUP = 1.2


@dataclass(frozen=True)
class RuntimeChoice:
    dtype: torch.dtype  # Medusa's dtype, or plain decoding's when falling back
    tree: Tree | DynamicTree | None  # None: plain decoding is expected to be faster here, so it is used instead
    plain_dtype: torch.dtype  # plain decoding's fastest dtype (or the forced one)
    reason: str
    expected_tokens_per_step: float | None = None
    expected_speedup: float | None = None
    compiled: bool = False  # Medusa's step (or the fallback's plain step) runs captured as one graph
    plain_compiled: bool = False  # plain decoding's step does
    options: tuple[StepOption, ...] = ()  # what each step may run instead (the tree first); () : the tree only
    options_timed: bool = False  # their costs come from real steps or a timing of these very steps
    tree_given: bool = False  # the caller fixed the tree: corrections re-decide its competitors, not it
    profile: StepProfile | None = None  # the profile real steps correct (None: none is corrected)

    @classmethod
    def as_given(cls, dtype: torch.dtype, tree: Tree | DynamicTree) -> "RuntimeChoice":
        """The dtype and tree a caller fixed: nothing was chosen or estimated."""
        return cls(dtype, tree, dtype, f"{dtype_name(dtype)}, {len(tree) + 1}-token tree, as given")

    @property
    def graph_mode(self) -> str:
        """How the steps run, for headers and JSON: "captured", "eager", or "Medusa captured, plain eager"."""
        if self.tree is None or self.compiled == self.plain_compiled:
            return "captured" if self.compiled else "eager"
        return f"Medusa {'captured' if self.compiled else 'eager'}, plain {'captured' if self.plain_compiled else 'eager'}"

    @property
    def tree_tokens(self) -> int:
        """Tokens verified per step (1: plain decoding)."""
        return len(self.tree) + 1 if self.tree else 1


def _cpu_note(profile: StepProfile, dtype: torch.dtype) -> str:
    if "no native bf16" in profile.hardware and dtype == torch.float32:
        return " (no native bf16 matmul on this CPU)"
    return ""


def dynamic_like(fixed: Tree) -> DynamicTree:
    """A dynamic tree of the fixed tree's size that drafts as many levels as the fixed one is deep: the best
    fixed tree for the heads' accuracy leaves out the levels whose nodes are too unlikely to
    earn a place, and drafting each costs a call of the heads (on the demo feature drafter at 12 nodes, the 42
    evaluation prompts accepted 2.77 tokens per step over 6 levels, 2.76 over 4)."""
    return DynamicTree(len(fixed), levels=max(map(len, fixed)))


def _tree_words(tree: Tree | DynamicTree) -> str:
    """"13-token dynamic tree (5 levels)", "7-token tree": a tree as the reasons name it."""
    if not isinstance(tree, DynamicTree):
        return f"{len(tree) + 1}-token tree"
    return f"{len(tree) + 1}-token dynamic tree" + (f" ({tree.levels} levels)" if tree.levels else "")


def fastest_plain_dtype(profile: StepProfile, dtypes: list[torch.dtype] | None = None) -> torch.dtype:
    return min(dtypes or profile.plain_ms, key=lambda d: profile.plain_ms[d])


def choose_runtime(profile: StepProfile, num_heads: int, accuracy: list[list[float]] | None,
                   dtype: torch.dtype | None = None, tree: Tree | DynamicTree | None = None,
                   dynamic: bool = False, min_speedup: float = MIN_EXPECTED_SPEEDUP) -> RuntimeChoice:
    """The fastest (dtype, tree) for this profile, or plain decoding when nothing is expected to beat it.

    `dtype` forces the dtype (plain decoding is then compared in the same dtype); `tree` fixes the tree.
    Without `accuracy` the gain cannot be estimated: the fixed tree is used in the dtype where its step
    is fastest. `dynamic`: the chosen size is verified as a `DynamicTree` (for heads that propose after
    verification anyway; the profile timed dynamic steps for them, and the best fixed tree's token estimate
    is a floor for a dynamic tree of the same size). A chosen tree expected below `min_speedup` gives way to plain
    decoding.
    """
    dtypes = [dtype] if dtype else sorted(profile.plain_ms, key=dtype_name)
    plain_dtype = fastest_plain_dtype(profile, dtypes)
    plain_ms = profile.plain_ms[plain_dtype]
    if accuracy is None:
        if tree is None:
            raise ValueError("without measured head accuracy a tree must be given")
        fastest = min(dtypes, key=lambda d: profile.tree_step_ms(d, len(tree) + 1))
        return RuntimeChoice(fastest, tree, plain_dtype,
                             f"{dtype_name(fastest)}: fastest {len(tree) + 1}-token step here{_cpu_note(profile, fastest)}; "
                             "the heads record no accuracy (train/medusa_tree_builder.py --save_in_heads), "
                             "so the gain over plain decoding is not estimated")
    accuracy = accuracy[:num_heads]
    if isinstance(tree, DynamicTree):  # chosen per step, so expected to do at least as well as the best fixed one
        trees = [(tree, best_tree(accuracy, tree.nodes)[1])]
    elif tree is not None:
        trees = [(tree, expected_accepted(tree, accuracy))]
    else:
        budgets = sorted({tokens - 1 for sizes in profile.step_ms.values() for tokens in sizes if tokens > 1})
        trees = [best_tree(accuracy, budget) for budget in budgets]
    candidates = [((1 + expected) / profile.tree_step_ms(d, len(nodes) + 1) * plain_ms, d, nodes, expected)
                  for d in dtypes for nodes, expected in trees]
    speedup, best_dtype, best_nodes, expected = max(candidates, key=lambda c: c[0])
    step_ms = profile.tree_step_ms(best_dtype, len(best_nodes) + 1)
    estimate = (f"{1 + expected:.2f} expected tokens per {step_ms:.0f} ms step vs {plain_ms:.0f} ms per plain "
                f"{dtype_name(plain_dtype)} token")
    if tree is None and speedup < min_speedup:
        return RuntimeChoice(plain_dtype, None, plain_dtype,
                             f"plain decoding in {dtype_name(plain_dtype)}: the best tree here ({len(best_nodes) + 1} "
                             f"tokens in {dtype_name(best_dtype)}) is expected at only {speedup:.2f}x ({estimate})",
                             1.0, 1.0)
    if dynamic and tree is None and (like := dynamic_like(best_nodes)).fits(num_heads):
        best_nodes, estimate = like, f"at least {estimate}"
    return RuntimeChoice(best_dtype, best_nodes, plain_dtype,
                         f"{dtype_name(best_dtype)}{_cpu_note(profile, best_dtype)}, {_tree_words(best_nodes)}: "
                         f"expected {speedup:.2f}x ({estimate})",
                         round(1 + expected, 4), round(speedup, 4))


def _graph_words(dtype: torch.dtype, captured: bool) -> str:
    return f"{dtype_name(dtype)} {'captured' if captured else 'eager'}"


def trees_of_sizes(profile: StepProfile, dtype: torch.dtype, accuracy: list[list[float]], num_heads: int,
                   sizes: list[int], like: DynamicTree | None = None, same_levels: bool = False) -> list[StepOption]:
    """A tree of each of `sizes` tokens at its `profile` cost: the best fixed tree of that size for `accuracy`, or
    with `like` a dynamic tree of `like`'s settings that drafts as many levels as that fixed tree is deep
    (`same_levels`: as many as `like`, so every size verifies the candidates `like` scored). Sizes where the heads
    score too few candidates for the dynamic tree are left out."""
    trees = []
    for tokens in sizes:
        nodes, expected = best_tree(accuracy, tokens - 1)
        if like is not None:
            nodes = replace(like, nodes=tokens - 1, levels=like.levels if same_levels else dynamic_like(nodes).levels)
            if not nodes.fits(num_heads):
                continue
        trees.append(StepOption(nodes, 1 + expected, profile.cost_ms(dtype, tokens)))
    return trees


def captured_alternatives(choice: RuntimeChoice, profile: StepProfile, accuracy: list[list[float]] | None,
                          num_heads: int) -> tuple[StepOption, ...]:
    """Trees two timed sizes below and above the chosen one (or the nearest there are), of its kind, to time
    captured against it: eager costs chose it, and they are noisy at single sizes (the demo heads in eager bf16 on
    a 2-core AMD EPYC: 4 tokens 24.9 ms, 5 tokens 28.3, 7 tokens 30.0) and carry a per-op cost that capturing
    removes."""
    if choice.tree is None or accuracy is None or choice.expected_tokens_per_step is None:
        return ()
    sizes = sorted(tokens for tokens in profile.step_ms[choice.dtype] if tokens > 1)
    below = [tokens for tokens in sizes if tokens < choice.tree_tokens][-2:][:1]
    above = [tokens for tokens in sizes if tokens > choice.tree_tokens][:2][-1:]
    like = choice.tree if isinstance(choice.tree, DynamicTree) else None
    return tuple(trees_of_sizes(profile, choice.dtype, accuracy[:num_heads], num_heads, below + above, like))


def with_graph_mode(choice: RuntimeChoice, graph: GraphProfile, may_fall_back: bool = True,
                    alternatives: tuple[StepOption, ...] = ()) -> RuntimeChoice:
    """`choice` with each side in the dtype and graph mode `graph` timed fastest, and (`may_fall_back`: the tree was
    chosen, not given) plain decoding instead of Medusa where the faster plain step leaves the tree expected below
    MIN_EXPECTED_SPEEDUP. The tree stays the one chosen from eager costs unless `graph` timed captured steps of
    `alternatives` (`captured_alternatives`) and one of them is expected to give more tokens per ms."""
    plain_dtype, plain_compiled, plain_ms = graph.fastest(graph.plain_ms)
    plain = f"{_graph_words(plain_dtype, plain_compiled)} plain {plain_ms:.1f} ms"
    if choice.tree is None or graph.step_ms is None:
        return replace(choice, dtype=plain_dtype, plain_dtype=plain_dtype, compiled=plain_compiled,
                       plain_compiled=plain_compiled, reason=f"{choice.reason}; fastest here: {plain}")
    dtype, compiled, step_ms = graph.fastest(graph.step_ms)
    chosen = replace(choice, dtype=dtype, plain_dtype=plain_dtype, compiled=compiled, plain_compiled=plain_compiled)
    if choice.expected_tokens_per_step is None:
        return replace(chosen, reason=f"{choice.reason}; {_graph_words(dtype, compiled)} {step_ms:.1f} ms step vs {plain}")
    timed = [option for option in (StepOption(choice.tree, choice.expected_tokens_per_step, step_ms), *alternatives)
             if option.tokens in graph.sizes_ms]
    sizes = ""
    if compiled and len(timed) > 1:
        best = max(timed, key=lambda option: option.expected_tokens / graph.sizes_ms[option.tokens])
        chosen = replace(chosen, tree=best.tree, expected_tokens_per_step=round(best.expected_tokens, 4))
        step_ms, plain_ms = graph.sizes_ms[best.tokens], graph.sizes_ms.get(1, plain_ms)
        plain = f"{_graph_words(plain_dtype, plain_compiled)} plain {plain_ms:.1f} ms"
        sizes = "; of the captured " + ", ".join(
            f"{option.tokens}-token step ({option.expected_tokens:.2f} tokens per {graph.sizes_ms[option.tokens]:.1f} ms)"
            for option in sorted(timed, key=lambda option: option.tokens)) + f", the {best.tokens}-token one gives most"
    mode = f"{_graph_words(dtype, compiled)} {step_ms:.1f} ms step vs {plain}"
    speedup = chosen.expected_tokens_per_step * plain_ms / step_ms
    if may_fall_back and speedup < MIN_EXPECTED_SPEEDUP:
        return replace(chosen, dtype=plain_dtype, tree=None, compiled=plain_compiled, expected_tokens_per_step=1.0,
                       expected_speedup=1.0, reason=f"plain decoding in {dtype_name(plain_dtype)}: the "
                       f"{chosen.tree_tokens}-token tree is expected at only {speedup:.2f}x ({mode}{sizes})")
    return replace(chosen, expected_speedup=round(speedup, 4),
                   reason=f"{dtype_name(dtype)}, {_tree_words(chosen.tree)}: expected {speedup:.2f}x "
                          f"({chosen.expected_tokens_per_step:.2f} tokens per {mode}{sizes})")


def _neighbours(ladder: list[StepOption], tokens: int) -> list[StepOption]:
    """The next smaller and the next larger size than `tokens` in `ladder`: each correction by real steps can move
    the choice one size further, also to sizes whose profile cost is wrong and that nothing else would run."""
    smaller = sorted((o for o in ladder if o.tokens < tokens), key=lambda o: o.tokens)[-1:]
    larger = sorted((o for o in ladder if o.tokens > tokens), key=lambda o: o.tokens)[:1]
    return smaller + larger


def with_step_options(choice: RuntimeChoice, profile: StepProfile, accuracy: list[list[float]] | None,
                      num_heads: int, tree_given: bool, graph: GraphProfile | None = None) -> RuntimeChoice:
    """`choice` with what its steps may run instead, checked against real steps while decoding: the plain step
    and (a chosen tree, eager) the next smaller and larger sizes of its kind. A captured tree competes with the
    captured plain step only, at the costs `graph` timed in the same rounds (each other size would be a compile;
    the eager profile is not corrected from captured steps). A fallback to plain decoding stays plain decoding:
    plain steps inside the Medusa decoder cost ~5% more than the plain decoder's (the schedule's bookkeeping),
    measured with bf16 limited to AVX2, where eager trees never pay."""
    if choice.tree is None or accuracy is None or choice.expected_tokens_per_step is None:
        return choice
    dtype, accuracy = choice.dtype, accuracy[:num_heads]
    if choice.compiled:
        if graph is None or graph.step_ms is None:
            return choice
        step_ms, plain_ms = graph.captured_costs(dtype, choice.tree_tokens)
        return replace(choice, options=(StepOption(choice.tree, choice.expected_tokens_per_step, step_ms),
                                        StepOption(None, 1.0, plain_ms)), options_timed=True)
    chosen = StepOption(choice.tree, choice.expected_tokens_per_step, profile.cost_ms(dtype, choice.tree_tokens))
    like = choice.tree if isinstance(choice.tree, DynamicTree) else None
    others = [] if tree_given else _neighbours(
        trees_of_sizes(profile, dtype, accuracy, num_heads, sorted(profile.step_ms[dtype]), like, same_levels=True),
        chosen.tokens)
    options = (chosen, *others, StepOption(None, 1.0, profile.plain_ms[dtype]))
    realised = profile.realised.get(dtype, [])
    return replace(choice, options=options, profile=profile, tree_given=tree_given,
                   options_timed=all(option.tokens in realised for option in options))


def redecided(choice: RuntimeChoice, profile: StepProfile, num_heads: int,
              accuracy: list[list[float]]) -> RuntimeChoice:
    """`choice` decided again, in its dtype, from `profile` (corrected by real steps), with its options; where plain
    decoding comes out ahead, its trees keep competing with the plain step as they do already."""
    tree = choice.tree if choice.tree_given else None
    again = choose_runtime(profile, num_heads, accuracy, choice.dtype, tree, dynamic=isinstance(choice.tree, DynamicTree))
    if again.tree is None:
        return replace(choice, profile=profile)
    return with_step_options(again, profile, accuracy, num_heads, choice.tree_given)
