"""One simulated training step of a configuration on a workload: time, exposed communication, memory.

    step    = (forward + backward + exposed dp (lane waits and tail, ``flashpar.sim.zero``) + optimizer)
              x (1 + spread z(GPUs))   the wait for the slowest device (``flashpar.sim.sync``: ``sync_s``)
    no_comm = the same with every transfer skipped (what bench train's no-communication step runs)
    optimizer = (AdamW + gradient clipping) bytes per local parameter at memory bandwidth
                (``step.ADAMW_BYTES_PER_PARAM`` + ``step.CLIP_BYTES_PER_PARAM``)

Forward and backward are the units of ``flashpar.sim.zero`` (the pieces of ``flashpar.sim.step``); memory is
``flashpar.sim.memory``'s.  Tokens of a step: dp x batch x seq.
"""

from __future__ import annotations

from flashpar.sim import step
from flashpar.sim.memory import memory
from flashpar.sim.peers import Peer
from flashpar.sim.sync import factor
from flashpar.sim.workload import Workload
from flashpar.sim.zero import data_parallel, local_params


def optimizer_s(w: Workload, peer: Peer) -> float:
    """Seconds of gradient clipping and AdamW over the rank's parameters."""
    per_param = step.ADAMW_BYTES_PER_PARAM + step.CLIP_BYTES_PER_PARAM
    return w.cluster.device.memory_time(per_param * local_params(w, peer))


def simulate(w: Workload, peer: Peer, schedule: tuple[str, ...] | None = None) -> dict:
    """One step of ``peer`` on ``w``: times (seconds), exposed communication per parallelism, memory (GB), the
    ZeRO-3 schedule it ran (``schedule``: flashpar's per block; None: the configuration's own)."""
    cfg, hw = w.cfg, w.cluster.device
    dp = data_parallel(w, peer, schedule)
    opt = optimizer_s(w, peer)
    sync = (dp.total + opt) * (factor(w.layout.gpus, w.cluster.spread) - 1.0)
    step_s = dp.total + opt + sync
    exposed = {k: dp.fwd.exposed[k] + dp.bwd.exposed[k] for k in dp.fwd.exposed}
    exposed["dp"] += dp.exposed
    tokens = w.layout.dp * w.batch * w.seq
    flops = tokens * cfg.flops_per_token(w.keys_per_token)
    zero = None if step.is_torch(peer) else dp.schedule
    mem = memory(w, peer, step.kv_received(w, peer), zero)
    return {"step_s": step_s, "no_comm_s": dp.no_comm + opt, "sync_s": sync, "exposed": exposed,
            "forward_s": dp.fwd.total,
            "backward_s": dp.bwd.total, "optimizer_s": opt, "tail_s": dp.tail, "tokens_per_s": tokens / step_s,
            "mfu": flops / step_s / (hw.flops * w.layout.gpus), "memory": mem, "flops": flops,
            "schedule": dp.schedule}
