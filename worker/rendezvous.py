"""How the machines of a multi-node job meet: torchrun's own c10d rendezvous, hosted by the leader's torchrun.

One definition of the torchrun flags every node of a gang starts with, so the leader and its members can
never disagree on the run id, the node counts or the timeouts.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rendezvous:
    """One attempt's rendezvous. `nodes_min < nodes_max`: elastic (torchrun restarts the ranks, from the last
    checkpoint, whenever a machine leaves or joins while at least `nodes_min` remain)."""

    endpoint: str  # host:port of the c10d store (the leader's torchrun hosts it)
    run_id: str  # <job id>-<attempt>: nodes of another attempt can never meet this one
    nodes_min: int
    nodes_max: int
    join_timeout_s: float
    max_restarts: int

    @property
    def elastic(self) -> bool:
        return self.nodes_min < self.nodes_max

    def torchrun_args(self, *, is_host: bool, local_addr: str) -> list[str]:
        """torchrun's flags for one node (`is_host`: the leader, which hosts the store)."""
        nnodes = f"{self.nodes_min}:{self.nodes_max}" if self.elastic else str(self.nodes_max)
        conf = f"join_timeout={max(1, round(self.join_timeout_s))},is_host={int(is_host)}"
        return [
            f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={conf}",
            f"--max-restarts={self.max_restarts if self.elastic else 0}",
            f"--local-addr={local_addr}",
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "run_id": self.run_id,
            "nodes_min": self.nodes_min,
            "nodes_max": self.nodes_max,
            "join_timeout_s": self.join_timeout_s,
            "max_restarts": self.max_restarts,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Rendezvous:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


def free_port() -> int:
    """A TCP port free on this machine now (torchrun binds it a moment later; a clash fails the attempt,
    and the next attempt picks another)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
