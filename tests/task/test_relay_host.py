"""Rank 0's side of the in-job relay without Spark (task/relay_host.py): the first state from a shipped file
checked against its digest, the relay's address gathered from rank 0's message, the executor's host read
from Spark's task infos."""

import hashlib
import json

import numpy as np
import pytest
from pyspark import SparkFiles

from gradshare.errors import ProtocolError
from gradshare.task.relay_host import HostedRelay, executor_host, gather_relay
from gradshare.transport import RelayTuning


def plan(**kw):
    return HostedRelay(
        **{
            **dict(
                initial=None,
                n_params=3,
                port=0,
                bind="127.0.0.1",
                tuning=RelayTuning(),
                scale=1.0,
                aggregator=None,
                inbox=None,
            ),
            **kw,
        }
    )


def test_the_first_state_comes_inline_or_from_its_file_and_a_changed_file_is_refused(tmp_path, monkeypatch):
    state = np.arange(5, dtype=np.float32)
    assert plan(initial=state).first_state() is state
    path = tmp_path / "gradshare-initial-7.npy"
    np.save(path, state, allow_pickle=False)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setattr(SparkFiles, "get", lambda name: str(tmp_path / name))
    got = plan(initial_file=(path.name, digest)).first_state()
    assert got.dtype == np.float32 and np.array_equal(got, state)
    np.save(path, state + 1, allow_pickle=False)  # another state under the same name
    with pytest.raises(ProtocolError, match="gradshare-initial-7.npy does not match its sha256"):
        plan(initial_file=(path.name, digest)).first_state()


class Ctx:
    def __init__(self, task, told, addresses=()):
        self.task, self.told, self.addresses = task, told, addresses

    def taskAttemptId(self):
        return self.task

    def allGather(self, message):
        return [json.dumps(m) if m is not None else message for m in self.told] if self.told else [message]

    def getTaskInfos(self):
        return [type("Info", (), {"address": a}) for a in self.addresses]


def test_every_rank_learns_rank_0s_relay_and_the_stage_attempt():
    told = [{"task": 12, "relay": ["10.0.0.5", 40123]}, None]  # None: this rank's own message
    attempt, address = gather_relay(Ctx(9, told), 1, None)
    assert attempt == 9 and address == ("10.0.0.5", 40123)
    attempt, address = gather_relay(Ctx(15, [{"task": 16, "relay": None}, None]), 1, None)  # the client's relay
    assert attempt == 15 and address is None


@pytest.mark.parametrize(
    "addresses, host", [(["10.1.2.3:41000", "10.1.2.4:41000"], "10.1.2.3"), (["[::1]:41000"], "::1"), ([], "127.0.0.1")]
)
def test_the_executor_host_is_sparks_address_for_the_task(addresses, host):
    assert executor_host(Ctx(0, [], addresses), 0) == host
