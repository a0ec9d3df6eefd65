"""Liveness in the relay core, in memory with a simulated clock: a silent rank is suspected,
not cut; what follows is the on_rank_loss policy; loading ranks and the join window; a stuck step."""

from __future__ import annotations

import re

import numpy as np

from gradshare.transport.protocol.peer.core import PeerCore
from harness import Sim, check_consistent, drive


def _exchange(sim: Sim, steps, ranks) -> None:
    for t in steps:
        for r in ranks:
            payload = b"\x00\x00\x80\x3f" + np.int32(t * 3 + r + 1).tobytes()
            sim.sent[(t, r)] = payload
            sim.peers[r].send_update(t, payload, None, sim.now)
        drive(sim, lambda: all(sim.peers[r].complete_through >= t for r in ranks))


def _joined(sim: Sim, world: int) -> None:
    for r in range(world):
        sim.add_peer(r)
    drive(sim, lambda: all(p.state == "joined" for p in sim.peers.values()))


def _kinds(sim: Sim) -> list[str]:
    return [i.kind for i in sim.relay.liveness.incidents]


def test_a_paused_rank_is_suspected_waited_for_and_carries_on_with_nothing_lost():
    sim = Sim(world_size=3, seed=12, loss=0.02, liveness_timeout=0.5)  # on_rank_loss="wait": the default
    _joined(sim, 3)
    _exchange(sim, range(4), (0, 1, 2))
    sim.silent.add(2)  # the whole process stops: no heartbeat, nothing
    _exchange(sim, [], ())
    for r in (0, 1):
        payload = b"\x00\x00\x80\x3f" + np.int32(100 + r).tobytes()
        sim.sent[(4, r)] = payload
        sim.peers[r].send_update(4, payload, None, sim.now)
    t0 = sim.now
    drive(sim, lambda: sim.now - t0 > 2.5)  # 5x liveness_timeout
    assert _kinds(sim) == ["suspected"] and sim.relay.att.ranks[2].ended is None
    assert sim.relay.complete_through == 3  # the log waits for rank 2's step 4
    inc = sim.relay.liveness.incidents[0]
    assert (inc.rank, inc.step) == (2, 4) and 0.5 < inc.seconds < 0.7
    sim.silent.discard(2)  # SIGCONT
    sim.run(steps=8)
    check_consistent(sim)  # every (step, rank) exactly once, in order, everywhere
    assert sim.relay.complete_through == 7 and sim.relay.counts["gone"] == 0
    assert _kinds(sim) == ["suspected", "back"] and sim.relay.liveness.first_cause() is None


def test_wait_gives_up_after_its_bound_naming_rank_step_and_silence():
    sim = Sim(world_size=2, seed=3, liveness_timeout=0.2, give_up_after=1.0)
    _joined(sim, 2)
    _exchange(sim, range(2), (0, 1))
    sim.silent.add(1)
    drive(sim, lambda: sim.relay.liveness.fatal_incident() is not None)
    inc = sim.relay.liveness.fatal_incident()
    assert (inc.kind, inc.rank, inc.step) == ("silent", 1, 2) and 1.0 < inc.seconds < 1.2
    assert sim.relay.att.ranks[1].ended is None  # waited for, never cut
    assert re.match(r"rank 1 \(attempt 0, at step 2\) silent for 1\.\d s: the relay gave up", inc.describe())
    assert sim.relay.liveness.first_cause().kind == "suspected" and sim.relay.liveness.first_cause().rank == 1


def test_continue_cuts_the_silent_rank_and_says_so():
    sim = Sim(world_size=2, seed=4, liveness_timeout=0.3, on_rank_loss="continue")
    _joined(sim, 2)
    _exchange(sim, range(2), (0, 1))
    sim.silent.add(1)
    drive(sim, lambda: 1 in sim.relay.att.cursor.ends)
    assert _kinds(sim) == ["suspected", "gone"] and sim.relay.att.ranks[1].ended.last_step == 1
    assert "on_rank_loss='continue'" in sim.relay.liveness.incidents[1].detail


