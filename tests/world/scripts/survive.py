"""A world that outlives a lost rank: ``survive.py STEPS VICTIM KILL_AT [VICTIM2 KILL_AT2]``.

Each step every rank all-reduces rank+1. VICTIM SIGKILLs itself at step KILL_AT (in its first
process only; with VICTIM2, that rank's restarted process dies again at KILL_AT2, or with KILL_AT2 =
-1 VICTIM2's first process dies as it learns of the loss, while the others re-form). Survivors catch
the PeerFailure, re-form the world with the restarted process, and the lowest rank furthest on hands
every rank its state; the newcomer takes it after init(). Each rank prints its generation, step and whether
every sum it saw was the closed form n(n+1)/2. With SURVIVE_OP=ring each step is a ring of messages
instead (rank r sends r+1 to its right and checks what its left sent), so the loss comes
mid-message. SURVIVE_STEP_S pauses after each step. With SURVIVE_MODE=carry-on the survivors work on
alone (``world.try_reform()``) until the restarted process waits; with SURVIVE_MODE=together they go
on as a group of their own (``world.survivors()``): each step an all-reduce and a ring of messages
over the group, checked against the group's own closed form, until the world re-forms. With
SURVIVE_KILL_FORMING=RANK:STAGE that rank's first process SIGKILLs itself while a re-formed
generation forms, after it checked in: at STAGE "checked-in" as it starts the process group (before
gloo has its address), at "published" right after gloo stored its address (the others may be
connecting to it), at "formed" once it formed, as the world exchanges host names in it. With
SURVIVE_STUCK_SEND=1 rank 0 has a send to VICTIM that never ends queued just before the kill (see
gloo_loses_a_send). SURVIVE_RESTART_DELAY_S holds a restarted process that long before init(), as a
slow import would: the survivors then surely work before it waits. GEN, KILLING, LOST and SURVIVORS
lines carry the time.
"""

import os
import signal
import sys
import time

import numpy as np

import popmesh

steps, victim, kill_at = (int(a) for a in sys.argv[1:4])
again = tuple(int(a) for a in sys.argv[4:6]) or None
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
STEP_S = float(os.environ.get("SURVIVE_STEP_S", "0"))  # a pause after each step: a run that lasts


