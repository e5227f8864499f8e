"""Which step runs next: the runtime's choice checked against what each step really costs and accepts.

The runtime picks a tree from a calibration profile and the heads' measured accuracy, and either can be
wrong for this run: a profile taken while the machine was busy, a load that came later, a context that grew,
a request on which the heads accept more or less than on their evaluation set. The decoder times every step
at its one device-to-host transfer anyway, so an `AdaptiveSchedule` keeps the realised cost of each option (a
few tree sizes and the plain step) and the realised acceptance, and runs the option with the most tokens per ms:
- an option's cost is the median of its last steps where it has run, else its profile cost scaled as the run
  ones turned out;
- a tree step that follows a plain step (or starts a request) drafts its candidates from scratch, which a tree
  step otherwise did for it inside its own step: what that costs more is kept apart and charged to the switch,
  to the plain step that leaves a run of tree steps and to the tree step that ends a run of plain ones;
- a tree's tokens per step are expected from this step's own candidates (their probabilities, which the step
  before scored and brought back in its transfer, and the lookup chain's) where the decoder has them, else from
  the heads' measured accuracy, either scaled by how many of its expected tokens were accepted so far;
- every option runs a few steps once per process, unless the profile's costs already came from real steps,
  and again whenever the running option's cost stays off by more than FACTOR; what they cost is handed to
  `on_correction`, which writes it back to the profile (the next process starts from the truth) and may return
  the options re-decided from it, which the next request runs;
- while plain steps run, the best tree gets a step now and then (after RECHECK plain steps, then twice as
  many each time it does not pay), so a load that passes, or text that turns predictable, is noticed.
Every option is an exact step, so the output never depends on the schedule.
"""

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from inference.engine.decoding import DecodeStats
from medusa_choices import DynamicTree, Tree

WINDOW = 8  # steps of one option whose median is its realised cost
PROBES = 4  # steps each option runs when costs are checked
FACTOR = 1.5  # realised cost off the expected by more than this, for WINDOW steps: check every option again
RECHECK = 32  # plain steps before a tree step checks whether speculation pays again; doubled after each check
MAX_RECHECK = 1024  # that does not bring trees back, up to this (so where trees never pay they cost ~0.1%)
PRIOR = 8.0  # accepted tokens' worth of belief in the heads' expectation before realised acceptance counts
DECAY = 0.97  # per tree step, so acceptance follows the request
NOTICE_GAP = 256  # steps at least between two lines about switching: a near tie flips the lead every few steps
REGIME_WINDOW = 64  # the last steps the estimates chose, whose majority (plain or tree steps) the notices follow


@dataclass(frozen=True)
class StepOption:
    """A step the schedule may run: a tree (None: a plain step), the tokens it is expected to emit per step and
    what the profile says it costs."""

    tree: Tree | DynamicTree | None
    expected_tokens: float
    profile_ms: float

    @property
    def tokens(self) -> int:
        """Tokens verified per step (1: plain)."""
        return 1 if self.tree is None else len(self.tree) + 1


class FixedSchedule:
    """The same tree at every step: one the caller fixed, or no costs to choose by."""

    def __init__(self, tree: Tree | DynamicTree):
        self.options = (StepOption(tree, 1.0, 1.0),)

    def begin(self) -> tuple[StepOption, ...]:
        return self.options

    def next(self, stats: DecodeStats, expected: list[float | None] | None = None) -> int:
        return 0

    def observe(self, index: int, ms: float, tokens: int) -> None:
        """Nothing to learn: the tree is fixed."""


