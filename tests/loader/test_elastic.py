"""Elastic cursors and ranks found by themselves, as pure functions (no provider needed).

The property: a world of W ranks reads part of an epoch (each rank a prefix of its slice), saves
its cursors, and a world of W' ranks resumes from them; every sample of the epoch is then read
exactly once — by the old world or by the new — and the next epoch is whole on the new world.
"""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libbus.errors import BadRequest
from libbus.loader.ranks import detect
from libbus.order import elastic
from libbus.order.epochs import Order, epoch_order


def world(n: int, size: int, **kw) -> list[Order]:
    return [Order(n=n, rank=r, world_size=size, **kw) for r in range(size)]


def json(value):
    """As stored in a checkpoint."""
    return orjson.loads(orjson.dumps(value))


def consume(orders: list[Order], epoch: int, plan, positions: list[int]) -> tuple[list[int], list[dict]]:
    """Each rank reads ``positions[r]`` samples; what they read, and their saved cursors."""
    read, states = [], []
    for order, p in zip(orders, positions):
        mine = elastic.indices(order, epoch, plan)
        p = min(p, len(mine))
        read += mine[:p].tolist()
        states.append(json(elastic.state(order, epoch, p, plan)))
    return read, states


def resume(orders: list[Order], saved) -> tuple[list[int], int]:
    """Each new rank restores ``saved`` and reads the rest of its epoch; what they read of the
    earliest epoch any rank is in, and that epoch (a rank whose slice was done is in the next)."""
    at = [elastic.restore(order, saved) for order in orders]
    first = min(epoch for epoch, _, _ in at)
    read = []
    for order, (epoch, position, plan) in zip(orders, at):
        if epoch == first:
            read += elastic.indices(order, epoch, plan)[position:].tolist()
    return read, first


sizes = st.integers(1, 5)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 60),
    old=sizes,
    new=sizes,
    data=st.data(),
    shuffle=st.sampled_from(["none", "full", "block"]),
    merged=st.booleans(),
)
def test_every_sample_once_after_resuming_at_another_world_size(n, old, new, data, shuffle, merged):
    kw = dict(seed=3, shuffle=shuffle, block_size=4)
    before = world(n, old, **kw)
    positions = [data.draw(st.integers(0, n)) for _ in range(old)]
    read, states = consume(before, 2, None, positions)
    saved = elastic.merge(before[0], states) if merged else states
    after = world(n, new, **kw)
    rest, epoch = resume(after, json(saved))
    if epoch == 3:  # the epoch was over: the new world reads the next one, whole
        assert len(read) == n and sorted(rest) == list(range(n))
    else:
        assert epoch == 2
        assert sorted(read + rest) == list(range(n)), "a sample lost or read twice"


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 50), sizes=st.lists(st.integers(1, 4), min_size=2, max_size=4), data=st.data())
def test_resuming_again_and_again_still_reads_each_sample_once(n, sizes, data):
    """W -> W' -> W'' ... within one epoch: the plan of what is left carries over."""
    read, states = [], None
    for size in sizes:
        orders = world(n, size, seed=1)
        at = [elastic.restore(o, states) if states else (0, 0, None) for o in orders]
        states = []
        for order, (epoch, position, plan) in zip(orders, at):
            mine = elastic.indices(order, epoch, plan) if epoch == 0 else []
            stop = data.draw(st.integers(position, len(mine))) if epoch == 0 else 0
            read += list(mine[position:stop])
            states.append(json(elastic.state(order, epoch, stop, plan)))
        if all(epoch == 1 for epoch, _, _ in at):
            break
    if not all(s["epoch"] == 1 for s in states):
        rest, epoch = resume(world(n, 2, seed=1), states)
        read += rest if epoch == 0 else []
    assert sorted(read) == list(range(n))


def test_one_rank_cursor_stands_for_ranks_in_lock_step():
    """Checkpointing usually keeps rank 0's cursor: in lock-step, every rank is at that position."""
    n = 103
    two = world(n, 2, seed=9, drop_uneven=True)
    read, states = consume(two, 0, None, [20, 20])
    rest, epoch = resume(world(n, 3, seed=9), states[0])
    assert epoch == 0
    # drop_uneven at W=2 left out the order's last sample; everything else is read exactly once
    left_out = epoch_order(n, epoch=0, seed=9, shuffle="full")[-1]
    assert sorted(read + rest + [int(left_out)]) == list(range(n))


def test_the_same_world_size_keeps_each_rank_at_its_own_position():
    two = world(40, 2, seed=2)
    _, states = consume(two, 1, None, [10, 10])
    assert elastic.restore(two[1], states[1]) == (1, 10, None)
    # the old form (version 1, written by earlier releases) is read as before
    assert elastic.restore(two[1], two[1].state(1, 10)) == (1, 10, None)


def test_equal_batch_counts_on_every_rank_by_default_under_drop_uneven():
    orders = world(101, 3, seed=0, batch_size=8, drop_uneven=True)
    assert len({o.num_batches() for o in orders}) == 1


def test_cursors_that_do_not_fit_are_refused_naming_why():
    two = world(40, 2, seed=2)
    _, states = consume(two, 0, None, [5, 5])
    three = Order(n=40, rank=0, world_size=3, seed=2)
    with pytest.raises(BadRequest, match="one loader state per rank 0..1, got ranks \\[0, 0\\]"):
        elastic.restore(three, [states[0], states[0]])  # a careless operator passes rank 0 twice
    with pytest.raises(BadRequest, match="seed was 2, is 5"):
        elastic.restore(Order(n=40, seed=5, world_size=3), states)
    with pytest.raises(BadRequest, match="rank 1 is 5 samples into epoch 1 while others are in 0"):
        elastic.restore(three, [states[0], {**states[1], "epoch": 1}])
    with pytest.raises(BadRequest, match="differ in epoch"):
        elastic.restore(three, [states[0], {**states[1], "epoch": 4}])
    with pytest.raises(BadRequest, match="ranges within 0..40"):
        elastic.restore(three, {**states[0], "version": 2, "plan": [[0, 400]]})
    with pytest.raises(BadRequest, match="mapping or a list"):
        elastic.restore(three, "epoch 0")


def test_ranks_come_from_the_launchers_variables():
    assert detect(environ={}) == detect(0, 1, environ={}).__class__(0, 1, 0, "single process")
    found = detect(environ={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert (found.rank, found.world_size, found.local_rank, found.source) == (1, 2, 1, "environment")
    assert detect(0, 4, environ={"RANK": "1", "WORLD_SIZE": "2"}).world_size == 4  # given wins


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"rank 2 \(RANK/WORLD_SIZE\) is outside a world of 2"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not an integer"),
        ({"RANK": "0"}, "WORLD_SIZE is not set while RANK is"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "world size 0"),
    ],
)
def test_a_careless_launch_is_refused_not_read_as_a_wrong_shard(env, message):
    with pytest.raises(BadRequest, match=message):
        detect(environ=env)
