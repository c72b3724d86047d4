"""Communication: alpha-beta models of collectives, and the bandwidth a group sees from where its ranks sit.

Ranks are laid out with tp innermost, then cp, then dp, then pp (Megatron-LM's order), so a group's members
that share a node talk over NVLink and the rest over the network. A group that spans nodes runs a
hierarchical collective: a reduce-scatter inside the node, the inter-node collective on 1/g of the data over
each of the g NICs in parallel (one NIC per GPU), and an all-gather inside the node.

All sizes are bytes, all times seconds. Bus-bandwidth conventions follow nccl-tests (PERFORMANCE.md):
ring all-reduce moves 2(n-1)/n of the data per rank, reduce-scatter and all-gather (n-1)/n.
"""

from __future__ import annotations

from dataclasses import dataclass

from .specs import ClusterSpec, LinkSpec


@dataclass(frozen=True)
class Group:
    """A communication group: `size` ranks, `per_node` of them in each node they occupy."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return -(-self.size // self.per_node)


def group_of(cluster: ClusterSpec, size: int, stride: int) -> Group:
    """The placement of a group of `size` ranks whose members are `stride` ranks apart.

    With tp innermost, a tp group has stride 1, cp stride tp, dp stride tp*cp, pp stride tp*cp*dp.
    """
    g = cluster.gpus_per_node
    if size <= 1:
        return Group(1, 1)
    per_node = max(1, min(size, g // stride)) if stride < g else 1
    return Group(size, per_node)


def _bw(link: LinkSpec) -> float:
    return link.bandwidth_gbps * 1e9 * link.efficiency


def _alpha(cluster: ClusterSpec, link: LinkSpec, members: int = 2, pair: bool = False) -> float:
    """Latency of one message hop, plus the waits for a descheduled peer on an oversubscribed node: a peer is
    descheduled with the node's `descheduled_fraction` (`oversubscription_wait_us`, what collective
    micro-benchmarks see), and inside a training step a woken member of a collective over `members` of the node's
    processes also competes for a core with the processes outside it, which are computing
    (`step_wait_us` x `crowded_fraction(members)`; see ClusterSpec)."""
    if cluster.cores_per_node is None:  # accelerators: one process per device, nothing to wait for
        return link.latency_us * 1e-6
    wait = cluster.oversubscription_wait_us * cluster.member_descheduled_fraction(members) \
        + cluster.step_wait_us * cluster.crowded_fraction(members, pair)
    return (link.latency_us + wait) * 1e-6


def transfer_time(link: LinkSpec, nbytes: float) -> float:
    """Seconds a link spends moving `nbytes` at its reachable bandwidth (no latency): the part of a message
    during which its kernels work, rather than wait."""
    return nbytes / _bw(link)


def hop_latency(cluster: ClusterSpec, link: LinkSpec, members: int = 2) -> float:
    """Latency of one message hop on `link` of a collective over `members` ranks of a node (see _alpha)."""
    return _alpha(cluster, link, members)


def _ring(cluster: ClusterSpec, n: int, nbytes: float, link: LinkSpec, factor: float, members: int) -> float:
    """One ring collective moving factor*(n-1)/n of `nbytes` per rank, with n-1 (x factor) latency hops;
    `members`: the group's ranks on one node."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return factor * (n - 1) / n * nbytes / _bw(link) + factor * (n - 1) * _alpha(cluster, link, members)


def _hierarchical(cluster: ClusterSpec, grp: Group, nbytes: float, factor: float) -> float:
    """factor=2 for all-reduce, 1 for reduce-scatter / all-gather."""
    if grp.size <= 1:
        return 0.0
    intra = _ring(cluster, grp.per_node, nbytes, cluster.intra_node, factor, grp.per_node)
    inter = _ring(cluster, grp.nodes, nbytes / grp.per_node, cluster.inter_node, factor, grp.per_node)
    return intra + inter + skew_wait(cluster)


def peers_present(cluster: ClusterSpec) -> ClusterSpec:
    """`cluster` as a collective sees it when every member is already in it, none in the middle of its compute:
    no step wait and no skew wait (a micro-benchmark loop, the step's scalar all-reduces after the gradient
    reduction, the collectives that follow another with nothing in between). The same cluster where those waits
    do not apply (accelerators, where they are 0)."""
    if cluster.cores_per_node is None:
        return cluster
    return cluster.model_copy(update={"step_wait_us": 0.0, "skew_wait_us": 0.0})


