"""How a layout sits on nodes: refused node counts, warned tensor groups across nodes, and the
multi-node launch script's rendezvous checks (one sentence each, before any wait on torchrun): an
unreachable address, something that is not a rendezvous store on the port, node 0's own address."""

import os
import subprocess
import sys
import time

import pytest

from megapipe.errors import ConfigError
from megapipe.layout.nodes import check_nodes
from launch_helpers import REPO



@pytest.mark.unit
def test_a_node_count_the_layout_cannot_divide_names_the_node_count_to_launch():
    with pytest.raises(ConfigError) as error:
        check_nodes(6, 2, tensor=2, pipeline=2)  # 3 nodes of 2: 6 ranks, t x p = 4
    assert str(error.value) == ("3 nodes x 2 processes = 6 ranks is not divisible by --tensor-model-parallel-size 2 "
                                "x --pipeline-model-parallel-size 2 (= 4); launch 4 nodes, or change the parallel "
                                "sizes.")


@pytest.mark.unit
def test_a_tensor_group_across_nodes_is_warned_about_in_one_sentence():
    warning = check_nodes(8, 2, tensor=4, pipeline=1)
    assert warning.startswith("warning: --tensor-model-parallel-size 4 does not divide the 2 processes per node")
    assert warning.count(". ") == 0 and warning.endswith(".")
    assert check_nodes(8, 4, tensor=4, pipeline=2) is None  # inside a node
    assert check_nodes(4, 4, tensor=8, pipeline=1) is None  # one node: nothing to say


RENDEZVOUS_PORT = 29500
# a proxy on the rendezvous port: accepts every connection and answers it as HTTP
ANSWERS_HTTP = ("import socket, sys\nserver = socket.create_server(('', int(sys.argv[1])))\nwhile True:\n"
                "    connection = server.accept()[0]\n    connection.recv(64)\n"
                "    connection.sendall(b'HTTP/1.1 400 Bad Request\\r\\n\\r\\n')\n    connection.close()\n")


def _script(hosts, node: int, master: str, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, NNODES="2", NODE_RANK=str(node), MASTER_ADDR=master, RDZV_TIMEOUT=str(timeout))
    return hosts.run(node, ["bash", os.path.join(REPO, "examples", "train_gpt_multinode.sh")], env=env, timeout=60)


@pytest.mark.system
def test_the_launch_script_refuses_an_unreachable_rendezvous_within_its_timeout(make_test_hosts):
    hosts = make_test_hosts(2)
    nobody = hosts[0].address.rsplit(".", 1)[0] + ".200"  # on the hosts' network, but no host has it
    start = time.monotonic()
    result = _script(hosts, 1, nobody, timeout=3)
    assert result.returncode == 2 and time.monotonic() - start < 30
    assert result.stderr.strip() == (f"error: the rendezvous endpoint MASTER_ADDR={nobody} port 29500 did not answer "
                                     "within RDZV_TIMEOUT=3 s; check that MASTER_ADDR is node 0's address and that "
                                     "node 0 has started.")
    proxy = hosts.popen(0, [sys.executable, "-c", ANSWERS_HTTP, str(RENDEZVOUS_PORT)])
    try:  # something else accepts on the rendezvous port: a bare connect would pass, the store's protocol does not
        result = _script(hosts, 1, hosts[0].address, timeout=3)
    finally:
        proxy.kill()
        proxy.wait()
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: MASTER_ADDR={hosts[0].address} port 29500 accepts connections but is not "
                                     "torchrun's rendezvous store (a proxy or another service answers there); set "
                                     "MASTER_ADDR to node 0's own address, or MASTER_PORT to a port free on node 0.")
    result = _script(hosts, 0, hosts[1].address, timeout=3)  # node 0 hosts the store: the address must be its own
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: MASTER_ADDR={hosts[1].address} is not an address of node 0, which hosts "
                                     "the rendezvous; set it to this node's address.")