class AdaptiveSchedule:
    """Options[0] is the runtime's choice; the others (smaller and larger trees, the plain step) compete with it."""

    def __init__(self, options: list[StepOption], costs_realised: bool = False,
                 on_correction: Callable[[dict[int, float]], list[StepOption] | None] | None = None,
                 log: Callable[[str], None] | None = None):
        self.on_correction, self.log = on_correction, log
        # accepted and expected accepted tokens (decayed sums) of steps estimated from their own candidates (True)
        # and from the heads' accuracy (False): the two estimates are off by different factors
        self.acceptance_sums = {True: [0.0, 0.0], False: [0.0, 0.0]}
        self.estimate: tuple[float, bool] = (1.0, False)  # what the running step was expected to emit, and how
        self.resuming = True  # the next tree step drafts from scratch (a request's first, or one after a plain step)
        self.step_resumes = False  # whether the running step drafts from scratch
        self.pending: list[StepOption] | None = None
        self._install(options, {})
        if costs_realised:
            self.probes.clear()

    def _install(self, options: list[StepOption], costs: dict[int, float]) -> None:
        """Run `options` from now on; those whose size has a cost timed in real steps (`costs`) start from it,
        the others are probed."""
        if not any(option.tree is None for option in options):
            raise ValueError("an adaptive schedule needs the plain step among its options")
        self.options = tuple(options)
        self.basis = [costs.get(o.tokens, o.profile_ms) for o in options]  # the costs decisions are checked against
        self.recent = [deque([costs[o.tokens]] if o.tokens in costs else [], maxlen=WINDOW) for o in options]
        self.resumed = [deque(maxlen=WINDOW) for _ in options]  # costs of tree steps that drafted from scratch
        self.probes = self._probe_order(known=costs)
        self.decided: int | None = None
        self.plain_run, self.recheck_every = 0, RECHECK
        self.plain_regime = options[0].tree is None  # whether plain steps lead on average (said when it changes)
        self.chosen_plain: deque[bool] = deque(maxlen=REGIME_WINDOW)  # whether each of the last chosen steps was plain
        self.since_notice = NOTICE_GAP  # steps since the last line about it

    def _probe_order(self, known: dict[int, float] | None = None) -> deque[int]:
        """PROBES steps of every option, in order, but those whose size has a cost `known` from real steps."""
        return deque(i for i, o in enumerate(self.options) if o.tokens not in (known or {}) for _ in range(PROBES))

    def begin(self) -> tuple[StepOption, ...]:
        """The options of a request about to start: those a correction re-decided, from the first request after it
        (a request keeps the options it started with, so its cache fits every step)."""
        if self.pending is not None:
            costs = {o.tokens: statistics.median(r) for o, r in zip(self.options, self.recent) if r}
            self._install(self.pending, costs)
            self.pending = None
        self.resuming = True
        return self.options

    def cost_ms(self, index: int) -> float:
        """Option `index`'s steady cost: its recent steps' median, else the scaled profile, at most what its steps
        that drafted from scratch cost."""
        if self.recent[index]:
            return statistics.median(self.recent[index])
        run = [i for i, recent in enumerate(self.recent) if recent]
        scale = statistics.median(statistics.median(self.recent[i]) / self.basis[i] for i in run) if run else 1.0
        scaled = self.basis[index] * scale
        return min(scaled, statistics.median(self.resumed[index])) if self.resumed[index] else scaled

    def resume_ms(self, index: int) -> float:
        """What a tree step of option `index` costs more when it drafts from scratch (0 until one has run)."""
        if not self.resumed[index]:
            return 0.0
        return max(0.0, statistics.median(self.resumed[index]) - self.cost_ms(index))

    def step_ms(self, index: int) -> float:
        """What running option `index` now costs: a tree step after plain steps with its drafting from scratch, a
        plain step after tree steps with the cheapest tree's, which the tree step that follows it will pay."""
        if self.options[index].tree is not None:
            return self.cost_ms(index) + (self.resume_ms(index) if self.resuming else 0.0)
        switch = 0.0 if self.resuming else min(self.resume_ms(i) for i, o in enumerate(self.options) if o.tree is not None)
        return self.cost_ms(index) + switch

    def acceptance(self, per_step: bool) -> float:
        """Realised over expected accepted tokens, with PRIOR tokens of the estimate's own word."""
        accepted, expected = self.acceptance_sums[per_step]
        return (accepted + PRIOR) / (expected + PRIOR)

    def _estimate(self, index: int, expected: list[float | None] | None) -> tuple[float, bool]:
        """(tokens option `index` is expected to emit, whether from this step's own candidates)."""
        option = self.options[index]
        if option.tree is None:
            return 1.0, False
        if expected is not None and expected[index] is not None:
            return expected[index], True
        return option.expected_tokens, False

    def tokens_per_ms(self, index: int, expected: list[float | None] | None = None) -> float:
        tokens, per_step = self._estimate(index, expected)
        return (1 + self.acceptance(per_step) * (tokens - 1)) / self.step_ms(index)

    def best(self, expected: list[float | None] | None = None, trees_only: bool = False) -> int:
        indices = [i for i, o in enumerate(self.options) if o.tree is not None or not trees_only]
        return max(indices, key=lambda i: self.tokens_per_ms(i, expected))

    def next(self, stats: DecodeStats, expected: list[float | None] | None = None) -> int:
        """The option to run now: a probe while costs are being checked, else the fastest by the estimates.
        `expected`: per option, the tokens this step's own candidates make it expected to emit (None: unknown)."""
        index = self._choose(stats, expected)
        self.estimate = self._estimate(index, expected)
        tree = self.options[index].tree is not None
        self.step_resumes, self.resuming = self.resuming and tree, not tree
        return index

    def _choose(self, stats: DecodeStats, expected: list[float | None] | None) -> int:
        if self.probes:
            return self.probes[0]
        index = self.best(expected)
        if self.options[index].tree is None:
            self.plain_run += 1
            if self.plain_run > self.recheck_every:
                self.plain_run, self.recheck_every = 0, min(2 * self.recheck_every, MAX_RECHECK)
                index = self.best(expected, trees_only=True)
                self._notice_regime(index)
                return index
        else:
            self.plain_run, self.recheck_every = 0, RECHECK
        if self.decided is not None and index != self.decided:
            stats.switches += 1
        self.decided = index
        self._notice_regime(index)
        return index

    def _notice_regime(self, index: int) -> None:
        """One line when most of the last REGIME_WINDOW chosen steps are plain where most were tree steps, or the
        other way round, at most one in NOTICE_GAP steps (the stats count every switch). What ran counts: each
        step's own candidates can make trees win most steps where the estimate without them puts plain steps
        first, and single plain steps of unpromising candidates say nothing."""
        self.chosen_plain.append(self.options[index].tree is None)
        self.since_notice += 1
        if not self.log or self.since_notice < NOTICE_GAP or len(self.chosen_plain) < REGIME_WINDOW:
            return
        plain_steps = sum(self.chosen_plain)
        plain = 2 * plain_steps > REGIME_WINDOW
        if plain != self.plain_regime:
            self.since_notice = 0
            self.log(f"Switching to plain decoding: {plain_steps} of the last {REGIME_WINDOW} steps were plain, "
                     "the trees' candidates not worth their cost" if plain else
                     f"Back to Medusa decoding: {REGIME_WINDOW - plain_steps} of the last {REGIME_WINDOW} steps "
                     "ran the tree")
        self.plain_regime = plain

    def observe(self, index: int, ms: float, tokens: int) -> None:
        """A step of option `index` took `ms` and emitted `tokens` (accepted + the base model's own)."""
        option = self.options[index]
        resumed = self.step_resumes
        if resumed:  # its cost is not this option's steady one, and it counts as no probe
            self.resumed[index].append(ms)
        else:
            self.recent[index].append(ms)
        if option.tree is not None:
            estimate, per_step = self.estimate
            sums = self.acceptance_sums[per_step]
            sums[0], sums[1] = DECAY * sums[0] + tokens - 1, DECAY * sums[1] + estimate - 1
        if self.probes:
            if index == self.probes[0] and not resumed:
                self.probes.popleft()
                if not self.probes:
                    self._checked()
            return
        recent = self.recent[index]
        if len(recent) == WINDOW:
            ratio = statistics.median(recent) / self.basis[index]
            if max(ratio, 1 / ratio) > FACTOR:
                if self.log:
                    self.log(f"{option.tokens}-token steps cost {statistics.median(recent):.1f} ms, {ratio:.2f}x what "
                             f"was expected: timing each step size again for {PROBES} steps")
                for recent_of_other in self.recent:
                    recent_of_other.clear()
                self.probes = self._probe_order()

    def _checked(self) -> None:
        """Every option has run PROBES steps: their medians become the basis, and the profile's correction."""
        costs = {option.tokens: statistics.median(self.recent[i]) for i, option in enumerate(self.options)}
        self.basis = [costs[option.tokens] for option in self.options]
        if self.on_correction:
            self.pending = self.on_correction(costs)
