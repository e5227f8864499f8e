"""The schedule runs the option that real steps show fastest, whatever the profile said."""

import pytest

from inference.engine.decoding import DecodeStats
from inference.engine.step_schedule import FACTOR, NOTICE_GAP, PROBES, RECHECK, AdaptiveSchedule, StepOption
from medusa_choices import DynamicTree

# What steps really cost here (ms) and the tokens each emits: the 9-token tree is fastest (3 tokens per 45 ms).
TRUE_MS = {9: 45.0, 5: 40.0, 13: 55.0, 1: 30.0}  # the runtime's choice first, as it orders options
TOKENS = {1: 1, 5: 2, 9: 3, 13: 3}


def options(profile_ms: dict[int, float]) -> list[StepOption]:
    return [StepOption(None if size == 1 else DynamicTree(size - 1), TOKENS[size], profile_ms[size])
            for size in profile_ms]


def options_of(profile_ms: dict[int, float]) -> list[StepOption]:
    """A 9-token dynamic tree and the plain step at the profile's costs, the tree expected to emit 1.5 tokens."""
    return [StepOption(None if size == 1 else DynamicTree(size - 1), 1.5 if size > 1 else 1, ms)
            for size, ms in profile_ms.items()]


def run(schedule: AdaptiveSchedule, steps: int, true_ms=TRUE_MS, tokens=TOKENS) -> list[int]:
    """The step sizes the schedule runs over `steps` steps of a machine whose costs are `true_ms`."""
    stats, sizes = DecodeStats(), []
    for _ in range(steps):
        index = schedule.next(stats)
        size = schedule.options[index].tokens
        schedule.observe(index, true_ms[size], tokens[size])
        sizes.append(size)
    return sizes


def test_a_fresh_schedule_times_every_option_then_runs_the_fastest_and_keeps_the_costs():
    corrections = []
    schedule = AdaptiveSchedule(options({13: 60.0, 5: 42.0, 9: 50.0, 1: 31.0}), on_correction=corrections.append)
    sizes = run(schedule, 4 * PROBES + 20)
    # the first step drafts from scratch, which is not what its size costs at every step: it is no probe
    assert sizes[: 4 * PROBES + 1] == [13] * (PROBES + 1) + [5] * PROBES + [9] * PROBES + [1] * PROBES
    assert set(sizes[4 * PROBES + 1:]) == {9}
    assert corrections == [TRUE_MS]


@pytest.mark.parametrize("wrong", [10.0, 0.1])
def test_a_profile_10x_off_is_corrected_within_a_few_dozen_steps(wrong):
    """The profile claims real-step costs (no first timing), but every tree's cost is `wrong` times the truth."""
    corrections = []
    profile = {size: ms * (wrong if size > 1 else 1) for size, ms in TRUE_MS.items()}
    schedule = AdaptiveSchedule(options(profile), costs_realised=True, on_correction=corrections.append)
    sizes = run(schedule, 100)
    settled = next(i for i in range(len(sizes)) if set(sizes[i:]) == {9})
    assert settled <= 60 and corrections == [TRUE_MS]


def test_a_cost_drifting_by_less_than_the_factor_is_not_timed_again():
    schedule = AdaptiveSchedule(options(TRUE_MS), costs_realised=True)
    drifted = {size: ms * FACTOR * 0.9 for size, ms in TRUE_MS.items()}
    assert set(run(schedule, 50, drifted)) == {9}


def test_speculation_that_stops_paying_switches_to_plain_and_a_recheck_brings_it_back():
    notices = []
    schedule = AdaptiveSchedule(options(TRUE_MS), costs_realised=True, log=notices.append)
    nothing_accepted = {size: 1 for size in TOKENS}
    stats = DecodeStats()
    sizes = []
    for tokens, steps in ((nothing_accepted, 4 * RECHECK), (TOKENS, 8 * RECHECK)):
        for _ in range(steps):
            index = schedule.next(stats)
            size = schedule.options[index].tokens
            schedule.observe(index, TRUE_MS[size], tokens[size])
            sizes.append(size)
    assert sizes[3 * RECHECK:4 * RECHECK].count(1) >= RECHECK - 1  # plain, but for a recheck
    assert sizes[-RECHECK:] == [9] * RECHECK
    assert stats.switches >= 2
    assert notices[0].startswith("Switching to plain decoding") and any(n.startswith("Back to Medusa") for n in notices)


def test_a_near_tie_between_trees_and_plain_steps_is_not_announced_at_every_flip():
    """Tree steps that emit 1 or 3 tokens in turn at 64 ms, plain ones 1 at 30 ms: the lead flips every few steps."""
    notices = []
    schedule = AdaptiveSchedule(options({9: 64.0, 1: 30.0}), costs_realised=True, log=notices.append)
    stats, tree_steps = DecodeStats(), 0
    for _ in range(3 * NOTICE_GAP):
        index = schedule.next(stats)
        size = schedule.options[index].tokens
        tree_steps += size > 1
        schedule.observe(index, {9: 64.0, 1: 30.0}[size], 1 + 2 * (tree_steps % 2) if size > 1 else 1)
    assert stats.switches >= 20  # the choice flips, and the stats count each flip ...
    assert 1 <= len(notices) <= 3  # ... but one line in NOTICE_GAP steps says so


