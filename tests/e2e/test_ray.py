"""Issue 46, acceptance 1: serving groups placed on a Ray cluster (`--distributed-executor-backend ray`).

A local multi-node Ray cluster (ray.cluster_utils: a head node and a second node with its own address, 127.0.0.2, each
its own raylet) takes two real servers in turn:
- tensor parallel 2 with STRICT_SPREAD puts its ranks on the two nodes (gloo across them) and serves greedy text equal
  to transformers'; once it stops, no shuttle actor or placement group is left in the cluster;
- `--data-parallel-size 2` puts one group on each node, and both serve; the second node is killed (its raylet and
  every process on it) during 30 streams: exactly the streams of the group there end with one error each, the others
  finish, the server keeps serving, and the group is placed again on the node that remains; after the cluster stops,
  no process of shuttle's is left.
Skipped where Ray is not installed (pip install 'shuttle[ray]').
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from tests.client import post_completion, stream_until_end
from tests.conftest import hf_greedy
from tests.e2e.test_data_parallel import HANG, LONG, health, per_group, wait_health
from tests.server import ShuttleServer, pid_alive

cluster_utils = pytest.importorskip("ray.cluster_utils")

SECOND_NODE_ADDRESS = "127.0.0.2"
LEFT_IN_CLUSTER = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
from ray._private import state
actors = [a for a in state.actors().values() if a["State"] != "DEAD"]
groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
print(json.dumps({"actors": len(actors), "placement_groups": len(groups)}))
"""


@pytest.fixture(scope="module")
def cluster():
    """A head node (2 CPUs: one group, and room to place a lost group again) and a second node (1 CPU)."""
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.second = cluster.add_node(num_cpus=1, node_ip_address=SECOND_NODE_ADDRESS)
    yield cluster
    cluster.shutdown()


def left_in_cluster(cluster) -> dict:
    """Live actors and placement groups in the cluster, counted from a driver of its own."""
    done = subprocess.run([sys.executable, "-c", LEFT_IN_CLUSTER, cluster.address], capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def ray_server(cluster, *args: str, **kwargs) -> ShuttleServer:
    return ShuttleServer("--distributed-executor-backend", "ray", "--ray-address", cluster.address, *args, **kwargs)


async def test_tensor_parallel_ranks_on_two_nodes_serve_exact_text(cluster):
    srv = ray_server(cluster, "-tp", "2", "--ray-placement-strategy", "STRICT_SPREAD")
    try:
        nodes = srv.ready_info["ray_nodes"]
        assert set(nodes) == {"worker", "worker1"} and nodes["worker"] != nodes["worker1"]
        assert cluster.second.node_id in nodes.values()
        prompts = [[1, 403, 407, 261, 378], [1, 50, 60, 70]]
        async with aiohttp.ClientSession() as session:
            results = await asyncio.gather(*(post_completion(session, srv.url, prompt=p, max_tokens=16, temperature=0,
                                                             return_token_ids=True) for p in prompts))
        assert [r["choices"][0]["token_ids"] for _, r in results] == [hf_greedy(p, 16) for p in prompts]
    finally:
        assert srv.stop() == 0
    assert left_in_cluster(cluster) == {"actors": 0, "placement_groups": 0}


async def test_a_lost_node_fails_only_its_groups_streams(cluster):
    srv = ray_server(cluster, "--data-parallel-size", "2", "--heartbeat-timeout", "5", step_delay=0.05)
    pids = []
    try:
        nodes = srv.ready_info["ray_nodes"]
        assert nodes["worker.0"] != nodes["worker.1"]  # one group on each node
        lost = 0 if nodes["worker.0"] == cluster.second.node_id else 1
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as session:
            _, before = await health(session, srv.url)
            started = [asyncio.Event() for _ in range(30)]
            tasks = [asyncio.create_task(stream_until_end(session, srv.url, LONG, event)) for event in started]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), HANG)
            body = await wait_health(session, srv.url, lambda c, b: sum(per_group(b, "num_running")) == 30)
            routed = [a - b for a, b in zip(per_group(body, "routed"), per_group(before, "routed"))]
            assert all(routed) and sum(routed) == 30, routed  # both groups serve
            pids = list(srv.pids.values())
            cluster.remove_node(cluster.second, allow_graceful=False)
            ends = await asyncio.gather(*tasks)
            errors = [e for e in ends if "error" in e[-1]]
            assert len(errors) == routed[lost], (routed, lost)  # exactly that group's streams
            for events in errors:  # one terminal error each
                assert events[-1]["error"]["code"] == 503 and all("error" not in e for e in events[:-1])
            for events in ends:
                if events not in errors:
                    assert events[-1]["choices"][0]["finish_reason"] == "length"
            fresh = await post_completion(session, srv.url, prompt=[1, 50, 60], max_tokens=3)
            assert fresh[0] == 200  # the server kept serving
            await wait_health(session, srv.url, lambda c, b: c == 200 and b["status"] == "ok")  # placed again
        srv.wait_restarts(1)
        assert any(f"engine of group {lost} restarts" in line and "Ray" in line for line in srv.output), srv.output
    finally:
        srv.stop()
    cluster.shutdown()
    assert not [pid for pid in pids + list(srv.pids.values()) if pid_alive(pid)]
