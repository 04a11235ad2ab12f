"""The pipeline schedules as pure orders (no MPI): GPipe, 1F1B and Megatron-LM's
interleaved 1F1B with V model chunks per stage (Narayanan et al. 2021, section 2.2.2,
Figure 4). Each order runs every micro-batch chunk once, respects the dependencies
between virtual stages, finishes without deadlock when every stage of the pipeline runs
it with blocking receives and non-blocking sends, holds the closed-form number of
micro-batch chunks in flight, and idles for exactly the paper's bubble."""

from __future__ import annotations

import pytest

from summasim.transformer.composed import MPI_TAG_FLOOR
from summasim.transformer.schedules import check_schedule, hand_off_tag, peak_inflight, schedule

F_TIME, B_TIME = 1, 2                       # a chunk's forward and backward, unit times


def _configs():
    """(kind, pp, V, m): pp 1..6, V 1..4 (V = 1: gpipe and 1f1b), m multiples of pp up
    to 4 pp."""
    out = []
    for pp in range(1, 7):
        for m in range(pp, 4 * pp + 1, pp):
            out += [("gpipe", pp, 1, m), ("1f1b", pp, 1, m)]
            out += [("interleaved", pp, V, m) for V in range(2, 5)]
    return out


CONFIGS = _configs()
IDS = [f"{k}-pp{pp}-V{V}-m{m}" for k, pp, V, m in CONFIGS]


def simulate(orders: list, pp: int, V: int) -> tuple[list, dict]:
    """Run every stage's order at once: an op starts when its stage is free and the
    message it receives has been sent (a forward of virtual stage ``k = c pp + s`` needs
    virtual stage k - 1's forward of the same micro-batch, a backward virtual stage k +
    1's backward; sends never block). Returns each stage's finish time and each op's
    ``(start, end)``; raises AssertionError naming the stuck ops on a deadlock."""
    last = pp * V - 1
    at, free, done = [0] * pp, [0] * pp, {}
    progressed = True
    while progressed:
        progressed = False
        for s in range(pp):
            while at[s] < len(orders[s]):
                op, j, c = orders[s][at[s]]
                k = c * pp + s
                need = (("F", j, k - 1) if op == "F" and k > 0 else
                        ("B", j, k + 1) if op == "B" and k < last else None)
                if need is not None and need not in done:
                    break                              # a blocking receive: wait
                start = max(free[s], done[need][1] if need else 0)
                free[s] = start + (F_TIME if op == "F" else B_TIME)
                done[op, j, k] = (start, free[s])
                at[s] += 1
                progressed = True
    stuck = [orders[s][at[s]] for s in range(pp) if at[s] < len(orders[s])]
    assert not stuck, f"deadlock: stages wait at {stuck}"
    return free, done


@pytest.mark.parametrize("kind,pp,V,m", CONFIGS, ids=IDS)
def test_every_stage_runs_each_micro_batch_chunk_once_in_dependency_order(kind, pp, V, m):
    for s in range(pp):
        order = schedule(kind, m, pp, s, V)
        want = [(op, j, c) for op in "FB" for j in range(m) for c in range(V)]
        assert sorted(order) == sorted(want)
        pos = {x: i for i, x in enumerate(order)}
        for j in range(m):
            for c in range(V):          # on one stage: F(c) < F(c + 1) and B(c + 1) < B(c)
                assert pos["F", j, c] < pos["B", j, c]
                if c + 1 < V:
                    assert pos["F", j, c] < pos["F", j, c + 1]
                    assert pos["B", j, c + 1] < pos["B", j, c]


@pytest.mark.parametrize("kind,pp,V,m", CONFIGS, ids=IDS)
def test_the_pipeline_finishes_and_each_virtual_stage_waits_for_its_neighbour(kind, pp, V,
                                                                             m):
    _, done = simulate([schedule(kind, m, pp, s, V) for s in range(pp)], pp, V)
    last = pp * V - 1
    for j in range(m):
        for k in range(pp * V):
            if k > 0:                    # forward of k after that of k - 1
                assert done["F", j, k][0] >= done["F", j, k - 1][1]
            if k < last:                 # backward of k after that of k + 1
                assert done["B", j, k][0] >= done["B", j, k + 1][1]
            assert done["B", j, k][0] >= done["F", j, k][1]


