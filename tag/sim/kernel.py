"""The compiled simulation kernel: one step's flows, collectives, list schedule and memory in one numba call.

``Simulator.evaluate`` spends its time in thousands of small Python steps per strategy (the list schedule,
transfers between layouts, collectives, activation memory; see docs/results/simulator.md). This module
moves all of them into one compiled function over flat arrays. What depends only on the graph, grouping
and topology is flattened once per ``Simulator`` (``tag.sim.kernel_state.KernelState``); what depends on
a strategy's actions (layouts, the routes between two layouts, collective coefficients) is still worked out
by the Python caches of ``tag.sim.layouts`` and ``tag.sim.routing`` the first time it is met and then
*registered* as rows of growing arrays, so later evaluations reuse it without Python work.

The model is the one of ``tag.sim.schedule.StepSchedule`` and ``tag.sim.memory.MemoryModel``, which stay
the reference (``TAG_SIM_KERNEL=python`` or ``Simulator(..., kernel="python")`` selects them; traces and
sufficient-factor broadcasting always use them). The kernel cuts the schedule into the same runs of
tasks as ``StepSchedule.run`` and computes them with the same operations, so step times equal the
reference's bit for bit (tests/test_sim_kernel.py); memory figures agree to rounding.

Example::

    import tag
    from tag.strategy.baselines import builtin_strategy
    from tag.strategy.grouping import group_ops
    from tag.sim import Simulator
    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    topo = tag.load_topology("topologies/a100-8x-nvlink.pbtxt")
    grouping = group_ops(tg, target_groups=8)
    fast = Simulator(tg, topo, grouping)                       # compiled kernel (numba), when installed
    ref = Simulator(tg, topo, grouping, kernel="python")
    s = builtin_strategy("ps", tg, topo, grouping)
    fast.kernel, fast.evaluate(s).step_time, ref.evaluate(s).step_time
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np

from tag.errors import StrategyError

ENV_VAR = "TAG_SIM_KERNEL"
KERNELS = ("compiled", "python")

MODE_CODE = {"allreduce": 0, "ps": 1, "partition": 2}
COLL_NONE, COLL_ALLREDUCE, COLL_PS = 0, 1, 2


_compiled = None        # the jitted _simulate, built on first use (numba's import takes about half a second)


def available() -> bool:
    """Whether the compiled kernel can run here (numba is installed)."""
    return importlib.util.find_spec("numba") is not None


def compiled_simulate():
    """The compiled ``_simulate`` (numba, cached on disk: the first call in a fresh install compiles it,
    about 10 s; later processes load it in well under a second)."""
    global _compiled
    if _compiled is None:
        from numba import njit
        try:
            _compiled = njit(cache=True, nogil=True)(_simulate)
        except RuntimeError:        # no writable cache directory anywhere: compile in every process
            _compiled = njit(cache=False, nogil=True)(_simulate)
    return _compiled


def choose_kernel(kernel: str | None) -> str:
    """The kernel a Simulator uses: KERNEL if given, else $TAG_SIM_KERNEL, else "compiled" where numba is
    installed (else "python")."""
    name = kernel if kernel is not None else os.environ.get(ENV_VAR, "").strip().lower() or None
    if name is None:
        return "compiled" if available() else "python"
    if name not in KERNELS:
        raise StrategyError(f"simulator kernel {name!r} is not one of {', '.join(KERNELS)} "
                            f"(argument kernel= or ${ENV_VAR})")
    if name == "compiled" and not available():
        raise StrategyError(f"simulator kernel 'compiled' needs numba, which does not import here "
                            f"(pip install numba, or ${ENV_VAR}=python)")
    return name


def _simulate(group_local, local_ai, local_rep, local_upd, task_override, nl, lane_of_device, static0, fuse_cap, w_coll,
              lane_start, resource_start, serial,
              task_group, task_stage, b_src, b_dst, b_same, b_own_pe, b_own_fx, b_own_n,
              sh_start, sh_tid, sh_pe, sh_fx, fwd_start, fwd_task, dep_start, dep_task, upd_start, upd_task,
              g_after, w_bytes, w_count, slot_bytes, state_bytes,
              live_src, live_last, live_pe, live_fx, work_fx, work_pe, device_memory, per_tensor, NR,
              a_mode, a_ps, a_dev_start, a_dev, a_ckind, a_c, a_res_start, a_res, a_pres_start, a_pres, a_place,
              l_start, i_lane, i_batch, i_row, dur, i_seconds, l_split, l_int_start, int_lane, int_f,
              pair_keys, pair_vals, m_dep_start, d_dl, d_sl, m_rt_start, r_lane, r_f):
    """One step (compiled by ``compiled_simulate``; arguments as ``KernelState.run`` passes them): flows between
    layouts, ps pulls, the list schedule with transfers and collectives, static and activation memory.
    Returns (layout pairs without registered routes (then nothing else is valid), step, comm bytes, start,
    finish, batch [lane, task], collective end per group, peak, static and activation bytes per device)."""
    T = task_group.shape[0]
    G = group_local.shape[0]
    pair_mask = pair_keys.shape[0] - 1
    B = b_src.shape[0]
    D = local_ai.shape[0]
    # ---- layout of every task
    task_layout = np.empty(T, np.int64)
    for t in range(T):
        if task_override[t] >= 0:
            task_layout[t] = task_override[t]
        else:
            loc = group_local[task_group[t]]
            task_layout[t] = local_upd[loc] if task_stage[t] == 2 else local_rep[loc]
    group_mode = np.empty(G, np.int64)
    for g in range(G):
        group_mode[g] = a_mode[local_ai[group_local[g]]]
    # ---- flows: tensors from a task to the tasks of one other layout (bundles sorted by producer)
    flow_src = np.empty(B, np.int64)
    flow_dst_layout = np.empty(B, np.int64)
    flow_wait_all = np.zeros(B, np.bool_)
    flow_pe = np.zeros(B)
    flow_fx = np.zeros(B)
    flow_n = np.zeros(B, np.int64)
    flow_move = np.full(B, -1, np.int64)
    bundle_flow = np.full(B, -1, np.int64)
    sent_tid = np.empty(sh_tid.shape[0], np.int64)      # shared tensors sent by the current producer
    sent_layout = np.empty(sh_tid.shape[0], np.int64)
    missing = np.empty(B, np.int64)
    num_missing = 0
    F = 0
    producer = -1
    producer_first_flow = 0
    num_sent = 0
    into_count = np.zeros(T + 1, np.int64)
    for b in range(B):
        k, t = b_src[b], b_dst[b]
        lk, ld = task_layout[k], task_layout[t]
        if lk == ld:
            continue
        if k != producer:
            producer = k
            producer_first_flow = F
            num_sent = 0
        wait_all = b_same[b] and group_mode[task_group[k]] == 1
        split = l_split[lk] or l_split[ld]
        m = -1
        if split:       # a flow per bundle: the split-task routes say which device sends what
            m = F
            F += 1
            flow_src[m] = k
            flow_dst_layout[m] = ld
            flow_wait_all[m] = wait_all
            flow_fx[m] = 1.0        # its routes carry fixed bytes (examples 0, copies = bytes)
            if not wait_all:
                key = -1 - ((b << 34) | (lk << 17) | ld)
                slot = (key ^ (key >> 17) ^ (key >> 31) ^ (key >> 47)) & pair_mask      # as _IntMap
                while pair_vals[slot] != -1 and pair_keys[slot] != key:
                    slot = (slot + 1) & pair_mask
                mi = pair_vals[slot]
                if mi < 0:
                    missing[num_missing] = key
                    num_missing += 1
                flow_move[m] = mi
            bundle_flow[b] = m
            into_count[t + 1] += 1
            continue
        for j in range(producer_first_flow, F):
            if flow_dst_layout[j] == ld and flow_wait_all[j] == wait_all:
                m = j
                break
        if m < 0:
            m = F
            F += 1
            flow_src[m] = k
            flow_dst_layout[m] = ld
            flow_wait_all[m] = wait_all
            if not wait_all:
                key = (lk << 32) | ld
                slot = (key ^ (key >> 17) ^ (key >> 31) ^ (key >> 47)) & pair_mask      # as _IntMap
                while pair_vals[slot] != -1 and pair_keys[slot] != key:
                    slot = (slot + 1) & pair_mask
                mi = pair_vals[slot]
                if mi < 0:
                    missing[num_missing] = key
                    num_missing += 1
                flow_move[m] = mi
        flow_pe[m] += b_own_pe[b]
        flow_fx[m] += b_own_fx[b]
        flow_n[m] += b_own_n[b]
        for s in range(sh_start[b], sh_start[b + 1]):
            tid = sh_tid[s]
            seen = False
            for j in range(num_sent):
                if sent_tid[j] == tid and sent_layout[j] == ld:
                    seen = True
                    break
            if not seen:
                sent_tid[num_sent] = tid
                sent_layout[num_sent] = ld
                num_sent += 1
                flow_pe[m] += sh_pe[s]
                flow_fx[m] += sh_fx[s]
                flow_n[m] += 1
        bundle_flow[b] = m
        into_count[t + 1] += 1
    empty2 = np.zeros((0, 0))
    empty1 = np.zeros(0)
    if num_missing:
        return missing[:num_missing], 0.0, 0.0, empty2, empty2, empty2, empty1, empty1, empty1, empty1
    # flows into each task (CSR) and out of each task (flows are numbered by producer)
    into_start = np.cumsum(into_count)
    into_flow = np.empty(into_start[T], np.int64)
    fill = into_start[:T].copy()
    for b in range(B):
        m = bundle_flow[b]
        if m >= 0:
            t = b_dst[b]
            into_flow[fill[t]] = m
            fill[t] += 1
    out_start = np.zeros(T + 1, np.int64)
    for m in range(F):
        out_start[flow_src[m] + 1] += 1
    for t in range(T):
        out_start[t + 1] += out_start[t]
    arrival = np.zeros((max(F, 1), nl))
    # ---- collectives: pulls now, all-reduces and pushes once their gradients are ready
    resource_free = resource_start.copy()   # a worker launches its part of the step first (tag.sim.host_cpu)
    lane_free = lane_start.copy()
    lane_mark = np.full(nl, -1, np.int64)  # the collective (its group) that last charged each lane (serial)
    release = np.zeros(T)
    task_finish = np.zeros(T)
    collective_end = np.zeros(G)
    coll_dur = np.zeros(G)
    coll_bytes = np.zeros(G)
    coll_on = np.zeros(G, np.bool_)
    comm = 0.0
    for g in range(G):
        ai = local_ai[group_local[g]]
        W = w_coll[g]
        if W <= 0 or a_mode[ai] == 2 or a_ckind[ai] == 0 or a_c[ai, 4] <= 0:
            continue
        if a_ckind[ai] == 2:
            d = a_c[ai, 0] + a_c[ai, 1] * W
            d += w_count[g] * a_c[ai, 5]         # seconds per variable (Routing.collective)
            st = 0.0
            for j in range(a_res_start[ai], a_res_start[ai + 1]):
                if resource_free[a_res[j]] > st:
                    st = resource_free[a_res[j]]
            end = st + d
            for j in range(a_res_start[ai], a_res_start[ai + 1]):
                resource_free[a_res[j]] = end
            comm += a_c[ai, 4] * W
            for j in range(fwd_start[g], fwd_start[g + 1]):
                if end > release[fwd_task[j]]:
                    release[fwd_task[j]] = end
        else:
            d = min(a_c[ai, 0] + a_c[ai, 1] * W, a_c[ai, 2] + a_c[ai, 3] * W)
        coll_dur[g] = d
        coll_bytes[g] = a_c[ai, 4] * W
        coll_on[g] = True
    # ---- fusion buckets (tag.strategy.fusion.fusion_buckets): all-reduce groups on one placement, the last
    # group first, a bucket closed at FUSE_CAP bytes; issued after its members' last gradient task
    leader = np.arange(G)
    members = np.ones(G, np.int64)
    issue = g_after.copy()
    if fuse_cap >= 0.0:
        open_leader = np.full(a_place.shape[0] + 1, -1, np.int64)
        open_bytes = np.zeros(a_place.shape[0] + 1)
        for g in range(G - 1, -1, -1):
            ai = local_ai[group_local[g]]
            if not coll_on[g] or a_ckind[ai] != 1:
                continue
            p = a_place[ai]
            if open_leader[p] < 0:
                open_leader[p] = g
            leader[g] = open_leader[p]
            open_bytes[p] += w_coll[g]
            if open_bytes[p] >= fuse_cap:
                open_leader[p] = -1
                open_bytes[p] = 0.0
        members[:] = 0
        wsum = np.zeros(G)
        last = np.full(G, -1, np.int64)
        for g in range(G):
            L = leader[g]
            members[L] += 1
            wsum[L] += w_coll[g]
            if g_after[g] > last[L]:
                last[L] = g_after[g]
        bad = np.zeros(G, np.bool_)       # an update task before the bucket's last gradient: no fusion
        for g in range(G):
            L = leader[g]
            if members[L] > 1:
                for q in range(upd_start[g], upd_start[g + 1]):
                    if upd_task[q] <= last[L]:
                        bad[L] = True
        for g in range(G):
            L = leader[g]
            if members[L] > 1 and bad[L]:
                leader[g] = g
        members[:] = 0
        for g in range(G):
            members[leader[g]] += 1
        for g in range(G):
            L = leader[g]
            if members[L] < 2:
                continue
            if L != g:
                coll_on[g] = False
                continue
            ai = local_ai[group_local[g]]
            W = wsum[g]
            coll_dur[g] = min(a_c[ai, 0] + a_c[ai, 1] * W, a_c[ai, 2] + a_c[ai, 3] * W)
            coll_bytes[g] = a_c[ai, 4] * W
            issue[g] = last[g]
    # the groups whose collective is issued after each task (task + 1 -> groups, ascending; CSR)
    dyn_start = np.zeros(T + 3, np.int64)
    for g in range(G):
        if coll_on[g]:
            dyn_start[issue[g] + 2] += 1
    for t in range(T + 2):
        dyn_start[t + 1] += dyn_start[t]
    dyn_group = np.empty(max(dyn_start[T + 2], 1), np.int64)
    fill = dyn_start.copy()
    for g in range(G):
        if coll_on[g]:
            dyn_group[fill[issue[g] + 1]] = g
            fill[issue[g] + 1] += 1
    # ---- the list schedule
    start = np.zeros((nl, T))
    finish = np.full((nl, T), -1.0)
    batch = np.zeros((nl, T))
    # runs: consecutive tasks on one layout, cut where tag.sim.schedule cuts them (before the first update
    # task, after an update task that issues a collective); transfers and collectives follow each run
    has_post = np.zeros(T, np.bool_)
    for t in range(T):
        for j in range(dyn_start[t + 1], dyn_start[t + 2]):
            if coll_on[dyn_group[j]]:
                has_post[t] = True
    t0 = 0
    while t0 < T:
        L = task_layout[t0]
        e = t0 + 1
        if not l_split[L]:
            while e < T and task_layout[e] == L and not (task_stage[e] == 2 and task_stage[e - 1] < 2) \
                    and not (task_stage[e - 1] == 2 and has_post[e - 1]):
                e += 1
        if not l_split[L] and (e - t0) * (l_start[L + 1] - l_start[L]) >= 8:
            # a long run: as tag.sim.schedule simulates it with numpy, f = C + running max of
            # (ready - C + d), C the cumulative durations (the same operations, so the same rounding)
            any_ready = False
            for k in range(t0, e):
                if release[k] != 0.0 or into_start[k + 1] > into_start[k]:
                    any_ready = True
            for k in range(t0, e):
                task_finish[k] = -np.inf
            for i in range(l_start[L], l_start[L + 1]):
                lane = i_lane[i]
                row = i_row[i]
                free = lane_free[lane]
                f = free
                cumulative = 0.0
                running = 0.0
                for k in range(t0, e):
                    d = dur[row, k]
                    if not any_ready:
                        f = d + free if k == t0 else f + d
                    else:
                        cumulative = d if k == t0 else cumulative + d
                        r = release[k]
                        for j in range(into_start[k], into_start[k + 1]):
                            x = arrival[into_flow[j], lane]
                            if x > r:
                                r = x
                        x = (r - cumulative) + d
                        if k == t0:
                            running = x if x >= free else free
                        elif x > running:
                            running = x
                        f = running + cumulative
                    start[lane, k] = f - d
                    finish[lane, k] = f
                    batch[lane, k] = i_batch[i]
                    if f > task_finish[k]:
                        task_finish[k] = f
                lane_free[lane] = f
        else:
            for k in range(t0, e):
                r0 = release[k]
                latest = 0.0
                if l_split[L]:      # the parts one after another, with transfers between them
                    first_inst = l_start[L]
                    internal = np.zeros(l_start[L + 1] - first_inst)
                    comm_task = 0.0
                    for p in range(l_start[L + 1] - first_inst):
                        i = first_inst + p
                        lane = i_lane[i]
                        r = r0
                        if internal[p] > r:
                            r = internal[p]
                        for j in range(into_start[k], into_start[k + 1]):
                            x = arrival[into_flow[j], lane]
                            if x > r:
                                r = x
                        s = lane_free[lane]
                        if r > s:
                            s = r
                        f = s + i_seconds[i]
                        lane_free[lane] = f
                        start[lane, k] = s
                        finish[lane, k] = f
                        batch[lane, k] = i_batch[i]
                        if f > latest:
                            latest = f
                        for q in range(l_int_start[L], l_int_start[L + 1]):
                            if int_lane[q, 0] != p:
                                continue
                            nb = int_f[q, 2]
                            comm_task += nb
                            r1, r2, r3 = int_lane[q, 2], int_lane[q, 3], int_lane[q, 4]
                            st = f
                            if resource_free[r1] > st:
                                st = resource_free[r1]
                            if r2 >= 0 and resource_free[r2] > st:
                                st = resource_free[r2]
                            if r3 >= 0 and resource_free[r3] > st:
                                st = resource_free[r3]
                            if r2 >= 0:     # between hosts: each NIC at its own rate, the link at the route's
                                resource_free[r1] = st + nb * int_f[q, 3]
                                resource_free[r2] = st + nb * int_f[q, 4]
                                st += nb * int_f[q, 1]
                                if r3 >= 0:
                                    resource_free[r3] = st
                            else:
                                st += nb * int_f[q, 1]
                                resource_free[r1] = st
                            st += int_f[q, 0]
                            dp = int_lane[q, 1]
                            if dp > p and st > internal[dp]:
                                internal[dp] = st
                    comm += comm_task
                else:
                    for i in range(l_start[L], l_start[L + 1]):
                        lane = i_lane[i]
                        r = r0
                        for j in range(into_start[k], into_start[k + 1]):
                            x = arrival[into_flow[j], lane]
                            if x > r:
                                r = x
                        s = lane_free[lane]
                        if r > s:
                            s = r
                        f = s + dur[i_row[i], k]
                        lane_free[lane] = f
                        start[lane, k] = s
                        finish[lane, k] = f
                        batch[lane, k] = i_batch[i]
                        if f > latest:
                            latest = f
                task_finish[k] = latest
        # (the collectives of groups with no task (-1) after the first run)
        for k in range(-1 if t0 == 0 else t0, e):
            # transfers out of task k, then the collectives it completes
            for m in range(out_start[k] if k >= 0 else 0, out_start[k + 1] if k >= 0 else 0):
                ld = flow_dst_layout[m]
                if flow_wait_all[m]:
                    for i in range(l_start[ld], l_start[ld + 1]):
                        arrival[m, i_lane[i]] = task_finish[k]
                    continue
                mi = flow_move[m]
                for j in range(m_dep_start[mi], m_dep_start[mi + 1]):
                    y = finish[d_sl[j], k]
                    if y > arrival[m, d_dl[j]]:
                        arrival[m, d_dl[j]] = y
                tensor_s = flow_n[m] * per_tensor
                pe, fx = flow_pe[m], flow_fx[m]
                nbytes = 0.0
                for j in range(m_rt_start[mi], m_rt_start[mi + 1]):
                    nb = pe * r_f[j, 2] + fx * r_f[j, 3]
                    if nb <= 0:
                        continue
                    nbytes += nb
                    sl, dl, r1, r2, r3 = r_lane[j, 0], r_lane[j, 1], r_lane[j, 2], r_lane[j, 3], r_lane[j, 4]
                    st = finish[sl, k]
                    if resource_free[r1] > st:
                        st = resource_free[r1]
                    if r2 >= 0:
                        if resource_free[r2] > st:
                            st = resource_free[r2]
                        if r3 >= 0 and resource_free[r3] > st:
                            st = resource_free[r3]
                        # each NIC is held at its own rate, the pair's link (and the transfer) at the route's
                        resource_free[r1] = st + nb * r_f[j, 4] + tensor_s
                        resource_free[r2] = st + nb * r_f[j, 5] + tensor_s
                        st += nb * r_f[j, 1] + tensor_s
                        if r3 >= 0:
                            resource_free[r3] = st
                    else:
                        st += nb * r_f[j, 1]
                        resource_free[r1] = st
                    st += r_f[j, 0]
                    if st > arrival[m, dl]:
                        arrival[m, dl] = st
                comm += nbytes
            for j in range(dyn_start[k + 1], dyn_start[k + 2]):
                g = dyn_group[j]
                if not coll_on[g]:
                    continue
                ai = local_ai[group_local[g]]
                st = 0.0
                fused = members[g] > 1
                for h in range(0 if fused else g, G if fused else g + 1):     # the bucket's members
                    if fused and leader[h] != g:
                        continue
                    for q in range(dep_start[h], dep_start[h + 1]):
                        if task_finish[dep_task[q]] > st:
                            st = task_finish[dep_task[q]]
                for q in range(a_pres_start[ai], a_pres_start[ai + 1]):
                    if resource_free[a_pres[q]] > st:
                        st = resource_free[a_pres[q]]
                end = st + coll_dur[g]
                if serial.shape[0] > 0:
                    # beside a CPU host's compute (StepSchedule._serialise): its lanes and the collective both wait
                    column = 1 if a_mode[ai] == 1 else 0
                    extra = 0.0
                    for q in range(a_dev_start[ai], a_dev_start[ai + 1]):
                        d = a_dev[q]
                        sigma = serial[d, column]
                        lane = lane_of_device[d]
                        if sigma <= 0 or lane_mark[lane] == g:      # a lane is charged once per collective
                            continue
                        lane_mark[lane] = g
                        busy = min(end, lane_free[lane]) - st
                        if busy > 0:
                            lane_free[lane] += sigma * busy
                            if sigma * busy > extra:
                                extra = sigma * busy
                    end += extra
                for q in range(a_pres_start[ai], a_pres_start[ai + 1]):
                    resource_free[a_pres[q]] = end
                comm += coll_bytes[g]
                if end > collective_end[g]:
                    collective_end[g] = end
                for h in range(0 if fused else g, G if fused else g + 1):
                    if fused and leader[h] != g:
                        continue
                    for q in range(upd_start[h], upd_start[h + 1]):
                        if end > release[upd_task[q]]:
                            release[upd_task[q]] = end
        t0 = e
    step = 0.0
    for lane in range(nl):
        if lane_free[lane] > step:
            step = lane_free[lane]
    for r in range(NR):
        if resource_free[r] > step:
            step = resource_free[r]
    for g in range(G):
        if collective_end[g] > step:
            step = collective_end[g]
    # ---- memory: static bytes per device, activation peak per lane
    num_devices = device_memory.shape[0]
    static = static0.copy()
    w_loc = np.zeros(D)
    s_loc = np.zeros(D)
    st_loc = np.zeros(D)
    for g in range(G):
        loc = group_local[g]
        w_loc[loc] += w_bytes[g]
        s_loc[loc] += slot_bytes[g]
        st_loc[loc] += state_bytes[g]
    for loc in range(D):
        ai = local_ai[loc]
        mode = a_mode[ai]
        if mode == 2:
            continue
        if mode == 1:
            x = 2 * w_loc[loc] + st_loc[loc]
            for j in range(a_dev_start[ai], a_dev_start[ai + 1]):
                static[a_dev[j]] += x
            static[a_ps[ai]] += 2 * w_loc[loc] + s_loc[loc]
        else:
            x = 2 * w_loc[loc] + s_loc[loc] + st_loc[loc]
            for j in range(a_dev_start[ai], a_dev_start[ai + 1]):
                static[a_dev[j]] += x
    peak_lane = np.zeros(nl)
    delta = np.empty(T + 1)
    R = live_src.shape[0]
    for lane in range(nl):
        delta[:] = 0.0
        for j in range(R):
            s = live_src[j]
            if finish[lane, s] >= 0:
                held = live_fx[j] + batch[lane, s] * live_pe[j]
                Ls = task_layout[s]
                if l_split[Ls]:
                    held = held / (l_start[Ls + 1] - l_start[Ls])
                delta[s] += held
                delta[live_last[j] + 1] -= held
        live = 0.0
        best = 0.0
        for t in range(T):
            live += delta[t]
            if finish[lane, t] >= 0:
                x = live + (work_fx[t] + batch[lane, t] * work_pe[t])
                if x > best:
                    best = x
        peak_lane[lane] = best
    activation = np.empty(num_devices)
    peak = np.empty(num_devices)
    for d in range(num_devices):
        activation[d] = peak_lane[lane_of_device[d]]
        peak[d] = static[d] + activation[d]
    return missing[:0], step, comm, start, finish, batch, collective_end, peak, static, activation
