"""The compiled kernel's state on the Python side: the flat task graph and the registries it grows.

``KernelState`` flattens what depends only on the graph, grouping and topology once per ``Simulator``, and
registers layouts, routes between layouts and actions (collective coefficients, placements) as rows of
growing arrays the first time an evaluation meets them; ``KernelState.run`` passes them to the compiled
step of ``tag.sim.kernel``. Split from that module so each stays one concern: this one plain Python and
numpy, that one the numba function.

Example::

    import tag
    from tag.sim import Simulator
    from tag.strategy.grouping import group_ops
    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    sim = Simulator(tg, tag.load_topology("topologies/a100-8x-nvlink.pbtxt"), group_ops(tg, target_groups=8))
    sim.kernel                 # "compiled" when numba is installed: evaluations go through a KernelState
"""
from __future__ import annotations

import numpy as np

from tag.sim.kernel import COLL_ALLREDUCE, COLL_NONE, COLL_PS, MODE_CODE, compiled_simulate


class _IntMap:
    """int64 -> non-negative int64 as an open-addressing hash table in two numpy arrays, which the kernel
    probes the same way (``_slot``; value -1: empty). numba's typed dict would do, but creating and filling
    the first one costs over a second per process."""

    def __init__(self, capacity: int = 1024):
        self.keys = np.zeros(capacity, dtype=np.int64)
        self.vals = np.full(capacity, -1, dtype=np.int64)
        self.size = 0

    @staticmethod
    def _slot(key: int, mask: int) -> int:
        return (key ^ (key >> 17) ^ (key >> 31) ^ (key >> 47)) & mask

    def _find(self, key: int) -> int:
        keys, vals = self.keys, self.vals
        mask = len(keys) - 1
        i = self._slot(key, mask)
        while vals[i] != -1 and keys[i] != key:
            i = (i + 1) & mask
        return i

    def __contains__(self, key: int) -> bool:
        return self.vals[self._find(key)] != -1

    def __setitem__(self, key: int, value: int) -> None:
        if 2 * (self.size + 1) > len(self.keys):            # keep it at most half full
            old = [(int(k), int(v)) for k, v in zip(self.keys, self.vals, strict=True) if v != -1]
            self.keys = np.zeros(2 * len(self.keys), dtype=np.int64)
            self.vals = np.full(2 * len(self.vals), -1, dtype=np.int64)
            self.size = 0
            for k, v in old:
                self[k] = v
        i = self._find(key)
        if self.vals[i] == -1:
            self.size += 1
        self.keys[i] = key
        self.vals[i] = value


class _Rows:
    """A growing numpy array (amortised doubling); ``buf`` is passed to the kernel whole."""

    def __init__(self, dtype, width: int = 0, fill=0):
        self.width, self.fill, self.size = width, fill, 0
        shape = (16, width) if width else (16,)
        self.buf = np.full(shape, fill, dtype=dtype)

    def extend(self, values) -> int:
        """Append VALUES (rows); returns the index of the first."""
        values = np.asarray(values, dtype=self.buf.dtype)
        n = len(values)
        first = self.size
        if first + n > len(self.buf):
            cap = max(2 * len(self.buf), first + n)
            grown = np.full((cap, self.width) if self.width else (cap,), self.fill, dtype=self.buf.dtype)
            grown[:first] = self.buf[:first]
            self.buf = grown
        self.buf[first:first + n] = values
        self.size = first + n
        return first


