"""Who holds a finding's bytes: the holder log a run keeps at each point at rest, the groups
each finding names from it, the block a summary keeps, and how the reports show them."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.common.units import MiB
from harness.judge.holders import NAMED_AT_MOST, held_by, largest, named
from harness.judge.records import Finding, HeldAtRest, Holder
from harness.run import holders_log
from harness.run.holders_log import COLUMNS, GROUP, MAX_GROUPS, HolderLog, bounded
from harness.run.holders_log import frame as holders_frame

STORE = "examples.leaky_store:LeakyStore._entries[*]"
WEIGHTS = "mlx_lm.models.llama:LlamaModel.layers[*].mlp.up_proj.weight"


def group(name: str, nbytes: int, arrays: int = 1, root: str = "global", logical: int | None = None,
          buffers: int | None = None) -> tuple:
    return (name, f"{name}#path", root, nbytes, nbytes if logical is None else logical, arrays,
            arrays if buffers is None else buffers, 0)


def walked(points: list[tuple[int, list[tuple]]]) -> pd.DataFrame:
    """A holders frame: at each (step, groups) point at rest, request = its index."""
    log = HolderLog()
    for request, (step, groups) in enumerate(points):
        log.add(step, request, -1, groups, objects=1000 + step, seconds=0.25)
    return holders_frame(log.rows())


def rests(*steps: int) -> pd.DataFrame:
    """A run's samples with a point at rest at each of `steps`."""
    return pd.DataFrame({"step": list(steps), "phase": "idle"})


EVERY = rests(*range(0, 41, 10))


def growing(points: int = 5, per: int = MiB) -> pd.DataFrame:
    """A store that keeps `per` bytes more at each point, beside weights that stay put."""
    return walked([(10 * i, [group(WEIGHTS, 8 * MiB, 4), group(STORE, per * i, i)])
                   for i in range(points)])


def test_the_group_fields_are_the_walks_own():
    from harness.agent.kvmem_holders import Group

    assert Group._fields == GROUP


def test_a_point_keeps_its_largest_groups_and_folds_the_rest_so_they_still_sum():
    groups = [group(f"m:G{i}", 1000 - i, 2) for i in range(MAX_GROUPS + 3)]
    kept = bounded(groups)
    assert len(kept) == MAX_GROUPS + 1
    assert kept[-1] == ("(3 smaller holders)", "", "other", 2877, 2877, 6, 6, 0)
    assert sum(g[3] for g in kept) == sum(g[3] for g in groups)


def test_the_spooled_log_reads_back_typed_and_drops_a_row_cut_short(tmp_path):
    spool = tmp_path / holders_log.HOLDERS_SPOOL
    log = HolderLog(spool)
    log.add(3, 0, -1, [group(STORE, 4096, 2), group('m:CACHE["a,b"]', 16)], approximate=True,
            objects=51234, seconds=0.125)
    log.close()
    spool.write_text(spool.read_text() + "4,1,-1,m:X,m:X,glo")  # a kill mid-row
    rows = holders_log.read(spool)
    assert rows == [
        (3, 0, -1, STORE, f"{STORE}#path", "global", 4096, 4096, 2, 2, 0, 1, 51234, 0.125),
        (3, 0, -1, 'm:CACHE["a,b"]', 'm:CACHE["a,b"]#path', "global", 16, 16, 1, 1, 0, 1, 51234,
         0.125)]
    assert list(holders_frame(rows).columns) == list(COLUMNS)


def test_a_trend_names_the_group_that_grew_at_its_rate():
    leak = Finding(kind="leak", step=40, bytes=MiB, count=4, message="...", steps=[0, 10, 20, 30, 40],
                   per="request")
    (holder,) = held_by(leak, growing(), EVERY)
    assert (holder.holder, holder.bytes, holder.arrays, holder.root) == (STORE, MiB, 4, "global")
    assert leak.__class__(**{**leak.__dict__, "holders": [holder]}).held_by() == (
        f"held by {STORE} (+1 MiB a request, 4 arrays)")


