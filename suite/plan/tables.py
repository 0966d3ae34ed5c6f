"""What `suite plan` prints: the ranked table, why the winner wins, one layout's breakdown, JSON."""

from __future__ import annotations

from suite.plan import comm
from suite.plan.cost import GIB, Cost, at_time_share
from suite.plan.layout import Job
from suite.plan.params import count_params
from suite.plan.search import SearchResult

TIME_PARTS = {
    "compute": "compute",
    "tp": "tp comm",
    "cp": "cp comm",
    "ep": "ep all-to-all",
    "bubble": "pipeline bubble",
    "pp": "pp sends",
    "data": "data-parallel comm",
    "optimizer": "optimizer",
    "host": "host overhead",
    "offload": "host link (offload)",
}
MEMORY_PARTS = {
    "weights": "weights",
    "compute_copies": "compute copies",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations",
    "optimizer_work": "optimizer work",
}


def describe_job(job: Job) -> str:
    c = job.cluster
    return (
        f"{job.model.name} ({_count(job)} parameters), seq {job.seq_len}, global batch {job.global_batch}, "
        f"{job.precision} on {c.nodes} x {c.devices_per_node} {c.name} = {job.world} devices "
        f"({c.memory_gib - c.reserved_gib:.1f} GiB usable each"
        + (f", {c.host_memory_gib:g} GiB host memory per node" if c.host_memory_gib is not None else "")
        + (f"; {c.time_share:g} of a core per process: time-shared" if c.time_share < 1 else "")
        + ")"
    )


def host_per_node(job: Job, cost: Cost) -> float:
    """GiB of offloaded state on the worst rank's node: each of its ranks holds as much."""
    return cost.memory.host * job.cluster.devices_per_node / GIB


def _host_text(job: Job, cost: Cost) -> str:
    """`5204 GiB of host memory per node > 2048`: why an offloaded layout does not fit its node."""
    return f"{host_per_node(job, cost):.0f} GiB of host memory per node > {job.cluster.host_memory_gib:g}"


def leanest(job: Job, result: SearchResult) -> str:
    """Why nothing fits, from the layouts closest to it (for `suite plan`'s one line): the leanest
    on the device and, where offload would fit the device, the host memory it needs per node."""
    if not result.too_big:
        return ""
    lean = result.too_big[0]
    onto_host = [c for c in result.too_big if c.memory.fits_device]
    if not onto_host:
        return f"; the leanest, {lean.layout.name}, needs {lean.memory.total / GIB:.1f} GiB"
    least = min(onto_host, key=lambda c: c.memory.host)
    on_device = [c for c in result.too_big if not c.memory.host]
    kept = f"; without offload the leanest, {on_device[0].layout.name}, needs {on_device[0].memory.total / GIB:.1f} GiB"
    return (
        f"; offloaded, {least.layout.name} fits the devices ({least.memory.total / GIB:.1f} GiB) but not "
        f"host memory: {_host_text(job, least)} (cluster.host_memory_gib)" + (kept if on_device else "")
    )


def _count(job: Job) -> str:
    n = count_params(job.model)
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _mem(cost: Cost) -> str:
    m = cost.memory
    parts = (m.weights + m.compute_copies, m.gradients, m.optimizer, m.activations)
    return f"{m.total / GIB:6.1f} : " + "/".join(f"{p / GIB:.1f}" for p in parts)  # a peak, not their sum


def _time(cost: Cost) -> str:
    t = cost.time
    comm = t.tp + t.cp + t.ep + t.pp + t.data + t.offload
    return f"{t.total:8.3f} = {t.compute + t.host:.3f}/{comm:.3f}/{t.bubble:.3f}/{t.optimizer:.3f}"


def table(job: Job, result: SearchResult, rows: int = 10) -> str:
    """The ranked table and the reasons the winner wins."""
    lines = [describe_job(job)]
    counted = len(result.ranked) + len(result.too_big)
    host = sum(1 for c in result.too_big if c.memory.fits_device)
    lines.append(
        f"{counted + result.invalid} layouts: {result.invalid} refused by the trainer's checks, "
        f"{len(result.too_big)} do not fit"
        + (f" ({host} of them only for their offloaded state in host memory)" if host else "")
        + f", {len(result.ranked)} fit"
    )
    if not result.ranked:
        return "\n".join(lines)
    header = (
        f"{'#':>3} {'layout':34} {'memory GiB : w/g/opt/act':>26} {'step s = comp/comm/bubble/opt':>33}"
        f" {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6}"
    )
    lines += ["", header]
    for i, cost in enumerate(result.ranked[:rows], 1):
        lines.append(
            f"{i:>3} {cost.layout.name:34} {_mem(cost):>26} {_time(cost):>33} {cost.tokens_per_s:10.0f}"
            f" {cost.tflops_per_device:8.1f} {cost.mfu:6.1%}"
        )
    lines += ["", *why(job, result)]
    best = result.ranked[0]
    lines.append(f"run it: suite pretrain ... {best.layout.overrides(job.global_batch)}")
    return "\n".join(lines)


