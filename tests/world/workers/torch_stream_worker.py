"""Checks of the streamed hand-over (popmesh.torch.stream, hand_over, seed_newcomers) on a real world.

Every rank builds its model with :func:`build` from a seed that names its state (rank r: seed r + 1),
so a receiver rebuilds the donor's state locally and compares bits: parameters, buffers and the Adam
state, across float32, bfloat16 and int64, a tensor larger than a chunk, non-contiguous and empty
tensors.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from popmesh import ConfigError
from popmesh.population import Continuous, Explore
from popmesh.population.state.rejoin import seed_newcomers
from popmesh.torch import broadcast_optimizer_state, hand_over
from popmesh.torch.stream import stream_state_
from worldlib import check, main, need_ranks

torch.set_num_threads(1)
SMALL = 4096  # bytes per chunk: `wide` and `wide_t` (10 KiB) take three each, the small tensors share one
TIMEOUT = 20


class Model(torch.nn.Module):
    """float32, bfloat16 and int64 tensors; one larger than a chunk; non-contiguous and empty ones."""

    def __init__(self, out=5, extra=False):
        super().__init__()
        self.fc = torch.nn.Linear(8, out)
        self.brain = torch.nn.Parameter(torch.randn(3, 7).to(torch.bfloat16))
        self.wide = torch.nn.Parameter(torch.randn(64, 40))
        self.tall = torch.nn.Parameter(torch.randn(6, 10).t())  # (10, 6), strides (1, 10)
        self.wide_t = torch.nn.Parameter(torch.randn(40, 64).t())  # non-contiguous and larger than a chunk
        self.nothing = torch.nn.Parameter(torch.empty(0, 3))
        self.register_buffer("count", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("strided", torch.randn(8, 6)[:, ::2])
        self.register_buffer("none_yet", torch.empty(0))
        if extra:
            self.extra = torch.nn.Parameter(torch.zeros(2))

    def forward(self, x):
        return (self.fc(x).sum() + self.brain.float().sum() + 0.5 * self.wide.sum() + (self.tall ** 2).sum()
                + self.wide_t.sum() + self.nothing.sum())


def build(seed, **kwargs):
    """The model and Adam after one step, all from ``seed``: rebuilding it gives the same bits."""
    torch.manual_seed(seed)
    model = Model(**kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    model(torch.randn(4, 8)).backward()
    opt.step()
    model.count.fill_(seed)
    assert not any(t.is_contiguous() for t in (model.tall, model.wide_t, model.strided))
    return model, opt


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_state(model, opt, ref_model, ref_opt):
    ref_tensors = ref_model.state_dict(keep_vars=True)
    for name, a in model.state_dict(keep_vars=True).items():
        assert same(a, ref_tensors[name]), f"{name}: {a} != {ref_tensors[name]}"
    mine, ref = opt.state_dict(), ref_opt.state_dict()
    assert json.loads(json.dumps(mine["param_groups"])) == json.loads(json.dumps(ref["param_groups"]))  # tuples
    assert mine["state"].keys() == ref["state"].keys()
    for pid, entries in ref["state"].items():
        assert entries.keys() == mine["state"][pid].keys()
        for key, value in entries.items():
            assert same(mine["state"][pid][key], value), f"optimizer state {pid}/{key}"


@check
def one_donor_gives_every_rank_its_state_bit_for_bit(w):
    for chunk_bytes in (SMALL, None):  # many chunks (staged and direct), then one packed chunk
        model, opt = build(w.rank + 1)
        got = hand_over(model, opt, {"step": 7 + w.rank}, src=0, chunk_bytes=chunk_bytes, timeout=TIMEOUT)
        assert got == {"step": 7}
        assert_same_state(model, opt, *build(1))
        model(torch.randn(4, 8)).backward()  # the loaded state trains on
        opt.step()


@check
def a_lower_survivor_is_the_default_donor(w):
    need_ranks(w, 2)
    model, opt = build(w.rank + 1)
    if w.rank == 0:  # the newcomer's optimizer has no state yet: it is allocated from the metadata
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    held = [opt.state[p]["exp_avg"].data_ptr() for p in model.parameters()] if opt.state else None
    assert hand_over(model, opt, w.rank, newcomers=[0], timeout=TIMEOUT) == 1  # rank 0 is new: rank 1 gives
    assert_same_state(model, opt, *build(2))
    if held is not None:  # a rank that had state took the donor's in place
        assert [opt.state[p]["exp_avg"].data_ptr() for p in model.parameters()] == held


@check
def two_donors_share_the_chunks_for_the_newcomers(w):
    need_ranks(w, 3)
    newcomers = [1, 3] if w.size >= 4 else [2]
    donors = [r for r in range(w.size) if r not in newcomers][:2]
    seed = 50 + w.rank if w.rank in newcomers else 50 if w.rank in donors else 90  # donors hold one state
    model, opt = build(seed)
    assert hand_over(model, opt, "go", donors=2, newcomers=newcomers, chunk_bytes=SMALL, timeout=TIMEOUT) == "go"
    assert_same_state(model, opt, *build(90 if w.rank not in donors + newcomers else 50))


@check
def each_chunk_comes_from_the_donor_the_plan_names(w):
    need_ranks(w, 3)
    donors, receivers = [0, 1], list(range(2, w.size))
    mine = {"w": torch.full((5000,), float(w.rank + 1)), "i": torch.full((300,), w.rank + 1, dtype=torch.int64)}
    plan = stream_state_(mine, None, donors=donors, receivers=receivers, chunk_bytes=SMALL, timeout=TIMEOUT)
    if w.rank not in receivers:
        assert torch.equal(mine["w"], torch.full((5000,), float(w.rank + 1)))
        return
    got = {0: mine["w"], 1: mine["i"]}
    senders = dict(plan.receives_of(w.rank))
    assert set(senders.values()) == set(donors)
    for chunk in plan.chunks:
        for piece in chunk.pieces:
            values = got[piece.tensor][piece.start:piece.stop]
            assert bool((values == senders[chunk.index] + 1).all()), (chunk.index, senders[chunk.index], values)


@check
def a_different_shape_is_a_config_error_on_every_rank(w):
    need_ranks(w, 2)
    odd = w.size - 1
    model, opt = build(w.rank + 1, out=6 if w.rank == odd else 5)
    try:
        hand_over(model, opt, None, src=0, timeout=TIMEOUT)
    except ConfigError as e:
        text = str(e)
        assert f"rank {odd}: tensor 'fc.weight' is float32 (6, 8) here and float32 (5, 8) on the donor" in text, text
    else:
        raise AssertionError("a receiver with another shape must fail the hand-over on every rank")
    assert_same_state(model, opt, *build(w.rank + 1, out=6 if w.rank == odd else 5))  # nothing moved


@check
def a_different_name_is_a_config_error_on_every_rank(w):
    need_ranks(w, 2)
    model, opt = build(w.rank + 1, extra=w.rank == 1)
    try:
        hand_over(model, opt, None, src=0, timeout=TIMEOUT)
    except ConfigError as e:
        assert "rank 1: tensor 'extra' is here but not on the donor" in str(e), str(e)
    else:
        raise AssertionError("a receiver with another parameter must fail the hand-over on every rank")
    model, _ = build(w.rank + 1)
    try:  # the donor hands an optimizer over, a receiver passed none
        hand_over(model, None if w.rank == 1 else torch.optim.Adam(model.parameters()), None, timeout=TIMEOUT)
    except ConfigError as e:
        assert "rank 1: the donor hands over an optimizer and this rank passed None" in str(e), str(e)
    else:
        raise AssertionError("a receiver without the optimizer must fail the hand-over on every rank")
    model, opt = build(w.rank + 1)  # the world is still usable
    hand_over(model, opt, None, timeout=TIMEOUT)
    assert_same_state(model, opt, *build(1))


@check
def other_parameter_groups_are_a_config_error(w):
    need_ranks(w, 2)
    model, _ = build(w.rank + 1)
    params = list(model.parameters())
    groups = [{"params": params[:2]}, {"params": params[2:]}] if w.rank == 1 else [{"params": params}]
    try:
        broadcast_optimizer_state(torch.optim.SGD(groups, lr=0.1), 0, timeout=TIMEOUT)
    except ConfigError as e:
        assert "rank 1: the optimizer's parameter groups hold [2, 5] parameters here and [7] on the donor" in str(e)
    else:
        raise AssertionError("other parameter groups must fail on every rank")


@check
def optimizer_state_only_where_asked(w):
    need_ranks(w, 2)
    _, opt = build(w.rank + 1)
    broadcast_optimizer_state(opt, 0, load=w.rank != 1, timeout=TIMEOUT)
    keeps = 2 if w.rank == 1 else 1
    _, ref = build(keeps)
    for pid, entries in ref.state_dict()["state"].items():
        for key, value in entries.items():
            assert same(opt.state_dict()["state"][pid][key], value), (pid, key)


@check
def seed_newcomers_takes_the_mean_and_the_best_optimizer(w):
    need_ranks(w, 3)
    newcomer = w.size - 1
    model, opt = build(w.rank + 1)
    with torch.no_grad():
        for t in [*model.parameters(), model.strided]:
            t.fill_(w.rank + 1)
    seeding = seed_newcomers(model, opt, float(w.rank), {"it": w.rank}, donors=2, newcomers=[newcomer],
                             timeout=TIMEOUT)
    best, second = newcomer - 1, newcomer - 2
    assert seeding.donors == (best, second) and seeding.counters == {"it": best}
    want = (best + 1 + second + 1) / 2 if w.rank == newcomer else w.rank + 1
    for name, t in [*model.named_parameters(), ("strided", model.strided)]:
        assert bool((t.float() == want).all()), (name, t, want)
    _, ref = build((best if w.rank == newcomer else w.rank) + 1)
    for pid, entries in ref.state_dict()["state"].items():
        for key, value in entries.items():
            assert same(opt.state_dict()["state"][pid][key], value), (pid, key)


@check
def seed_newcomers_explores_what_a_newcomer_inherited(w):
    need_ranks(w, 3)
    newcomer = w.size - 1
    model, opt = build(w.rank + 1)
    opt.param_groups[0]["lr"] = 1e-3 * (w.rank + 1)
    explore = Explore(keys=("lr",), space={"lr": Continuous(1e-5, 1e-1, log=True)})
    seeding = seed_newcomers(model, opt, float(w.rank), {"iteration": 40}, donors=1, newcomers=[newcomer],
                             explore=explore, seed=7, timeout=TIMEOUT)
    best = newcomer - 1
    if w.rank != newcomer:  # the others keep their own values
        assert seeding.explored == {} and opt.param_groups[0]["lr"] == 1e-3 * (w.rank + 1)
        return
    _, ref = build(1)  # the donor's value moved by the same explore step: (seed, iteration, rank)
    ref.param_groups[0]["lr"] = 1e-3 * (best + 1)
    want = explore.apply(ref, 7, 40, newcomer)["lr"]
    assert seeding.explored == {"lr": want} and want[0] == 1e-3 * (best + 1), (seeding.explored, want)
    assert opt.param_groups[0]["lr"] == want[1] and 1e-5 <= want[1] <= 1e-1


@check
def seed_newcomers_explore_needs_the_optimizer(w):
    model, _ = build(w.rank + 1)
    try:
        seed_newcomers(model, None, 0.0, explore=Explore(), newcomers=[0], timeout=TIMEOUT)
    except ConfigError as e:
        assert "pass the optimizer" in str(e), e
    else:
        raise AssertionError("explore without an optimizer was accepted")


if __name__ == "__main__":
    main()