def test_a_trend_that_starts_late_is_attributed_from_where_it_starts():
    """Flat for three points, then +2 MiB a point: the rise's own rate, not an average."""
    holders = walked([(i, [group(STORE, 2 * MiB * max(0, i - 2), 1)]) for i in range(6)])
    late = Finding(kind="leak", step=5, bytes=2 * MiB, count=3, message="...", steps=[2, 3, 4, 5],
                   per="request")
    assert [h.bytes for h in held_by(late, holders, rests(*range(6)))] == [2 * MiB]


def test_a_rate_between_spaced_walks_counts_the_points_at_rest_between_them():
    """Walked at points 0, 1, 2, 4, 8 and 11 of a run of twelve: from point 8 to 11 the store
    gained 3 MiB over three requests, 1 MiB a request, though the trend began at point 9."""
    holders = walked([(i, [group(STORE, MiB * i, i)]) for i in (0, 1, 2, 4, 8, 11)])
    trend = Finding(kind="leak", step=11, bytes=MiB, count=2, message="...", steps=[9, 10, 11],
                    per="request")
    assert [h.bytes for h in held_by(trend, holders, rests(*range(12)))] == [MiB]


def test_a_bound_breached_names_the_growth_since_the_first_point():
    over = Finding(kind="over_cap", step=40, bytes=MiB, count=2, message="...")
    (holder,) = held_by(over, growing(), EVERY)
    assert (holder.holder, holder.bytes) == (STORE, 4 * MiB)


def test_cycle_garbage_is_named_by_the_cycles_groups_alone():
    cycle = "cycle of Entry, function, cell.entry.keys"
    holders = walked([(0, [group(WEIGHTS, 8 * MiB)]),
                      (5, [group(WEIGHTS, 8 * MiB), group(cycle, 3 * MiB, 6, root="cycle")])])
    found = Finding(kind="gc_deferred", step=5, bytes=3 * MiB, count=1, message="...")
    assert [(h.holder, h.bytes, h.root) for h in held_by(found, holders, EVERY)] == [
        (cycle, 3 * MiB, "cycle")]


def test_retained_names_the_groups_whose_buffers_exceed_their_arrays():
    sliced = "reference_impl.prefix_cache:PrefixCache._entries[*][*].keys"
    holders = walked([(0, [group(WEIGHTS, 8 * MiB)]), (7, [group(WEIGHTS, 8 * MiB),
                                    group(sliced, 4 * MiB, 8, logical=MiB)])])
    found = Finding(kind="retained", step=7, bytes=3 * MiB, count=1, message="...")
    assert [(h.holder, h.bytes) for h in held_by(found, holders, EVERY)] == [(sliced, 3 * MiB)]


def test_holders_are_named_until_they_cover_the_growth_and_no_more():
    small = [group(f"m:S{i}", 10 * i, 1) for i in range(1, 8)]
    before = [group("m:Other", 16)]
    holders = walked([(0, before), (1, [group(STORE, 100 * MiB, 5), *small])])
    found = Finding(kind="unbounded", step=1, bytes=MiB, count=1, message="...")
    assert [h.holder for h in held_by(found, holders, EVERY)] == [STORE]
    even = walked([(0, before), (1, [group(f"m:E{i}", MiB) for i in range(9)])])
    assert len(held_by(found, even, EVERY)) == NAMED_AT_MOST


def test_a_finding_of_another_kind_or_a_run_not_walked_names_none():
    spike = Finding(kind="spike", step=3, bytes=MiB, count=1, message="...")
    leak = Finding(kind="leak", step=3, bytes=MiB, count=1, message="...")
    assert named([spike], growing(), EVERY) == [spike]
    assert held_by(leak, walked([]), EVERY) == [] and leak.held_by() == ""


def test_the_summary_keeps_the_largest_groups_and_what_no_path_reaches():
    frame = pd.DataFrame({"step": [0, 10, 20, 30, 40], "active": [9 * MiB] * 4 + [13 * MiB]})
    kept = largest(growing(), frame)
    assert kept is not None
    assert (kept.step, [g.holder for g in kept.groups], kept.unreached) == (40, [WEIGHTS, STORE], MiB)
    assert (kept.walks, kept.seconds, kept.objects) == (5, 1.25, 1040)
    assert largest(walked([]), frame) is None