def die_while_forming(rank: int, stage: str) -> None:
    """SIGKILL this process inside the next re-formed generation's init_process_group, at ``stage`` (or in
    the world's host names exchange right after, at "formed")."""
    import torch.distributed as dist

    class Killing(dist.Store):  # gloo sees the store through this: the process dies as it publishes
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def set(self, key, value):
            self.inner.set(key, value)
            if stage == "published":
                die(f"published:{key}")

        def get(self, key):
            return self.inner.get(key)

        def wait(self, keys, timeout=None):
            return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

        def add(self, key, amount):
            return self.inner.add(key, amount)

        def check(self, keys):
            return self.inner.check(keys)

        def compare_set(self, key, expected, desired):
            return self.inner.compare_set(key, expected, desired)

        def multi_get(self, keys):
            return self.inner.multi_get(keys)

        def multi_set(self, keys, values):
            return self.inner.multi_set(keys, values)

        def delete_key(self, key):
            return self.inner.delete_key(key)

        def num_keys(self):
            return self.inner.num_keys()

    def die(where: str) -> None:
        print(f"KILLING rank={rank} forming={where} t={time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if stage == "formed":  # the generation formed; its world dies with it as it exchanges host names
        from popmesh.comm.world import World

        exchange = World._gather_hostnames

        def gather_hostnames(self):
            if self.generation > 0:
                die("formed")
            return exchange(self)

        World._gather_hostnames = gather_hostnames
        return
    real = dist.init_process_group

    def init_process_group(*args, store=None, **kwargs):
        if isinstance(store, dist.PrefixStore):  # a re-formed generation (the first world has the plain store)
            if stage == "checked-in":
                die("checked-in")
            store = Killing(store)
        return real(*args, store=store, **kwargs)

    dist.init_process_group = init_process_group


def gloo_loses_a_send(to: int) -> None:
    """Stand in for a send gloo never ends: one it queued to retry as the connection to a dying rank
    broke, and did not signal when it then found the connection closed (seen on the survivors' path:
    their transport's close waited 7 s for it). Queued on the transport's own channel to ``to``, its
    wait never returns."""
    import threading

    from popmesh.engines.torch.send import TorchSend

    class NeverEnds:
        def wait(self, timeout):
            threading.Event().wait()

    box = world.engine.p2p()._outbox(to, 11)  # the transport's channel to ``to`` on tag 11
    box.push(TorchSend([NeverEnds()], [np.zeros(8, np.uint8)], False, box))


forming = os.environ.get("SURVIVE_KILL_FORMING")
if forming and restart == 0 and int(forming.split(":")[0]) == int(os.environ["RANK"]):
    die_while_forming(int(os.environ["RANK"]), forming.split(":")[1])
if restart > 0:
    time.sleep(float(os.environ.get("SURVIVE_RESTART_DELAY_S", "0")))
world = popmesh.init()
expected = world.size * (world.size + 1) / 2


def handoff(state: dict) -> dict:
    """Every rank takes the state of the rank furthest on (the lowest of them; a newcomer holds none, and one
    whose handover a second loss broke holds its first). A rank lost meanwhile makes the world form again
    with its restarted process, and the handover starts over."""
    while True:
        try:
            steps = popmesh.all_gather_object(-1 if world.rank in world.newcomers else state["step"], timeout=60)
            donor = steps.index(max(steps))
            print(f"GEN rank={world.rank} gen={world.generation} newcomers={list(world.newcomers)} donor={donor} "
                  f"t={time.time():.3f}", flush=True)
            return popmesh.broadcast_object(state if world.rank == donor else None, src=donor, timeout=60)
        except popmesh.PeerFailure as e:
            print(f"LOST-HANDING-OVER rank={world.rank} gen={world.generation}: {str(e)[:120]}", flush=True)
            world.reform(timeout=60)


def together(state: dict) -> None:
    """Go on with the other survivors as a group until the restarted process(es) wait to join."""
    group, n = world.survivors(timeout=60), 0
    print(f"SURVIVORS rank={world.rank} ranks={list(group.ranks)} t={time.time():.3f}", flush=True)
    if os.environ.get("SURVIVE_PROBE"):  # the world's own calls say to use the survivors' group
        for call in (lambda: popmesh.all_reduce(np.array([1.0]), timeout=5), lambda: world.new_group([0, 1])):
            try:
                call()
            except popmesh.PopmeshError as probe:
                print(f"PROBE rank={world.rank} {type(probe).__name__}: {probe}", flush=True)
    while world.try_reform(timeout=60) is None:
        try:
            total = popmesh.all_reduce(np.array([world.rank + 1.0]), group=group, timeout=60)
            ring = group.ranks[(group.group_rank + 1) % group.size], group.ranks[group.group_rank - 1]
            sending = popmesh.isend(np.array([world.rank + 1.0]), ring[0], tag=9, group=group, timeout=60)
            _, got = popmesh.recv(ring[1], tag=9, group=group, timeout=60)
            sending.wait()
        except popmesh.PeerFailure as e:
            if world.failure(group.ranks) is not None:  # a second loss among the survivors: a smaller group
                print(f"LOST-AGAIN rank={world.rank} n={n}: {str(e)[:120]}", flush=True)
                group = world.survivors(timeout=60)
                print(f"SURVIVORS rank={world.rank} ranks={list(group.ranks)}", flush=True)
            continue  # else a survivor left for the next generation: so will this one, once it sees it
        state["good"] = state["good"] and float(total[0]) == sum(r + 1 for r in group.ranks) \
            and float(got[0]) == ring[1] + 1
        n += 1
    print(f"TOGETHER rank={world.rank} n={n} good={state['good']}", flush=True)


state = {"step": 0, "good": True, "reforms": 0}
if world.newcomers:
    state = handoff(state)
while state["step"] < steps:
    dies = (world.rank == victim and restart == 0 and state["step"] == kill_at) or (
        again is not None and world.rank == again[0] and again[1] >= 0 and restart == 1 and state["step"] == again[1])
    if os.environ.get("SURVIVE_STUCK_SEND") and world.rank == 0 != victim and restart == 0 \
            and state["step"] == kill_at - 1:
        gloo_loses_a_send(victim)
    if dies:
        print(f"KILLING rank={world.rank} t={time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        if os.environ.get("SURVIVE_OP") == "ring":
            left, right = (world.rank - 1) % world.size, (world.rank + 1) % world.size
            sending = popmesh.isend(np.array([world.rank + 1.0, state["step"]]), right, tag=7, timeout=60)
            _, got = popmesh.recv(left, tag=7, timeout=60)
            sending.wait()
            total = np.array([expected]) if float(got[0]) == left + 1 and got[1] == state["step"] else got
        else:
            total = popmesh.all_reduce(np.array([world.rank + 1.0]), timeout=60)
    except popmesh.PeerFailure as e:
        print(f"LOST rank={world.rank} step={state['step']} t={time.time():.3f}: {str(e)[:120]}", flush=True)
        if again is not None and again[1] == -1 and world.rank == again[0] and restart == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # a second loss while the world re-forms
        if os.environ.get("SURVIVE_MODE") == "together":
            together(state)
        elif os.environ.get("SURVIVE_MODE") == "carry-on":  # train on alone until the restarted process waits
            alone = 0
            while world.try_reform(timeout=60) is None:
                alone += 1
                time.sleep(0.01)  # this rank's own work, with no peer
                if alone == 1 and os.environ.get("SURVIVE_PROBE"):
                    try:
                        popmesh.all_reduce(np.array([1.0]), timeout=5)
                    except popmesh.PopmeshError as probe:
                        print(f"PROBE rank={world.rank} {type(probe).__name__}: {probe}", flush=True)
            print(f"ALONE rank={world.rank} n={alone}", flush=True)
        else:
            world.reform(timeout=60)
        state = handoff(state)
        state["reforms"] += 1
        continue
    state["good"] = state["good"] and float(total[0]) == expected
    state["step"] += 1
    time.sleep(STEP_S)
print(f"DONE rank={world.rank} gen={world.generation} step={state['step']} good={state['good']} "
      f"restart={restart}", flush=True)
world.finalize()
