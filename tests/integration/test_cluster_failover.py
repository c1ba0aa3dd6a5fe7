"""One Redis Cluster master killed under load (a real 3-master Cluster with a replica each, on loopback):
the conversations on the other masters keep their reuse, the failed master's get it back once its replica
serves their slots, and only the failed master's breaker opens.

The killed master holds the decode engine's pin index too, so every conversation's pins are indexed on
it: their entries fail (the pins stay with their records, unindexed) while the records on the other
masters keep serving. ``cluster-node-timeout`` is 2 s here (Redis's default is 15 s) so that the failover
takes about 3 s instead of about 16; ``cluster-require-full-coverage no``, as docs/state-store.md asks of
a Cluster: with Redis's default every node refuses every key while one master is down.

On Sentinel the one master serves every conversation: killing it costs them all their store until
Sentinel promotes the replica (then the next skipped call finds the new master), and none a turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration import failover_load
from tests.integration.cluster import REAL_TIME, metric, start_cluster
from tests.integration.redis_topologies import ClusterSetup, redis_cluster_setup, redis_sentinel
from turnkv import launch

pytestmark = pytest.mark.integration
NODE_TIMEOUT_MS = 2000


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterSetup]:
    (tmp_path / "redis").mkdir()
    with redis_cluster_setup(
        tmp_path / "redis", replicas=1, node_timeout_ms=NODE_TIMEOUT_MS, full_coverage=False
    ) as setup:
        yield setup


def test_a_master_failover_costs_only_its_own_conversations(
    procs: list[launch.Running], tmp_path: Path, cluster: ClusterSetup
) -> None:
    gw = start_cluster(procs, tmp_path, redis_url=cluster.url)
    run = failover_load.run(gw, cluster, conversations=12, kill="index")
    victims = run.victims()
    assert victims and len(victims) < 12, run.master_of
    assert run.errors() == []  # every turn answered, during the failover too

    reused, turns = run.others_reuse()
    assert turns >= 6 * (12 - len(victims)) and reused >= 0.95 * turns, (reused, turns)

    # the failed master's conversations lost their store, then got it back
    lost = [s for s in run.after_kill(on_victim=True) if s.reason == failover_load.STORE_DOWN]
    assert {s.conversation for s in lost} == set(victims)
    for c in victims:
        answered, reused_again = run.recovery(c)
        assert answered is not None and reused_again is not None, c

    # only the failed master's breaker opened; once its slots moved it was forgotten
    victim = f"127.0.0.1:{run.victim}"
    log = [json.loads(x) for x in (tmp_path / "gateway.log").read_text().splitlines() if x.startswith("{")]
    assert {e["node"] for e in log if e.get("event") == "store.down"} == {victim}
    assert any(e.get("event") == "store.node_gone" and e["node"] == victim for e in log)
    assert metric(gw.gateway.url, "turnkv_store_up") == 1
    assert metric(gw.gateway.url, "turnkv_store_breaker_open", node=victim) == 0
    print(
        f"\nfailover {run.failed_over_s:.2f} s; others reused {reused}/{turns}; "
        + ", ".join(f"conv {c}: store {a:.2f} s, reuse {r:.2f} s" for c in victims for a, r in [run.recovery(c)])
    )


@REAL_TIME
def test_a_sentinel_master_killed_under_load_costs_reuse_until_the_replica_serves(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    # one master serves every conversation: all lose their store until Sentinel promotes the replica
    # (down-after 1 s here, Redis's example 30 s), none loses a turn, and each reuses again after
    (tmp_path / "redis").mkdir()
    with redis_sentinel(tmp_path / "redis", down_after_ms=1000) as sentinel:
        gw = start_cluster(procs, tmp_path, redis_url=sentinel.url)
        run = failover_load.run_sentinel(gw, sentinel, conversations=8)
        assert run.errors() == []
        lost = {s.conversation for s in run.after_kill(on_victim=True) if s.reason == failover_load.STORE_DOWN}
        assert lost == set(range(8))
        for c in range(8):
            answered, reused_again = run.recovery(c)
            assert answered is not None and reused_again is not None, c
        assert metric(gw.gateway.url, "turnkv_store_up") == 1
        # the calls the old master's breaker skipped asked Sentinel again, and went to the new master
        # through a breaker of its own, which never opened; the old one was forgotten
        old, new = f"127.0.0.1:{run.victim}", f"127.0.0.1:{sentinel.master.port}"
        log = [json.loads(x) for x in (tmp_path / "gateway.log").read_text().splitlines() if x.startswith("{")]
        assert {e["node"] for e in log if e.get("event") == "store.down"} == {old}
        assert any(e.get("event") == "store.master" and e["node"] == new and e["was"] == old for e in log)
        assert any(e.get("event") == "store.node_gone" and e["node"] == old for e in log)
        assert metric(gw.gateway.url, "turnkv_store_breaker_open", node=old) == 0
        print(
            f"\nsentinel failover {run.failed_over_s:.2f} s; "
            + ", ".join(f"conv {c}: store {a:.2f} s, reuse {r:.2f} s" for c in range(8) for a, r in [run.recovery(c)])
        )