def test_the_group_that_grew_most_since_the_base_is_found():
    base = HeldAtRest(step=4, groups=[Holder(holder=STORE, bytes=MiB), Holder(holder=WEIGHTS, bytes=8 * MiB)])
    head = HeldAtRest(step=4, groups=[Holder(holder=STORE, bytes=5 * MiB, arrays=5),
                                      Holder(holder=WEIGHTS, bytes=8 * MiB)])
    grown = head.grown_since(base)
    assert grown is not None and (grown.holder, grown.bytes) == (STORE, 4 * MiB)
    assert base.grown_since(head) is None


@pytest.mark.parametrize("per, shown", [(None, "1 MiB"), ("turn", "+1 MiB a turn")])
def test_a_holder_reads_with_its_arrays_and_buffers_where_they_differ(per, shown):
    holder = Holder(holder=STORE, bytes=MiB, arrays=3, buffers=1)
    assert holder.describe(per) == f"{STORE} ({shown}, 3 arrays, 1 buffer)"


def test_buffers_piling_up_name_the_group_that_gained_them_with_the_bytes_it_gained():
    padding = "mlx_lm.models.cache:ArraysCache.left_padding"
    holders = walked([(0, [group(WEIGHTS, 8 * MiB, 4), group(padding, 0, 4, buffers=5)]),
                      (9, [group(WEIGHTS, 8 * MiB, 4), group(padding, 0, 4, buffers=2361)])])
    found = Finding(kind="buffers", step=9, bytes=784, count=1, message="...")
    (holder,) = held_by(found, holders, rests(0, 9))
    assert (holder.holder, holder.bytes, holder.arrays, holder.buffers) == (padding, 0, 4, 2361)


def test_the_summary_names_the_groups_whose_pending_graphs_may_hold_what_is_unreached():
    trie = "mlx_lm.models.cache:PromptTrie._trie[*]...[*].prompt_cache[*].values"
    waiting = (trie, f"{trie}#path", "frame", 3 * MiB, 4 * MiB, 12, 20, 5)
    holders = walked([(0, [group(WEIGHTS, 8 * MiB, 4)]), (7, [group(WEIGHTS, 8 * MiB, 4), waiting])])
    kept = largest(holders, pd.DataFrame({"step": [0, 7], "active": [8 * MiB, 40 * MiB]}))
    assert kept is not None and kept.unreached == 29 * MiB
    (holder,) = kept.pending
    assert (holder.holder, holder.pending) == (trie, 5)
    assert holder.describe() == f"{trie} (3 MiB, 12 arrays, 20 buffers, 5 pending)"


def test_bytes_no_walked_array_accounts_for_are_put_first_on_the_pending_groups():
    """243 MiB retained, 2 KiB of it in evaluated arrays: the group whose pending arrays'
    graphs keep buffers MLX does not size comes first, then what was found."""
    trie = "mlx_lm.models.cache:PromptTrie._trie[*]...[*].prompt_cache[*].values"
    logprobs = "mlx_lm.generate:GenerationBatch.Response.logprobs"
    waiting = (trie, f"{trie}#path", "frame", 5 * MiB, 5 * MiB, 24, 40, 12)
    holders = walked([(0, [group(WEIGHTS, 8 * MiB, 4)]),
                      (9, [group(WEIGHTS, 8 * MiB, 4), waiting,
                           group(logprobs, 4096, 1, logical=2048)])])
    found = Finding(kind="retained", step=9, bytes=243 * MiB, count=1, message="...")
    assert [(h.holder, h.bytes, h.pending) for h in held_by(found, holders, rests(0, 9))] == [
        (trie, 5 * MiB, 12), (logprobs, 2048, None)]


@pytest.mark.parametrize("name, shown", [
    ("m:Store.kept[*]", "held by `m:Store.kept[*]` (1 MiB)"),
    ("m:Store.`x", "held by m:Store.\\`x (1 MiB)"),  # a key from the server's code: as text
])
def test_the_comment_shows_a_holder_as_code_unless_its_name_would_break_out(name, shown):
    from harness.gate.render import _as_code

    assert _as_code(name, f"held by {name} (1 MiB)", "`") == shown