def skew_wait(cluster: ClusterSpec) -> float:
    """Seconds a collective inside a training step waits for its last member on an oversubscribed node
    (`ClusterSpec.skew_wait_us`; 0 elsewhere)."""
    if cluster.cores_per_node is None:
        return 0.0
    return cluster.skew_wait_us * cluster.descheduled_fraction * 1e-6


def all_reduce(cluster: ClusterSpec, grp: Group, nbytes: float) -> float:
    return _hierarchical(cluster, grp, nbytes, 2.0)


def scalar_all_reduce(cluster: ClusterSpec, grp: Group) -> float:
    """An all-reduce of a few scalars (a loss, a squared norm) over `grp`. NCCL's ring pays its latency hops as any
    all-reduce does. Gloo's ring (gloo/allreduce.cc) splits the buffer into at least 2n segments and sends only
    the non-empty ones, so a scalar is one segment, reduced on its way and returned: two message latencies
    whatever n, and without the per-step waits for descheduled ring members (measured, this 2-core machine, 4
    gloo ranks: 1-2 float64 0.42-0.59 ms against 5-7 ms for 16 elements or 4 KB; 2 ranks 0.17-0.23 ms; session-10
    note on issue 13)."""
    if grp.size <= 1:
        return 0.0
    if cluster.backend != "gloo":
        return all_reduce(cluster, grp, 8.0)
    link = cluster.intra_node if grp.nodes <= 1 else cluster.inter_node
    return 2 * link.latency_us * 1e-6


def native_reduce_scatter(cluster: ClusterSpec) -> bool:
    """Whether the backend runs reduce-scatter as its own algorithm (NCCL) rather than a whole all-reduce (gloo)."""
    return cluster.backend != "gloo"


def reduce_scatter(cluster: ClusterSpec, grp: Group, nbytes: float) -> float:
    """`nbytes` is the full (unscattered) buffer.

    Gloo has no reduce-scatter algorithm (ProcessGroupGloo builds on gloo's allreduce/allgather/reduce/scatter
    only), so torch runs it as a full all-reduce and keeps its shard: priced as one. Measured with 2 gloo ranks on
    this machine, 16 KB-4 MB: reduce_scatter_tensor 1.3-5.9 ms vs all_reduce 0.8-3.6 ms (session-2 note on issue 2).
    """
    if not native_reduce_scatter(cluster):
        return all_reduce(cluster, grp, nbytes)
    return _hierarchical(cluster, grp, nbytes, 1.0)


def all_gather(cluster: ClusterSpec, grp: Group, nbytes: float) -> float:
    """`nbytes` is the full (gathered) buffer."""
    return _hierarchical(cluster, grp, nbytes, 1.0)


def all_to_all(cluster: ClusterSpec, grp: Group, nbytes: float) -> float:
    """Each rank sends (n-1)/n of its `nbytes` to the others; peers off the node go over its NIC."""
    n = grp.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    on_node = (grp.per_node - 1) / n * nbytes
    off_node = (n - grp.per_node) / n * nbytes
    # gloo posts every send and receive at once and waits for all of them: one latency, not one per peer
    # (measured, 4 gloo ranks on this 2-core machine, 4 KB-1 MB: all_to_all 0.6-1.5 ms against all_gather's
    # three ring steps 2.5-3.7 ms and all_reduce's six 4.5-7.4 ms; session-10 note on issue 13)
    hops_intra = min(1, grp.per_node - 1) if cluster.backend == "gloo" else grp.per_node - 1
    hops_inter = min(1, grp.nodes - 1) if cluster.backend == "gloo" else grp.nodes - 1
    t_intra = on_node / _bw(cluster.intra_node) + hops_intra * _alpha(cluster, cluster.intra_node, grp.per_node)
    t_inter = off_node / _bw(cluster.inter_node) + hops_inter * _alpha(cluster, cluster.inter_node, grp.per_node)
    return max(t_intra, t_inter) + skew_wait(cluster)


def p2p(cluster: ClusterSpec, nbytes: float, cross_node: bool) -> float:
    """One point-to-point message between neighbouring pipeline stages."""
    if nbytes <= 0:
        return 0.0
    link = cluster.inter_node if cross_node else cluster.intra_node
    return nbytes / _bw(link) + _alpha(cluster, link, 1 if cross_node else 2, pair=True)