def _csr(lists: list, dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
    """(starts, flat values) of a list of lists."""
    starts = np.zeros(len(lists) + 1, dtype=np.int64)
    starts[1:] = np.cumsum([len(x) for x in lists]) if lists else []
    flat = np.array([v for x in lists for v in x], dtype=dtype)
    return starts, flat


class KernelState:
    """The flat arrays of one Simulator (task graph, memory rows) and the registries of layouts, routes
    between layouts and actions that the kernel reads; ``run`` simulates one strategy."""

    MAX_LAYOUTS = 50000         # registry bound: past it, start afresh (like LayoutCache's bound)

    def __init__(self, tasks, memory, routing, device_memory: np.ndarray):
        self.tasks, self.routing = tasks, routing
        T, G = tasks.num_tasks, tasks.num_groups
        self.T, self.G = T, G
        self.num_resources = len(routing.resource_names)
        self.task_group = np.asarray(tasks.task_group, dtype=np.int64)
        self.task_stage = np.asarray(tasks.task_stage, dtype=np.int64)
        self.b_src = np.asarray(tasks.bundle_src, dtype=np.int64)
        self.b_dst = np.asarray(tasks.bundle_dst, dtype=np.int64)
        self.b_same = np.asarray(tasks.bundle_same_group, dtype=np.bool_)
        own = np.asarray(tasks.bundle_own, dtype=np.float64).reshape(-1, 2)
        self.b_own_pe, self.b_own_fx = own[:, 0].copy(), own[:, 1].copy()
        self.b_own_n = np.asarray(tasks.bundle_own_tensors, dtype=np.int64)
        self.sh_start, self.sh_tid = _csr([[s[0] for s in x] for x in tasks.bundle_shared])
        _, self.sh_pe = _csr([[s[1] for s in x] for x in tasks.bundle_shared], np.float64)
        _, self.sh_fx = _csr([[s[2] for s in x] for x in tasks.bundle_shared], np.float64)
        self.fwd_start, self.fwd_task = _csr(tasks.forward_tasks)
        self.dep_start, self.dep_task = _csr(tasks.coll_deps)
        self.upd_start, self.upd_task = _csr(tasks.update_tasks)
        self.g_after = np.asarray(tasks.coll_after, dtype=np.int64)    # group -> task its collective follows
        self.w_bytes = np.asarray(memory.weight_bytes, dtype=np.float64)
        self.w_count = np.asarray(memory.weight_count_list, dtype=np.int64)
        self.slot_bytes = np.asarray(memory.slot_bytes, dtype=np.float64)
        self.state_bytes = np.asarray(memory.state_bytes, dtype=np.float64)
        self.live_src = np.asarray(memory.live_src_task, dtype=np.int64)
        self.live_last = np.asarray(memory.live_last_task, dtype=np.int64)
        self.live_pe = np.asarray(memory.live_per_example, dtype=np.float64)
        self.live_fx = np.asarray(memory.live_fixed, dtype=np.float64)
        self.work_fx = np.asarray(memory.working_fixed, dtype=np.float64)
        self.work_pe = np.asarray(memory.working_per_example, dtype=np.float64)
        self.device_memory = np.asarray(device_memory, dtype=np.float64)
        self.per_tensor = float(routing.cost.per_tensor_s)
        self.no_override = np.full(T, -1, dtype=np.int64)
        self.static_zero = np.zeros(len(device_memory))
        self.no_serial = np.zeros((0, 2))    # no synchronisation charged beside compute: the kernel skips it
        self._reset_registries()

    def _reset_registries(self) -> None:
        T = self.T
        self._args: tuple | None = None         # the kernel's registry arguments (None: rebuild)
        # layouts: dense index -> its lane instances (lane, batch, row of the duration table)
        self.layout_index: dict[int, int] = {}            # Layout.id -> dense index
        self.l_start = _Rows(np.int64)
        self.l_start.extend([0])
        self.i_lane, self.i_batch, self.i_row = _Rows(np.int64), _Rows(np.float64), _Rows(np.int64)
        self.i_seconds = _Rows(np.float64)                # a split task's part: its duration (i_row is -1)
        self.l_split = _Rows(np.bool_)                    # layout -> a partition task split over devices
        # transfers between the parts of a split task: (src part, dst part, resource 1, resource 2 or -1)
        # and (latency, s/byte, bytes), per layout (CSR)
        self.l_int_start = _Rows(np.int64)
        self.l_int_start.extend([0])
        # (src part, dst part, resource 1, resource 2 or -1, link or -1); (latency, s/byte, bytes, send s/byte,
        # receive s/byte): the NIC sides are held at their own rates (tag.sim.routing.Routing.link_holds)
        self.int_lane = _Rows(np.int64, width=5)
        self.int_f = _Rows(np.float64, width=5)
        self._row_of: dict[int, int] = {}                  # id(duration array) -> row
        self._row_arrays: list[np.ndarray] = []            # keeps those arrays alive (ids stay unique)
        self.dur = _Rows(np.float64, width=max(T, 1))
        self._layouts: list = []                           # dense index -> Layout
        # routes between two layouts: pair key -> dense index; deps (dst lane, src lane) and routes
        self.pair_index = _IntMap()
        self.m_dep_start, self.m_rt_start = _Rows(np.int64), _Rows(np.int64)
        self.m_dep_start.extend([0])
        self.m_rt_start.extend([0])
        self.d_dl, self.d_sl = _Rows(np.int64), _Rows(np.int64)
        # per route: (src lane, dst lane, resource 1, resource 2 or -1, link or -1)
        self.r_lane = _Rows(np.int64, width=5)
        # per route: (latency, s/byte, examples, whole copies, send s/byte, receive s/byte)
        self.r_f = _Rows(np.float64, width=6)
        self.num_moves = 0
        # actions: dense index -> mode, ps device, devices, collective coefficients and resources
        self.action_index: dict = {}                       # Action -> dense index
        self.a_mode, self.a_ps, self.a_ckind = _Rows(np.int64), _Rows(np.int64), _Rows(np.int64)
        self.a_c = _Rows(np.float64, width=6)             # (a, b, alt a, alt b, wire multiplier, remote workers)
        self.a_dev_start, self.a_res_start = _Rows(np.int64), _Rows(np.int64)
        self.a_dev_start.extend([0])
        self.a_res_start.extend([0])
        self.a_dev, self.a_res = _Rows(np.int64), _Rows(np.int64)
        # resources of the collective after the backward pass (a ps push: the other direction of the pull's)
        self.a_pres_start, self.a_pres = _Rows(np.int64), _Rows(np.int64)
        self.a_pres_start.extend([0])
        self.a_place = _Rows(np.int64)                     # dense index -> its placement's dense index
        self.place_index: dict = {}                        # placement -> dense index (fusion buckets)

    # ------------------------------------------------------------------ registries
    def begin(self) -> None:
        """Call before registering an evaluation's actions and layouts: bounds the registries."""
        if len(self._layouts) >= self.MAX_LAYOUTS or len(self.action_index) >= self.MAX_LAYOUTS:
            self._reset_registries()

    def action(self, a, devices: list[int]) -> int:
        """Dense index of action A (DEVICES: its placement's devices), registering it on first sight."""
        i = self.action_index.get(a)
        if i is not None:
            return i
        routing = self.routing
        if a.mode == "ps":
            c, kind = routing.collective("ps", devices, a.placement, int(a.ps_device)), COLL_PS
        elif a.mode == "allreduce" and len(devices) > 1:
            c, kind = routing.collective("allreduce", devices, a.placement, None), COLL_ALLREDUCE
        else:
            c, kind = (), COLL_NONE
        i = len(self.action_index)
        self._args = None
        self.a_mode.extend([MODE_CODE[a.mode]])
        self.a_ps.extend([int(a.ps_device) if a.mode == "ps" else -1])
        self.a_ckind.extend([kind])
        self.a_c.extend([[c[0], c[1], c[2], c[3], c[5], c[6]] if c else [0.0] * 6])
        self.a_dev.extend(devices)
        self.a_dev_start.extend([self.a_dev.size])
        self.a_res.extend(list(c[4]) if c else [])
        self.a_res_start.extend([self.a_res.size])
        self.a_pres.extend(list(c[7]) if c else [])
        self.a_pres_start.extend([self.a_pres.size])
        self.a_place.extend([self.place_index.setdefault(a.placement, len(self.place_index))])
        self.action_index[a] = i
        return i

    def layout(self, lay, parts: list | None = None) -> int:
        """Dense index of layout LAY, registering it on first sight (PARTS: a split partition task's
        [(device, its ops)] in run order)."""
        li = self.layout_index.get(lay.id)
        if li is not None:
            return li
        self._args = None
        rows, seconds = [], []
        split = lay.kind == "split"
        for _, d, _, ta in lay.insts:
            if split:
                rows.append(-1)
                seconds.append(float(d))
                continue
            r = self._row_of.get(id(ta))
            if r is None:
                r = self.dur.extend([ta])
                self._row_of[id(ta)] = r
                self._row_arrays.append(ta)
            rows.append(r)
            seconds.append(0.0)
        self.i_lane.extend([i[0] for i in lay.insts])
        self.i_batch.extend([i[2] for i in lay.insts])
        self.i_row.extend(rows)
        self.i_seconds.extend(seconds)
        self.l_start.extend([self.i_lane.size])
        self.l_split.extend([split])
        if split:
            part_of = {d: k for k, (d, _) in enumerate(parts)}
            moved = self.routing.split_internal_moves(lay.key[1], parts, lay)
            for (ds, dd), nb in moved.items():
                if nb <= 0:
                    continue
                res, lat, ipb = self.routing.route(ds, dd)
                r2, r3, ipb1, ipb2 = self._holds(res, ipb)
                self.int_lane.extend([(part_of[ds], part_of[dd], res[0], r2, r3)])
                self.int_f.extend([(lat, ipb, nb, ipb1, ipb2)])
        self.l_int_start.extend([self.int_lane.size])
        li = len(self._layouts)
        self._layouts.append(lay)
        self.layout_index[lay.id] = li
        return li

    def _holds(self, res: tuple, ipb: float) -> tuple[int, int, float, float]:
        """(resource 2 or -1, link or -1, send s/byte, receive s/byte) of a route holding RES."""
        if len(res) != 2:
            return -1, -1, ipb, ipb
        r3, ipb1, ipb2 = self.routing.link_holds(res)
        return res[1], r3, ipb1, ipb2

    def add_moves(self, keys: np.ndarray, plans: dict) -> None:
        """Register the routes of KEYS: src index << 32 | dst index (a flow between two layouts), or
        -1 - (bundle << 34 | src index << 17 | dst index) (a bundle to or from a split partition task,
        whose transfers carry fixed bytes: examples 0, copies = bytes; PLANS: the partition plans)."""
        routing = self.routing
        self._args = None
        for key in dict.fromkeys(keys.tolist()):
            if key in self.pair_index:
                continue
            if key < 0:
                code = -1 - key
                b, ls, ld = code >> 34, self._layouts[(code >> 17) & 0x1FFFF], self._layouts[code & 0x1FFFF]
                deps, transfers = routing.split_moves(b, ls, ld, plans)
                routes = []
                for (p, pl, c, cl, nb) in transfers:
                    res, lat, ipb = routing.route(p, c)
                    r2, r3, ipb1, ipb2 = self._holds(res, ipb)
                    routes.append(((pl, cl, res[0], r2, r3), (lat, ipb, 0.0, nb, ipb1, ipb2)))
            else:
                ls, ld = self._layouts[key >> 32], self._layouts[key & 0xFFFFFFFF]
                mk = ("c", ls.id, ld.id)
                cm = routing.moves.get(mk)
                if cm is None:
                    cm = routing.compiled_moves(mk, ls, ld)
                deps, r1, r2, _ = cm
                routes = ([((sl, dl, r, -1, -1), (lat, ipb, ex, cnt, ipb, ipb))
                           for (sl, dl, r, lat, ipb, ex, cnt) in r1] +
                          [((sl, dl, ra, rb, rc), (lat, ipb, ex, cnt, ipb1, ipb2))
                           for (sl, dl, ra, rb, rc, ipb1, ipb2, lat, ipb, ex, cnt) in r2])
            pairs = [(dl, sl) for dl, sls in deps for sl in sls]
            self.d_dl.extend([p[0] for p in pairs])
            self.d_sl.extend([p[1] for p in pairs])
            self.m_dep_start.extend([self.d_dl.size])
            lanes = [r[0] for r in routes]
            floats = [r[1] for r in routes]
            if lanes:
                self.r_lane.extend(lanes)
                self.r_f.extend(floats)
            self.m_rt_start.extend([self.r_lane.size])
            self.pair_index[key] = self.num_moves
            self.num_moves += 1

    # ------------------------------------------------------------------ one evaluation
    def run(self, group_local: np.ndarray, local_ai: np.ndarray, local_rep: np.ndarray, local_upd: np.ndarray,
            task_override: np.ndarray, num_lanes: int, lane_of_device: np.ndarray, static0: np.ndarray,
            plans: dict, fuse_cap: float = -1.0, w_coll: np.ndarray | None = None,
            offsets: tuple[np.ndarray, np.ndarray] | None = None, serial: np.ndarray | None = None) -> tuple:
        """Simulate one step: (step, comm bytes, start, finish, batch [lane, task], collective end per group,
        peak, static and activation bytes per device). FUSE_CAP: all-reduce groups are summed in the fusion
        buckets of ``tag.strategy.fusion`` closed at that many bytes (negative: one collective per group).
        W_COLL: per op group, the bytes its collective is charged for (default: its trainable bytes).
        OFFSETS: (per lane, per resource) when each is first free (``tag.sim.host_cpu.step_offsets``; default 0).
        SERIAL: per device, [all-reduce, push] fraction of synchronisation beside its compute that does not
        overlap it (``tag.sim.host_cpu.sync_serial``; default none)."""
        simulate = compiled_simulate()
        lane_start, resource_start = ((np.zeros(num_lanes), np.zeros(self.num_resources)) if offsets is None
                                      else (np.asarray(offsets[0], np.float64), np.asarray(offsets[1], np.float64)))
        for _ in range(2):
            if self._args is None:
                self._args = self._arguments()
            out = simulate(group_local, local_ai, local_rep, local_upd, task_override, num_lanes, lane_of_device,
                           static0, float(fuse_cap), self.w_bytes if w_coll is None else w_coll, lane_start,
                           resource_start, self.no_serial if serial is None else serial, *self._args)
            missing = out[0]
            if not len(missing):
                return out[1:]
            self.add_moves(missing, plans)
        raise RuntimeError("simulation kernel: routes between layouts still missing after registering them")

    def _arguments(self) -> tuple:
        """The kernel's arguments after the evaluation's own: the flat task graph and the registries (their
        current buffers; rebuilt after a registration, which may grow them)."""
        return (self.task_group, self.task_stage, self.b_src, self.b_dst, self.b_same, self.b_own_pe,
                self.b_own_fx, self.b_own_n, self.sh_start, self.sh_tid, self.sh_pe, self.sh_fx,
                self.fwd_start, self.fwd_task, self.dep_start, self.dep_task, self.upd_start, self.upd_task,
                self.g_after, self.w_bytes, self.w_count, self.slot_bytes,
                self.state_bytes, self.live_src, self.live_last, self.live_pe, self.live_fx, self.work_fx,
                self.work_pe, self.device_memory, self.per_tensor, self.num_resources,
                self.a_mode.buf, self.a_ps.buf, self.a_dev_start.buf, self.a_dev.buf, self.a_ckind.buf,
                self.a_c.buf, self.a_res_start.buf, self.a_res.buf, self.a_pres_start.buf, self.a_pres.buf,
                self.a_place.buf,
                self.l_start.buf, self.i_lane.buf, self.i_batch.buf, self.i_row.buf, self.dur.buf,
                self.i_seconds.buf, self.l_split.buf, self.l_int_start.buf, self.int_lane.buf, self.int_f.buf,
                self.pair_index.keys, self.pair_index.vals, self.m_dep_start.buf, self.d_dl.buf, self.d_sl.buf,
                self.m_rt_start.buf, self.r_lane.buf, self.r_f.buf)