def test_restart_rejects_every_live_rank_so_that_spark_retries_the_stage():
    sim = Sim(world_size=3, seed=5, liveness_timeout=0.3, on_rank_loss="restart")
    _joined(sim, 3)
    _exchange(sim, range(2), (0, 1, 2))
    sim.silent.add(2)
    drive(sim, lambda: all(sim.peers[r].state == "rejected" for r in (0, 1)))
    assert _kinds(sim) == ["suspected", "restart"] and sim.relay.att.ranks[2].ended is None
    assert "stage restart: rank 2 silent" in sim.peers[0].io.error and "at step 2" in sim.peers[1].io.error
    assert sim.relay.counts["gone"] == 0  # nothing cut: the retry resumes after step 1


def test_a_loading_rank_is_alive_and_an_unheard_one_gets_the_join_window():
    sim = Sim(world_size=2, seed=6, liveness_timeout=0.3, join_window=2.0)
    sim.add_peer(0)
    slow = PeerCore(1, 2, 0, sim.key, 42, sim.N, now=sim.now, datagram_size=sim.datagram_size)
    sim.peers[1], sim.params[1], sim.delivered[1] = slow, sim.p0.copy(), []
    slow.loading(sim.now)  # reading its partition: LOADING every 50 ms
    drive(sim, lambda: sim.now > 3.0)  # longer than liveness_timeout and the join window
    assert sim.relay.liveness.incidents == []
    slow.join(sim.now)
    sim.run(steps=3)
    check_consistent(sim)
    # a rank the relay never heard from is measured from the attempt's start, with the join window
    sim = Sim(world_size=2, seed=7, liveness_timeout=0.3, join_window=2.0)
    sim.add_peer(0)
    drive(sim, lambda: sim.relay.liveness.incidents != [])
    assert _kinds(sim) == ["suspected"] and sim.relay.liveness.incidents[0].rank == 1
    assert 2.0 < sim.now - sim.relay.att.started < 2.2


def test_a_training_thread_stuck_in_a_step_is_named_with_its_step():
    sim = Sim(world_size=2, seed=8, liveness_timeout=0.3, step_timeout=1.0)
    _joined(sim, 2)
    _exchange(sim, range(3), (0, 1))
    sim.peers[1].computing = 3  # forward of step 3 never returns; heartbeats go on
    sim.peers[0].computing = 3
    payload = b"\x00\x00\x80\x3f" + np.int32(7).tobytes()
    sim.peers[0].send_update(3, payload, None, sim.now)  # rank 0 finishes its step 3 (computing -> -1)
    t0 = sim.now
    drive(sim, lambda: sim.relay.liveness.fatal_incident() is not None)
    inc = sim.relay.liveness.fatal_incident()
    assert (inc.kind, inc.rank, inc.step) == ("stuck", 1, 3) and 1.0 < sim.now - t0 < 1.2
    assert "stuck in step 3" in inc.describe() and _kinds(sim) == ["stuck"]


def test_the_driver_reports_the_first_cause_before_the_last_symptom():
    from gradshare.driver.failures import driver_error as _driver_error
    from gradshare.errors import ProtocolError, TrainingError, TransportTimeout
    from gradshare.transport.protocol import events as ev

    class Relay:
        def __init__(self, cause):
            self.cause = cause

        def first_cause(self):
            return self.cause

    cut = ev.Incident("gone", 1, 0, 65, 2.1, 10.0, "silent for more than 1 s (liveness_timeout)")
    symptom = (
        "Job aborted: [gradshare rank 0] ProtocolError: peer rank 0: relay rejected rank 0 "
        "(attempt 3): rank 0 was declared gone at step 70\n"
    )
    err = _driver_error(ProtocolError(symptom), Relay(cut))
    assert isinstance(err, TrainingError)
    assert str(err).startswith("first cause: rank 1 (attempt 0, at step 65) declared gone after 2.1 s")
    assert "; worker rank 0 failed: ProtocolError: peer rank 0: relay rejected rank 0" in str(err)
    silent = ev.Incident("silent", 1, 0, 9, 60.2, 70.0)
    err = _driver_error(RuntimeError("Job aborted: stage failure\nSparkException: boom"), Relay(silent))
    assert isinstance(err, TransportTimeout) and "rank 1 (attempt 0, at step 9) silent for 60.2 s" in str(err)