@pytest.mark.parametrize("kind,pp,V,m", CONFIGS, ids=IDS)
def test_peak_chunks_in_flight_is_the_closed_form(kind, pp, V, m):
    for s in range(pp):
        live = most = 0
        for op, _, _ in schedule(kind, m, pp, s, V):
            live += 1 if op == "F" else -1
            most = max(most, live)
        # gpipe: m; 1f1b: min(pp - s, m); interleaved: the warm-up 2 (pp - s - 1) +
        # (V - 1) pp forwards and one more in the steady state, at most m V
        # ((V + 1) pp - 1 chunks on stage 0: Korthikanti et al. 2022's factor
        # 1 + (pp - 1)/(pp V) on pp micro-batches of a stage's layers)
        want = {"gpipe": m, "1f1b": min(pp - s, m),
                "interleaved": min(2 * (pp - s - 1) + (V - 1) * pp + 1, m * V)}[kind]
        assert most == want == peak_inflight(kind, m, pp, s, V)
    if kind == "interleaved" and m * V >= (V + 1) * pp - 1:
        assert peak_inflight(kind, m, pp, 0, V) == (V + 1) * pp - 1


@pytest.mark.parametrize("kind,pp,V,m", CONFIGS, ids=IDS)
def test_the_bubble_is_the_papers(kind, pp, V, m):
    """Every stage idles 3 (pp - 1) units against the ideal 3 m V of its own work:
    (pp - 1) / m of it for GPipe and 1F1B, (pp - 1) / (V m) interleaved (Narayanan et al.
    2021, section 2.2.2: the interleaved bubble is the 1F1B one over V)."""
    free, _ = simulate([schedule(kind, m, pp, s, V) for s in range(pp)], pp, V)
    makespan = max(free)
    ideal = m * V * (F_TIME + B_TIME)
    for s in range(pp):
        assert makespan - ideal == (pp - 1) * (F_TIME + B_TIME)   # idle slots of stage s
    frac = (makespan - ideal) / ideal
    assert frac == pytest.approx((pp - 1) / (V * m) if kind == "interleaved"
                                 else (pp - 1) / m, rel=1e-12)


def test_interleaved_follows_megatron_lm_figure_4():
    """pp = 4 stages, V = 2 chunks, m = 8: stage 0 warms up with 2 (pp - 1) + (V - 1) pp
    = 10 forwards (micro-batches 0-3 through chunk 0, the same through chunk 1, then
    4-5 through chunk 0), then alternates, its first backward on chunk 1 (the last
    virtual stage of micro-batch 0 runs on stage 3's chunk 1 before it)."""
    order = schedule("interleaved", 8, 4, 0, 2)
    assert order[:10] == ([("F", j, 0) for j in range(4)] + [("F", j, 1) for j in range(4)]
                          + [("F", 4, 0), ("F", 5, 0)])
    assert order[10:14] == [("F", 6, 0), ("B", 0, 1), ("F", 7, 0), ("B", 1, 1)]
    # the last stage starts 1F1B after (V - 1) pp = 4 forwards
    last = schedule("interleaved", 8, 4, 3, 2)
    assert last[:6] == [("F", j, 0) for j in range(4)] + [("F", 0, 1), ("B", 0, 1)]
    # two stages, two chunks, two micro-batches, worked by hand
    assert schedule("interleaved", 2, 2, 1, 2) == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 0, 1), ("F", 1, 1), ("B", 1, 1),
        ("B", 0, 0), ("B", 1, 0)]


def test_gpipe_and_1f1b_are_unchanged_with_one_chunk():
    assert schedule("gpipe", 3, 2, 0) == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0),
                                          ("B", 2, 0), ("B", 1, 0), ("B", 0, 0)]
    assert schedule("1f1b", 3, 3, 0) == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0),
                                         ("B", 0, 0), ("B", 1, 0), ("B", 2, 0)]
    assert schedule("1f1b", 3, 2, 1) == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0),
                                         ("B", 1, 0), ("F", 2, 0), ("B", 2, 0)]


@pytest.mark.parametrize("args,words", [
    (("interleaved", 6, 4, 0, 2), "multiple of pp = 4"),
    (("interleaved", 4, 2, 0, 1), "V >= 2"),
    (("1f1b", 4, 2, 0, 2), "V >= 2"),
    (("zigzag", 4, 2, 0, 1), "schedule must be one of"),
    (("1f1b", 0, 2, 0, 1), "m=0"),
    (("1f1b", 4, 2, 2, 1), "stage=2, pp=2"),
])
def test_bad_schedules_raise_naming_the_numbers(args, words):
    with pytest.raises(ValueError, match=words):
        schedule(*args)


def test_hand_off_tags_keep_micro_batches_chunks_and_directions_apart():
    m, V = 64, 4
    tags = {hand_off_tag(j, c, V, b) for j in range(m) for c in range(V) for b in (0, 1)}
    assert len(tags) == 2 * m * V and min(tags) == 0 and max(tags) == 2 * m * V - 1
    assert hand_off_tag(3, 0, 1, False) == 6 and hand_off_tag(3, 0, 1, True) == 7  # 2j, 2j+1
    assert MPI_TAG_FLOOR == 32767
    check_schedule("interleaved", 8, 4, 2)