def test_the_notices_follow_the_steps_that_ran_not_the_estimate_without_candidates():
    """Every step but each request's first has candidates that make the tree worth its cost, and it runs; the first
    steps, estimated without candidates, accept nothing, which puts plain steps first in that estimate alone."""
    notices = []
    schedule = AdaptiveSchedule(options({9: 45.0, 1: 30.0}), costs_realised=True, log=notices.append)
    stats, sizes = DecodeStats(), []
    for step in range(3 * NOTICE_GAP):
        first = step % 16 == 0
        index = schedule.next(stats, None if first else [3.0, None])
        size = schedule.options[index].tokens
        schedule.observe(index, {9: 45.0, 1: 30.0}[size], 1 if first or size == 1 else 3)
        sizes.append(size)
    assert schedule.options[schedule.best()].tree is None and sizes.count(9) > 0.9 * len(sizes)
    assert notices == []
    for _ in range(2 * NOTICE_GAP):  # then the candidates stop paying: plain steps run, and that is said
        index = schedule.next(stats, [1.1, None])
        schedule.observe(index, {9: 45.0, 1: 30.0}[schedule.options[index].tokens], 1)
    assert len(notices) == 1 and notices[0].startswith("Switching to plain decoding")


def test_where_trees_never_pay_their_rechecks_grow_rare():
    slow_trees = {1: 20.0, 5: 80.0, 9: 120.0, 13: 160.0}  # a CPU without native bf16: k tokens cost ~k plain ones
    schedule = AdaptiveSchedule(options(slow_trees), costs_realised=True)
    sizes = run(schedule, 4000, slow_trees)
    assert sizes.count(1) > 4000 - 8


def test_a_schedule_without_a_plain_step_is_refused():
    with pytest.raises(ValueError, match="plain step"):
        AdaptiveSchedule([StepOption(DynamicTree(8), 2.0, 40.0)])


def test_options_redecided_from_a_correction_run_from_the_next_request_probing_only_new_sizes():
    wider = options({9: 45.0, 13: 55.0, 5: 40.0, 1: 30.0})
    schedule = AdaptiveSchedule(options({5: 400.0, 1: 30.0}), on_correction=lambda costs: wider)
    run(schedule, 2 * PROBES + 5)
    assert [o.tokens for o in schedule.options] == [5, 1]  # the request under way keeps its options
    assert [o.tokens for o in schedule.begin()] == [9, 13, 5, 1]
    sizes = run(schedule, 2 * PROBES + 10)
    assert sizes[: 2 * PROBES + 1] == [9] * (PROBES + 1) + [13] * PROBES and set(sizes[2 * PROBES + 1:]) == {9}


def test_each_step_runs_the_size_its_own_candidates_make_fastest():
    schedule = AdaptiveSchedule(options(TRUE_MS), costs_realised=True)
    stats = DecodeStats()
    confident = [None if o.tree is None else {5: 4.0, 9: 7.0, 13: 10.0}[o.tokens] for o in schedule.options]
    unsure = [None if o.tree is None else {5: 1.2, 9: 1.3, 13: 1.35}[o.tokens] for o in schedule.options]
    assert schedule.options[schedule.next(stats, confident)].tokens == 13
    assert schedule.options[schedule.next(stats, unsure)].tokens == 1
    assert schedule.options[schedule.next(stats)].tokens == 9  # no candidates: the heads' measured accuracy


def test_acceptance_below_the_candidates_word_discounts_their_estimates_only():
    schedule = AdaptiveSchedule(options(TRUE_MS), costs_realised=True)
    stats = DecodeStats()
    promising = [None if o.tree is None else 2.0 * o.tokens / 5 for o in schedule.options]
    for _ in range(40):  # the candidates promise 2-5 tokens a step; 1 is accepted
        index = schedule.next(stats, promising)
        schedule.observe(index, TRUE_MS[schedule.options[index].tokens], 1)
    assert schedule.acceptance(per_step=True) < 0.3 and schedule.acceptance(per_step=False) == 1.0
    assert schedule.options[schedule.next(stats, promising)].tokens == 1


def test_a_plain_step_is_charged_the_drafting_from_scratch_that_the_tree_step_after_it_pays():
    """Tree steps cost 24 ms, but 32 ms after a plain step (16 ms), which left no candidates drafted: candidates
    expected to emit 1.45 tokens make a tree step alone slower than a plain one, but not a plain step and the
    dearer tree step after it together."""
    schedule = AdaptiveSchedule(options_of({9: 24.0, 1: 16.0}), costs_realised=True)
    stats, sizes, previous = DecodeStats(), [], 1
    unsure = [1.45 if o.tree is not None else None for o in schedule.options]
    for step in range(4 * RECHECK):
        index = schedule.next(stats, unsure)
        size = schedule.options[index].tokens
        schedule.observe(index, {1: 16.0, 9: 32.0 if previous == 1 else 24.0}[size], 1 + step % 2 if size > 1 else 1)
        sizes.append(previous := size)
    settled = sizes.index(9) + 1  # plain steps until a recheck's tree step shows what drafting from scratch costs
    assert settled <= RECHECK + 2 and set(sizes[settled:]) == {9}
