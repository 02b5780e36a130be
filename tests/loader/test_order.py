"""Sample order: every sample exactly once per epoch, for every mode, shard count and resume point."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libbus.errors import BadRequest
from libbus.order.epochs import (
    DEFAULT_BLOCK_SIZE,
    Cursor,
    Order,
    Shuffle,
    batches_of,
    epoch_order,
    shard_bounds,
)

MODES = st.sampled_from(["none", "full", "block"])

orders = st.builds(
    Order,
    n=st.integers(0, 5000),
    seed=st.integers(0, 2**63),
    shuffle=MODES,
    block_size=st.integers(1, 600),
    world_size=st.integers(1, 8),
    batch_size=st.integers(1, 700),
    drop_last=st.booleans(),
    drop_uneven=st.booleans(),
)


def all_ranks(order: Order) -> list[Order]:
    """The same order seen from each rank of its world."""
    return [Order(**{**vars(order), "rank": r}) for r in range(order.world_size)]


def runs(indices: np.ndarray) -> list[np.ndarray]:
    """``indices`` cut where it stops counting up by one: its sequential runs."""
    return np.split(indices, np.flatnonzero(np.diff(indices) != 1) + 1) if len(indices) else []


# -- properties ------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(order=orders, epoch=st.integers(0, 10_000))
def test_shards_are_disjoint_and_cover_every_sample_once(order, epoch):
    parts = [o.indices(epoch) for o in all_ranks(order)]
    assert all(p.dtype == np.int64 for p in parts)
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined)  # nothing read twice
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= (0 if order.drop_uneven else 1)
    assert sizes == [o.shard_size for o in all_ranks(order)]
    if order.drop_uneven:
        assert len(joined) == order.n - order.n % order.world_size and set(joined) <= set(range(order.n))
    else:
        assert np.array_equal(np.sort(joined), np.arange(order.n))  # everything read


@settings(max_examples=150, deadline=None)
@given(order=orders, epoch=st.integers(0, 10_000))
def test_every_rank_reproduces_its_order_from_seed_and_epoch(order, epoch):
    again = Order(**vars(order))
    for o, same in zip(all_ranks(order), all_ranks(again)):
        assert np.array_equal(o.indices(epoch), same.indices(epoch))
        assert np.array_equal(
            o.indices(epoch),
            epoch_order(
                o.n,
                epoch=epoch,
                seed=o.seed,
                shuffle=str(o.shuffle),
                rank=o.rank,
                world_size=o.world_size,
                block_size=o.block_size,
                drop_uneven=o.drop_uneven,
            ),
        )


@settings(max_examples=150, deadline=None)
@given(order=orders.filter(lambda o: o.shuffle != "full"), epoch=st.integers(0, 100))
def test_none_and_block_read_whole_blocks_sequentially(order, epoch):
    # "none" is block mode with a single block
    block = order.block_size if order.shuffle == "block" else max(order.n, 1)
    pieces = []
    for o in all_ranks(order):
        indices = o.indices(epoch)
        for run in runs(indices):
            # a run may hold several blocks that happened to be drawn in a row: cut at block edges
            pieces += np.split(run, np.flatnonzero(np.diff(run // block)) + 1)
    # every block is read as one ascending run of consecutive indices, except the one block
    # each rank boundary may cut in two
    blocks = [int(p[0] // block) for p in pieces]
    assert all(int(p[-1] // block) == b for p, b in zip(pieces, blocks))
    assert len(pieces) - len(set(blocks)) <= order.world_size - 1


@settings(max_examples=300, deadline=None)
@given(order=orders, epoch=st.integers(0, 1000), cut=st.integers(0, 10_000), data=st.data())
def test_resuming_at_any_batch_gives_exactly_the_rest_of_the_epoch(order, epoch, cut, data):
    rank = data.draw(st.integers(0, order.world_size - 1))
    o = all_ranks(order)[rank]
    whole = o.batches(epoch)
    assert len(whole) == o.num_batches()
    k = cut % (len(whole) + 1)  # batches delivered before the interruption
    position = sum(len(b) for b in whole[:k])
    state = json.loads(json.dumps(o.state(epoch, position)))  # through a checkpoint file
    e, p = Order(**vars(o)).restore(state)
    after = o.batches(e, start=p) if e == epoch else []
    assert [b.tolist() for b in whole[:k] + after] == [b.tolist() for b in whole]
    assert o.num_batches(start=position) == len(whole) - k
    if k == len(whole) and position > 0:  # a finished epoch resumes at the next one
        assert (e, p) == (epoch + 1, 0)
    assert o.restore(o.state(e, p)) == (e, p)  # restoring is idempotent


@settings(max_examples=200, deadline=None)
@given(order=orders, epoch=st.integers(0, 1000), position=st.integers(0, 5000), batch_size=st.integers(1, 700))
def test_resuming_anywhere_with_any_batch_size_delivers_the_remaining_samples_once(order, epoch, position, batch_size):
    indices = order.indices(epoch)
    position %= len(indices) + 1
    resumed = Order(**{**vars(order), "batch_size": batch_size})  # batch size changed on resume
    e, p = resumed.restore(order.state(epoch, position))
    rest = resumed.batches(e, start=p) if e == epoch else []
    got = np.concatenate(rest) if rest else np.empty(0, np.int64)
    assert all(len(b) == batch_size for b in rest[:-1])
    if order.drop_last:
        remaining = len(indices) - position
        want = indices[position : position + remaining - remaining % batch_size]
    else:
        want = indices[position:]
    assert np.array_equal(got, want)


@settings(max_examples=100, deadline=None)
@given(
    order=orders.filter(lambda o: o.n > 0),
    change=st.sampled_from(["n", "seed", "shuffle", "world_size", "block_size", "drop_uneven"]),
)
def test_a_state_saved_under_other_settings_is_refused_naming_the_field(order, change):
    state = order.state(0, 0)
    other = {
        "n": order.n + 1,
        "seed": order.seed + 1,
        "world_size": order.world_size % 8 + 1,
        "shuffle": "block" if order.shuffle != "block" else "full",
        "block_size": order.block_size + 1,
        "drop_uneven": not order.drop_uneven,
    }[change]
    fields = {**vars(order), change: other}
    if change == "block_size":
        fields["shuffle"] = "block"  # block size only matters in block mode
        state["shuffle"] = "block"
    with pytest.raises(BadRequest, match=f"{change} was"):
        Order(**fields).restore(state)


# -- documented behaviour, by example --------------------------------------------------------------
def test_full_order_is_pinned_so_checkpoints_stay_valid_across_versions():
    # Changing how the order is drawn would make every saved cursor point at other samples.
    assert (
        epoch_order(10, epoch=0, seed=0, shuffle=True).tolist()
        == np.random.default_rng([0, 0]).permutation(10).tolist()
    )
    assert epoch_order(10, epoch=1, seed=3, shuffle="full").tolist() == [4, 1, 2, 8, 5, 0, 7, 9, 6, 3]
    assert epoch_order(10, epoch=1, seed=0, shuffle="block", block_size=3).tolist() == [9, 0, 1, 2, 6, 7, 8, 3, 4, 5]


@pytest.mark.parametrize(
    "mode, n, block_size",
    [("full", 20, 1), ("full", 5000, 1), ("block", 200, 10), ("block", 5000, DEFAULT_BLOCK_SIZE // 4)],
)
def test_shuffled_modes_differ_between_epochs_and_seeds(mode, n, block_size):
    # Fixed seeds, so this is a fact about these examples, not a flaky probability.
    seen = {tuple(epoch_order(n, epoch=e, seed=11, shuffle=mode, block_size=block_size)) for e in range(6)}
    assert len(seen) == 6
    assert not np.array_equal(
        epoch_order(n, epoch=0, seed=1, shuffle=mode, block_size=block_size),
        epoch_order(n, epoch=0, seed=2, shuffle=mode, block_size=block_size),
    )


def test_none_reads_in_order_and_shards_are_contiguous_ranges():
    assert epoch_order(5, epoch=3, seed=9, shuffle=False).tolist() == [0, 1, 2, 3, 4]
    assert [epoch_order(10, epoch=0, seed=0, shuffle="none", rank=r, world_size=3).tolist() for r in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6],
        [7, 8, 9],
    ]
    assert [shard_bounds(10, rank=r, world_size=3, drop_uneven=True) for r in range(3)] == [(0, 3), (3, 6), (6, 9)]


def test_block_mode_with_one_sample_blocks_is_full_mode():
    assert np.array_equal(
        epoch_order(1000, epoch=2, seed=5, shuffle="block", block_size=1),
        epoch_order(1000, epoch=2, seed=5, shuffle="full"),
    )


def test_block_mode_keeps_the_short_last_block_whole():
    order = epoch_order(10, epoch=0, seed=0, shuffle="block", block_size=4)
    assert order.tolist() == [8, 9, 0, 1, 2, 3, 4, 5, 6, 7]  # blocks [8, 9], [0..3], [4..7]


def test_more_ranks_than_samples_leaves_some_ranks_empty():
    parts = [epoch_order(3, epoch=0, seed=0, shuffle="full", rank=r, world_size=5) for r in range(5)]
    assert [len(p) for p in parts] == [1, 1, 1, 0, 0]
    assert Order(n=3, world_size=5, rank=4).batches(0) == []


def test_batches_of_keeps_the_old_signature_and_counts_from_start():
    order = np.arange(10)
    assert [b.tolist() for b in batches_of(order, 4, False)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [b.tolist() for b in batches_of(order, 4, True)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [b.tolist() for b in batches_of(order, 4, True, start=1)] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert batches_of(order, 4, False, start=10) == []
    with pytest.raises(BadRequest, match="start 11 is past the end of an epoch of 10"):
        batches_of(order, 4, False, start=11)


def test_state_is_small_json_and_a_finished_epoch_is_the_next_ones_start():
    order = Order(n=10, seed=1, shuffle="block", block_size=4, batch_size=4, drop_last=True)
    state = order.state(2, 4)
    assert json.loads(json.dumps(state)) == state
    assert {k: state[k] for k in ("epoch", "position", "shuffle")} == {"epoch": 2, "position": 4, "shuffle": "block"}
    assert order.restore(state) == Cursor(2, 4)
    assert order.restore(order.state(2, 8)) == Cursor(3, 0)  # 2 samples left: less than a batch
    assert order.restore(order.state(2, 10)) == Cursor(3, 0)
    assert order.state(2, 10)["epoch"] == 2  # saved as given, moved on at restore
    # an epoch that yields no batch at all is not skipped: position 0 stays where it is
    tiny = Order(n=3, batch_size=4, drop_last=True)
    assert tiny.num_batches() == 0 and tiny.restore(tiny.state(5, 0)) == Cursor(5, 0)


def test_uneven_shards_accept_the_longer_ranks_final_position():
    # n=9 over 2 ranks: rank 0 reads 5, rank 1 reads 4; rank 0's finished epoch restores on rank 1
    rank0, rank1 = (Order(n=9, world_size=2, rank=r, batch_size=2) for r in range(2))
    assert rank1.restore(rank0.state(0, 5)) == Cursor(1, 0)
    with pytest.raises(BadRequest, match="position 6 is past the end"):
        rank0.state(0, 6)


def test_block_size_is_not_checked_outside_block_mode():
    state = Order(n=100, shuffle="full", block_size=8).state(0, 0)
    assert Order(n=100, shuffle="full", block_size=16).restore(state) == Cursor(0, 0)


@pytest.mark.parametrize(
    "state, match",
    [
        ([0, 0], "must be a mapping"),
        ({"epoch": 0, "position": 0}, "version None is not 1"),
        ({"version": 1, "epoch": 0, "position": 0}, "lacks n, seed, shuffle, block_size, world_size, drop_uneven"),
    ],
)
def test_malformed_states_are_refused(state, match):
    with pytest.raises(BadRequest, match=match):
        Order(n=10).restore(state)


def test_a_state_from_another_run_names_every_differing_field():
    state = Order(n=100, seed=1, shuffle="full", world_size=2).state(0, 10)
    with pytest.raises(BadRequest, match=r"n was 100, is 99; seed was 1, is 2; shuffle was 'full', is 'none'"):
        Order(n=99, seed=2, shuffle=False, world_size=2).restore(state)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"shuffle": "random"}, "shuffle mode 'random' is not one of none, full, block"),
        ({"shuffle": None}, "shuffle mode None is not one of"),
        ({"shuffle": "block", "block_size": 0}, "block_size must be at least 1, got 0"),
        ({"block_size": 2.5}, "block_size must be an integer, got 2.5"),
        ({"rank": 2, "world_size": 2}, r"rank 2 outside a world of 2 \(ranks are 0..1\)"),
        ({"world_size": 0}, "world_size must be at least 1"),
        ({"seed": -1}, "seed must be at least 0"),
        ({"epoch": -1}, "epoch must be at least 0"),
        ({"n": True}, "n must be an integer, got True"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    args = {"n": 10, "epoch": 0, "seed": 0, "shuffle": "full"} | kwargs
    with pytest.raises(BadRequest, match=match):
        epoch_order(args.pop("n"), **args)


def test_order_normalises_its_fields_and_refuses_bad_ones():
    order = Order(n=np.int64(10), shuffle=" Block ", batch_size=np.int32(3))
    assert order.shuffle is Shuffle.BLOCK and type(order.n) is int and order.num_batches() == 4
    with pytest.raises(BadRequest, match="batch_size must be at least 1"):
        Order(n=10, batch_size=0)
    with pytest.raises(TypeError):
        order.num_batches(0)  # start is keyword-only: an epoch passed by position must not slip in


def test_loader_signature_still_works():
    # libbus.loader.remote calls epoch_order(n, epoch=, seed=, shuffle=bool, rank=, world_size=)
    parts = [epoch_order(1001, epoch=3, seed=1, shuffle=True, rank=r, world_size=4) for r in range(4)]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(1001))