def why(job: Job, result: SearchResult) -> list[str]:
    """Why the winner wins: against the best layout of each other shape (degrees), the step-time
    parts where it gains most, and what it leaves in memory."""
    best = result.ranked[0]
    out = [
        f"winner {best.layout.name}: {best.time.total:.3f} s/step, {best.memory.total / GIB:.1f} GiB per device"
    ]
    seen = {_shape(best)}
    rivals = []
    for cost in result.ranked[1:]:
        if _shape(cost) not in seen:
            seen.add(_shape(cost))
            rivals.append(cost)
        if len(rivals) == 3:
            break
    for rival in rivals:
        gains = sorted(
            ((getattr(rival.time, k) - getattr(best.time, k), label) for k, label in TIME_PARTS.items()),
            reverse=True,
        )
        top = ", ".join(f"{label} {delta:+.3f} s" for delta, label in gains[:2] if delta > 0)
        slower = rival.time.total / best.time.total - 1
        out.append(
            f"  vs {rival.layout.name} ({slower:+.1%} step time): it spends more on {top or 'nothing'}"
        )
    if result.too_big:
        fastest_big = min(result.too_big, key=lambda c: c.time.total)
        if fastest_big.time.total < best.time.total:
            m = fastest_big.memory
            over = (
                f"{m.total / GIB:.1f} GiB > {m.capacity / GIB:.1f}"
                if not m.fits_device
                else _host_text(job, fastest_big)
            )
            out.append(
                f"  faster but out of memory: {fastest_big.layout.name} ({fastest_big.time.total:.3f} s, {over})"
            )
    return out


def _shape(cost: Cost) -> tuple:
    layout = cost.layout
    return (layout.dp, layout.sharding, layout.tp, layout.pp, layout.cp, layout.ep)


def explain(job: Job, cost: Cost) -> str:
    """One layout's breakdown: every memory and time part, throughput, the recipe keys."""
    m, t = cost.memory, cost.time
    lines = [describe_job(job), f"layout {cost.layout.name}: {cost.layout.overrides(job.global_batch)}", ""]
    lines.append(
        f"memory per device (worst rank): {m.total / GIB:.2f} GiB of {m.capacity / GIB:.2f} "
        f"({'fits' if m.fits_device else 'does NOT fit'}): the larger of backward's {m.backward / GIB:.2f} and the "
        f"optimizer step's {m.optimizer_step / GIB:.2f}"
    )
    for key, label in MEMORY_PARTS.items():
        lines.append(f"  {label:20} {getattr(m, key) / GIB:10.3f} GiB")
    if m.host:
        lines.append(f"  {'offloaded to host':20} {m.host / GIB:10.3f} GiB")
    lines.append(f"  parameters held: {cost.params_per_device:,}")
    if m.host:
        c, node = job.cluster, host_per_node(job, cost)
        head = f"host memory per node (its {c.devices_per_node} ranks' offloaded state): {node:.1f} GiB"
        if m.host_capacity is None:
            lines.append(f"{head}, not bounded (cluster.host_memory_gib is unset)")
        else:
            verdict = "fits" if m.fits_host else "does NOT fit: the search drops this layout"
            lines.append(f"{head} of {c.host_memory_gib:g} (cluster.host_memory_gib): {verdict}")
    lines.append(f"step time: {t.total:.4f} s ({cost.micro_batches} micro-batches per data rank)")
    for key, label in TIME_PARTS.items():
        value = getattr(t, key)
        lines.append(f"  {label:20} {value:10.4f} s  {value / t.total:6.1%}")
    lines.append(
        f"throughput: {cost.tokens_per_s:,.0f} tokens/s, {cost.tflops_per_device:.1f} TFLOP/s per device "
        f"(with recompute), MFU {cost.mfu:.1%}"
    )
    links = []
    for axis in (*comm.AXES, "ep"):
        link = comm.group_link(at_time_share(job.cluster), cost.layout, axis)  # as the step time saw it
        if link.ranks > 1:
            slower = "".join(f"; {name} x{f:g}" for name, f in link.per_collective if f != 1.0)
            links.append(
                f"{axis} {link.ranks} ranks on {link.name} ({link.bandwidth / 1e9:.1f} GB/s{slower})"
            )
    if links:
        lines.append("links: " + ", ".join(links))
    return "\n".join(lines)


def as_json(job: Job, result: SearchResult, rows: int = 50) -> dict:
    """The search for machines: the job, the counts, the ranked layouts (as Cost.as_dict)."""
    return {
        "job": describe_job(job),
        "world": job.world,
        "invalid": result.invalid,
        "too_big": len(result.too_big),
        "ranked": [c.as_dict() for c in result.ranked[:rows]],
        "overrides": result.ranked[0].layout.overrides(job.global_batch) if result.ranked else None,
    }
