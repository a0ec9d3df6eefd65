"""The relay's log bookkeeping alone (gradshare/task/tallies.py): epoch sums and what an attempt inherits."""

from __future__ import annotations

from gradshare.task.tallies import AttemptNotes, EpochTally
from gradshare.transport.protocol.step_meta import StepMeta


def test_attempt_notes_are_the_state_as_of_a_step():
    n = AttemptNotes(limit=3)
    n.add(4, StepMeta(loss=1.0))  # no note keys: nothing kept
    n.add(9, StepMeta(es_best=0.5, es_waited=0))
    n.add(19, StepMeta(es_waited=1, stop_epoch=1))
    assert n.entries == [(9, {"es_best": 0.5, "es_waited": 0.0}), (19, {"es_waited": 1.0, "stop_epoch": 1.0})]
    assert n.at(8) == () and n.at(9) == (("es_best", 0.5), ("es_waited", 0.0))
    assert n.at(30) == (("es_best", 0.5), ("es_waited", 1.0), ("stop_epoch", 1.0))
    n.cut(9)  # a rollback to step 9 forgets what came after
    assert n.at(30) == n.at(9)
    for t in (20, 21, 22):
        n.add(t, StepMeta(es_waited=t))
    assert len(n.entries) == 3 and n.dropped == 1 and n.at(30) == (("es_waited", 22.0),)


def test_epoch_tally_sums_a_ranks_steps():
    t = EpochTally(attempt=0)
    t.add(StepMeta(loss=2.0, sparsity=0.01, bytes=100.0, tau=0.1, lr=0.5), attempt=0)
    t.add(StepMeta(loss=1.0, sparsity=0.0, bytes=8.0, tau=0.2, lr=0.25), attempt=1)
    assert t.as_dict() == {
        "steps": 2,
        "loss": 3.0,
        "sparsity": 0.01,
        "payload": 108.0,
        "silent": 1,
        "tau": 0.2,
        "lr": 0.5,
        "val_metric": None,
        "resumed": True,
    }


def test_notes_a_relay_inherits_reach_its_first_attempts_welcome():
    """An elastic fit's next job: the relay starts with rank 0's early-stopping state of the job before it,
    and every peer's WELCOME hands it on; the relay reads it back through a step."""
    from harness import Sim, drive

    sim = Sim(world_size=2, seed=1, staleness=0)
    inherited = (("es_best", 0.25), ("es_waited", 2.0))
    sim.relay.inherit_notes(inherited)
    for r in range(2):
        sim.add_peer(r)
    drive(sim, lambda: all(p.welcome is not None for p in sim.peers.values()))
    assert all(dict(p.welcome.notes) == dict(inherited) for p in sim.peers.values())
    assert sim.relay.notes_at(-1) == inherited == sim.relay.notes_at(10)
