"""Host programs: one GraphDef per host, each running only its own devices' part of a rewritten step.

TensorFlow scales with one program per worker (MultiWorkerMirroredStrategy, TF1's between-graph
replication); a graph holding every device of the cluster does not. ``split_programs`` cuts a rewritten
step into one ``HostProgram`` per host of the topology:

* the host's own nodes (those placed on its devices) that the step, the loss or the initialiser needs;
* its inputs: when the hosts read apart examples of the global batch, every slice of a batch input read on
  the host becomes a placeholder of the host's own (``HostInput``: which examples it holds), so no example
  crosses between hosts -- each host reads, synthesises or is fed its own share; otherwise (hosts reading
  overlapping examples, e.g. a pipeline's stages) every batch input stays whole on the first input's host and
  travels as any other tensor;
* its side of every tensor that crosses to another host: a ``CollectiveBcastSendV2`` on the sender's CPU and
  a ``CollectiveBcastRecvV2`` on the receiver's, a group of the two hosts (its shape sent first when it is not
  static). ``_Send``/``_Recv`` cannot cross client sessions, and a queue shared by name on the receiver,
  though as fast (``scripts/bench_exchange.py``), cannot run beside collectives: both sessions then run
  partitions on the receiver under the run's one collective graph key and the same step id, and TensorFlow's
  per-step state of one is torn down under the other (ARCHITECTURE.md, "One program per host");
* a control edge to another host becomes a token (a scalar sent the same way) unless it only closes a
  step or the initialiser (the train op's and init's NoOps), which every host now closes for itself;
* constants and what is computed from constants alone are copied to every host that reads them instead of
  being sent; a resource handle read on another host is reached there by name (the variable's node is
  copied with its device: the handle, not the state, crosses);
* two NoOps, ``tag/host_step`` and ``tag/host_init``, that run everything the host does in a step and in
  initialisation.

Collectives need nothing: their members meet by group and instance keys, which the rewriter derives from
the strategy and the graph, so every host's program carries the same keys.

Example::

    from tag.backend.rewrite.programs import split_programs

    programs = split_programs(rewrite_result, topology)      # {host name: HostProgram}
    p = programs["cpu1"]
    p.graph_def, p.step_op, p.init_op, p.loss, [(i.name, i.lo, i.hi) for i in p.inputs]
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.python.framework import op_def_registry

from tag.errors import RewriteError
from tag.ir.op_types import CASE_TYPES, FUNCTION_CALL_TYPES, IF_TYPES, VARIABLE_WRITE_TYPES

from .graph_edit import attr_type, fill_defaults, split_tensor, tensor_name, tensor_proto

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology

STEP_OP = "tag/host_step"
INIT_OP = "tag/host_init"
EXCHANGE_PREFIX = "tag/exchange/"
EXCHANGE_GROUP_SALT = 0x2B7E15   # exchange groups differ from the rewriter's groups over the same devices
CLONE_MAX_BYTES = 1 << 20  # constants (and what is computed from them alone) up to this size are copied
_TASK_RE = re.compile(r"/task:(\d+)")
_SLICE_PREFIX = "tag/slice/"
_VARIABLE_OPS = frozenset({"VarHandleOp", "VariableV2", "Variable"})
_LOOP_OPS = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "NextIteration", "RefNextIteration",
                       "Switch", "RefSwitch", "Merge", "RefMerge", "LoopCond"})


@dataclass(frozen=True)
class HostInput:
    """A batch input of a host program: placeholder NAME holds examples LO..HI-1 (along AXIS) of the global
    batch of the original input SOURCE."""

    name: str
    source: str
    lo: int
    hi: int
    axis: int = 0


@dataclass
class HostProgram:
    """One host's part of a rewritten step (module docstring).

    ``step_op`` / ``init_op``: the NoOps to run each step and once. ``loss``: the global loss tensor, on the
    one host that computes it (None elsewhere). ``variables``: original variable -> its copies in this program.
    ``primary``: original variable -> (copy name, TF device, dtype enum, its serialised NodeDef) of the copy
    a checkpoint reads, for every variable of the step (the same on every host). ``sends`` / ``receives``: tensors
    and tokens this host puts to and takes from other hosts per step.
    """

    host: str
    task: int
    graph_def: graph_pb2.GraphDef
    step_op: str
    init_op: str
    loss: str | None
    inputs: list[HostInput]
    variables: dict[str, list[str]] = field(default_factory=dict)
    primary: dict[str, tuple[str, str, int, bytes]] = field(default_factory=dict)
    sends: int = 0
    receives: int = 0
    cpu: str = ""             # the host's CPU device, where its exchanges and its NoOps live
    batch_size: int = 0             # the global batch (what the inputs' example ranges are ranges of)
    input_init: str | None = None   # with an input pipeline attached: the op that starts it (run after init_op)
    pull: str | None = None         # ... and the tensor that reads the next batch (0 once some data set ended)

    @property
    def nodes(self) -> int:
        return len(self.graph_def.node)

    def to_files(self, directory: str) -> tuple[str, str]:
        """Write the program as DIRECTORY/<host>.pb (its GraphDef) and <host>.json (the rest, plain data);
        returns both paths (``HostProgram.from_files`` reads them)."""
        import base64
        import json
        import os
        graph_path = os.path.join(directory, f"{self.host}.pb")
        meta_path = os.path.join(directory, f"{self.host}.json")
        with open(graph_path, "wb") as f:
            f.write(self.graph_def.SerializeToString(deterministic=True))
        meta = {"host": self.host, "task": self.task, "step_op": self.step_op, "init_op": self.init_op,
                "loss": self.loss, "inputs": [vars(i) for i in self.inputs], "variables": self.variables,
                "primary": {v: [c, d, t, base64.b64encode(n).decode()] for v, (c, d, t, n) in self.primary.items()},
                "sends": self.sends, "receives": self.receives, "cpu": self.cpu, "batch_size": self.batch_size,
                "input_init": self.input_init, "pull": self.pull}
        with open(meta_path, "w") as f:
            json.dump(meta, f)
        return graph_path, meta_path

    @classmethod
    def from_files(cls, graph_path: str, meta_path: str) -> "HostProgram":
        """The program ``to_files`` wrote."""
        import base64
        import json
        with open(meta_path) as f:
            meta = json.load(f)
        gd = graph_pb2.GraphDef()
        with open(graph_path, "rb") as f:
            gd.ParseFromString(f.read())
        return cls(meta["host"], int(meta["task"]), gd, meta["step_op"], meta["init_op"], meta["loss"],
                   [HostInput(**i) for i in meta["inputs"]], {k: list(v) for k, v in meta["variables"].items()},
                   {v: (c, d, int(t), base64.b64decode(n)) for v, (c, d, t, n) in meta["primary"].items()},
                   int(meta["sends"]), int(meta["receives"]), meta["cpu"], int(meta.get("batch_size", 0)),
                   meta.get("input_init"), meta.get("pull"))


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _instance_key(text: str) -> int:
    """A collective instance key for TEXT (the same in every host's program)."""
    return 1 + int.from_bytes(hashlib.sha1(text.encode()).digest()[:4], "big") % (2 ** 30 - 1)


def exchange_group_key(device_a: str, device_b: str) -> int:
    """The collective group of the exchanges between two hosts' CPUs (either direction)."""
    text = "|".join(sorted((device_a, device_b)))
    return 1 + (int.from_bytes(hashlib.sha1(text.encode()).digest()[:4], "big") ^ EXCHANGE_GROUP_SALT) % (2 ** 30 - 1)


def _variable_behind(nodes: dict, handle: str) -> str | None:
    """The variable op a resource tensor HANDLE comes from (through Identity ops), or None."""
    for _ in range(64):
        op = split_tensor(handle.lstrip("^"))[0]
        node = nodes.get(op)
        if node is None:
            return None
        if node.op in _VARIABLE_OPS:
            return op
        if node.op != "Identity" or not node.input:
            return None
        handle = node.input[0]
    return None


def _static_shape(var_node: node_def_pb2.NodeDef) -> list[int] | None:
    shape = var_node.attr["shape"].shape
    return None if shape.unknown_rank else [int(d.size) for d in shape.dim]


_WRITES = VARIABLE_WRITE_TYPES | frozenset({"AssignAddVariableOp", "AssignSubVariableOp"})


def _function_writes_argument(library, call: node_def_pb2.NodeDef, slot: int) -> bool:
    """Whether function call CALL may write the resource it takes at input SLOT: an op of its function(s) that
    updates variables (an assignment, a scatter, an optimizer apply) or calls another function, reading that
    argument (conservative: any such op on the argument counts)."""
    functions = {f.signature.name: f for f in library.function}
    names = [a.func.name for key, a in call.attr.items() if a.HasField("func")]
    names += [f.name for key, a in call.attr.items() for f in a.list.func]
    arg_index = slot - (1 if call.op in IF_TYPES | CASE_TYPES else 0)     # If / Case: input 0 is the condition
    for name in names:
        f = functions.get(name)
        if f is None or not 0 <= arg_index < len(f.signature.input_arg):
            return True
        arg = f.signature.input_arg[arg_index].name
        for node in f.node_def:
            reads_arg = any(i.split(":")[0] == arg for i in node.input if not i.startswith("^"))
            if reads_arg and (node.op in _WRITES or node.op.startswith(("ResourceApply", "ResourceSparseApply"))
                              or node.op in FUNCTION_CALL_TYPES or node.op in functions):
                return True
    return False


def task_of(device: str) -> int | None:
    """The task index a TF device string names (None when it names none)."""
    m = _TASK_RE.search(device or "")
    return int(m.group(1)) if m else None


def host_cpu(task: int) -> str:
    """The CPU device of task TASK (every TensorFlow worker has one)."""
    return f"/job:worker/task:{task}/device:CPU:0"


def split_programs(result: Any, topology: "Topology") -> dict[str, HostProgram]:
    """One ``HostProgram`` per host of TOPOLOGY that runs part of RESULT's step (a ``RewriteResult``: graph_def,
    train_op, loss, init, inputs, batch_size, variables; module docstring); a host with nothing to run gets an
    empty program (its NoOps only). RewriteError for what cannot be cut."""
    return _Splitter(result, topology).run()


class _Splitter:
    """The state of one split: the rewritten graph indexed, its phases, and the programs being built."""

    def __init__(self, result: Any, topology: "Topology"):
        self.result = result
        self.topo = topology
        self.gd = result.graph_def
        self.nodes: dict[str, node_def_pb2.NodeDef] = {n.name: n for n in self.gd.node}
        self.task: dict[str, int] = {}                  # node -> task of its device
        default = min(h.task_index for h in topology.hosts)
        for n in self.gd.node:
            t = task_of(n.device)
            self.task[n.name] = default if t is None else t
        self.hosts = {h.task_index: h.name for h in topology.hosts}
        unknown = sorted({t for t in self.task.values() if t not in self.hosts})
        if unknown:
            raise RewriteError(f"the rewritten graph places ops on task {unknown[0]}, which topology "
                               f"{topology.name!r} does not have")
        self.consumers: dict[str, list[str]] = {}      # node -> nodes reading it (data or control)
        for n in self.gd.node:
            for i in n.input:
                self.consumers.setdefault(split_tensor(i.lstrip("^"))[0], []).append(n.name)
        self.data_consumers: dict[str, list[str]] = {}   # node -> nodes reading one of its outputs
        for n in self.gd.node:
            for i in n.input:
                if not i.startswith("^"):
                    self.data_consumers.setdefault(split_tensor(i)[0], []).append(n.name)
        self.roots_step = [result.train_op] + ([split_tensor(result.loss)[0]] if result.loss else [])
        self.roots_init = [result.init] if result.init else []
        self.step_set = self._ancestors(self.roots_step)
        self.init_set = self._ancestors(self.roots_init)
        self.terminal = self._terminal_noops({result.train_op} | ({result.init} if result.init else set()))
        self.dtypes, self.shapes = self._tensor_types()
        self.frame = self._frames()
        self.moved: dict[str, str] = {}                 # batch input moved to its first one's host -> its device

    def _frames(self) -> dict[str, str]:
        """Node -> the TF1 while-loop frame it runs in ("" outside loops): an ``Enter`` opens its frame_name
        inside its input's frame, an ``Exit`` returns to the parent; other ops run in their inputs' frame."""
        back = {n for n, node in self.nodes.items() if node.op in ("NextIteration", "RefNextIteration")}
        if not any(node.op in ("Enter", "RefEnter") for node in self.nodes.values()):
            return {}
        pending = {n: sum(1 for i in node.input if split_tensor(i.lstrip("^"))[0] not in back)
                   for n, node in self.nodes.items()}
        ready = [n for n, k in pending.items() if k == 0]
        frame: dict[str, str] = {}
        while ready:
            n = ready.pop()
            node = self.nodes[n]
            ins = [split_tensor(i.lstrip("^"))[0] for i in node.input]
            outer = next((frame[p] for p in ins if p not in back and p in frame), "")
            if node.op in ("Enter", "RefEnter"):
                frame[n] = f"{outer}/{node.attr['frame_name'].s.decode()}"
            elif node.op in ("Exit", "RefExit"):
                frame[n] = outer.rsplit("/", 1)[0]
            else:
                frame[n] = outer
            if n not in back:
                for c in self.consumers.get(n, []):
                    pending[c] -= 1
                    if pending[c] == 0:
                        ready.append(c)
        return frame

    def input_frame(self, n: str) -> str:
        """The frame N reads its inputs in (an ``Enter`` reads in the frame around its own)."""
        f = self.frame.get(n, "")
        return f.rsplit("/", 1)[0] if self.nodes[n].op in ("Enter", "RefEnter") else f

    # -------------------------------------------------------------------------------- analysis
    def _ancestors(self, roots: Iterable[str], stop: set[str] = frozenset()) -> set[str]:
        """ROOTS and every node they depend on (data or control), not looking past the nodes of STOP."""
        seen: set[str] = set()
        stack = [r for r in roots if r in self.nodes]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in stop:
                continue
            for i in self.nodes[n].input:
                p = split_tensor(i.lstrip("^"))[0]
                if p not in seen:
                    stack.append(p)
        return seen

    def _terminal_noops(self, roots: set[str]) -> set[str]:
        """NoOps that only close the step or the initialiser: the fetch roots, and NoOps whose every consumer is
        one (their control inputs order nothing another op waits for)."""
        terminal = set()
        changed = True
        candidates = [n for n, node in self.nodes.items() if node.op == "NoOp"]
        while changed:
            changed = False
            for n in candidates:
                if n in terminal:
                    continue
                cons = self.consumers.get(n, [])
                if n in roots or (cons and all(c in terminal for c in cons)):
                    terminal.add(n)
                    changed = True
        return terminal

    def _tensor_types(self) -> tuple[dict[str, int], dict[str, list[int] | None]]:
        """Tensor name -> dtype enum and static shape (None: unknown rank), read from the graph imported once."""
        g = tf.Graph()
        with g.as_default():
            try:
                tf.graph_util.import_graph_def(self.gd, name="")
            except (ValueError, tf.errors.OpError) as err:
                raise RewriteError(f"the rewritten graph does not import: {' '.join(str(err).split())[:300]}") \
                    from None
        dtypes, shapes = {}, {}
        for op in g.get_operations():
            for k, t in enumerate(op.outputs):
                name = tensor_name(op.name, k)
                dtypes[name] = t.dtype.as_datatype_enum
                shapes[name] = None if t.shape.rank is None else [(-1 if d is None else int(d))
                                                                   for d in t.shape.as_list()]
        return dtypes, shapes

    def _clonable(self, p: str, memo: dict[str, bool]) -> bool:
        """Is P computed from constants alone, by stateless ops outside loops, and small?"""
        if p in memo:
            return memo[p]
        memo[p] = False                       # cycles (loops) are not clonable
        node = self.nodes[p]
        op_def = op_def_registry.get(node.op)
        ok = op_def is not None and not op_def.is_stateful and node.op not in _LOOP_OPS \
            and node.op not in ("Placeholder", "PlaceholderV2", "PlaceholderWithDefault")
        if ok and node.op == "Const":
            ok = node.attr["value"].tensor.ByteSize() <= CLONE_MAX_BYTES
        if ok:
            ok = all(not i.startswith("^") and self._clonable(split_tensor(i)[0], memo) for i in node.input) \
                if node.op != "Const" else not node.input or all(
                    i.startswith("^") and self._clonable(i[1:], memo) for i in node.input)
        memo[p] = ok
        return ok

    # -------------------------------------------------------------------------------- inputs
    def _input_slices(self) -> tuple[dict[int, list[HostInput]], set[str]]:
        """(host task -> its HostInputs, the nodes they replace).

        Every ``tag/slice/`` of a batch input read on a host becomes that host's placeholder, and a batch input
        read whole on a host a placeholder there, when the hosts read apart examples (each host's range of the
        batch overlaps no other's): then each host reads, synthesises or is fed its own examples. Otherwise
        (a host that also reads another's examples) the batch inputs stay whole on their own host, which sends
        the others their examples, as one graph would."""
        inputs = [n for n in self.result.inputs if n in self.nodes and self.nodes[n].op in ("Placeholder",
                                                                                            "PlaceholderV2")]
        needed = self.step_set | self.init_set
        reads: list[tuple[int, HostInput]] = []            # (task, what it reads)
        for src in inputs:
            whole = set()
            for c in self.data_consumers.get(src, []):
                node = self.nodes[c]
                bounds = self._slice_bounds(node) if node.op == "StridedSlice" and c.startswith(_SLICE_PREFIX) \
                    and node.input[0] == src else None
                if bounds is None:
                    if c in needed:
                        whole.add(self.task[c])
                    continue
                ax, lo, hi = bounds
                for t in {self.task[r] for r in self.data_consumers.get(c, []) if r in needed}:
                    reads.append((t, HostInput(c, src, lo, hi, ax)))
            reads += [(t, HostInput(src, src, 0, self.result.batch_size, 0)) for t in whole]
        hull: dict[int, tuple[int, int]] = {}
        for t, r in reads:
            lo, hi = hull.get(t, (r.lo, r.hi))
            hull[t] = (min(lo, r.lo), max(hi, r.hi))
        spans = sorted(hull.values())
        apart = all(a[1] <= b[0] for a, b in pairwise(spans)) and all(r.axis == 0 for _, r in reads)
        if not apart or len(hull) < 2:      # every batch input on the first one's host: one pipeline feeds them all
            home = self.task[inputs[0]] if inputs else min(self.hosts)
            for src in inputs:
                if self.task[src] != home:
                    self.task[src] = home
                    self.moved[src] = host_cpu(home)
            return {home: [HostInput(src, src, 0, self.result.batch_size, 0) for src in inputs]} if inputs else {}, \
                set()
        per_task: dict[int, list[HostInput]] = {}
        for t, r in reads:
            if r not in per_task.setdefault(t, []):
                per_task[t].append(r)
        return per_task, {r.name for _, r in reads}

    def _slice_bounds(self, node: node_def_pb2.NodeDef) -> tuple[int, int, int] | None:
        """(axis, begin, end) of a batch slice with Const bounds, else None."""
        consts = [self.nodes.get(split_tensor(i)[0]) for i in node.input[1:3]]
        if any(c is None or c.op != "Const" for c in consts):
            return None
        begin, end = (tf.make_ndarray(c.attr["value"].tensor) for c in consts)
        ax = len(begin) - 1
        return ax, int(begin[ax]), int(end[ax])

    # -------------------------------------------------------------------------------- build
    def run(self) -> dict[str, HostProgram]:
        host_inputs, replaced = self._input_slices()
        if replaced:        # what only the replaced slices read (their bounds, a whole batch) is no longer needed
            self.step_set = self._ancestors(self.roots_step, stop=replaced)
            self.init_set = self._ancestors(self.roots_init, stop=replaced)
        needed = self.step_set | self.init_set
        own: dict[int, list[str]] = {t: [] for t in self.hosts}
        for n in self.gd.node:                                 # graph order kept
            if n.name in needed and n.name not in replaced:
                own[self.task[n.name]].append(n.name)
        builders = {t: _ProgramBuilder(self, t) for t in self.hosts}
        for t, inputs in host_inputs.items():
            for hi in inputs:
                if hi.name in replaced:
                    builders[t].add_input(hi)
                else:
                    builders[t].inputs.append(hi)      # the original placeholder, kept on its own host
        clone_memo: dict[str, bool] = {}
        for t, names in own.items():
            for n in names:
                builders[t].add_own(n, replaced, clone_memo, builders)
        return {self.hosts[t]: b.finish() for t, b in builders.items()}


class _ProgramBuilder:
    """The program of one host (task), filled by ``_Splitter.run``."""

    def __init__(self, split: _Splitter, task: int):
        self.s = split
        self.task = task
        self.cpu = host_cpu(task)
        self.out: dict[str, node_def_pb2.NodeDef] = {}       # name -> node, in insertion order
        self.phase: dict[str, tuple[bool, bool]] = {}        # node -> (in step, in init)
        self.inputs: list[HostInput] = []
        self.received: dict[str, str] = {}                  # tensor of another host -> its local name here
        self.sent: dict[str, list[str]] = {}                # a receiver's node -> this host's nodes sending to it
        self.mirror_assigns: dict[str, set[str]] = {}      # op -> assigns of the mirrors it reads (a call's
        # input, or a mirror's handle passed through a call: a While's loop-invariant resource output)
        self.sends = 0
        self.receives = 0

    # -- nodes ----------------------------------------------------------------------------------
    def _put(self, node: node_def_pb2.NodeDef, step: bool, init: bool) -> None:
        if node.name in self.out:
            s, i = self.phase[node.name]
            self.phase[node.name] = (s or step, i or init)
            return
        self.out[node.name] = node
        self.phase[node.name] = (step, init)

    def add_input(self, hi: HostInput) -> None:
        """HI's placeholder on this host (device: where its first reader here runs)."""
        if hi.name in self.out:
            return
        s = self.s
        readers = [r for r in s.data_consumers.get(hi.name, []) if s.task[r] == self.task]
        device = s.nodes[readers[0]].device if readers else self.cpu
        shape = s.shapes.get(tensor_name(hi.name, 0))
        node = node_def_pb2.NodeDef(name=hi.name, op="Placeholder", device=device)
        node.attr["dtype"].type = s.dtypes[tensor_name(hi.name, 0)]
        if shape is not None:
            node.attr["shape"].shape.CopyFrom(tf.TensorShape([None if d < 0 else d for d in shape]).as_proto())
        else:
            node.attr["shape"].shape.unknown_rank = True
        step = any(r in s.step_set for r in readers)
        init = any(r in s.init_set for r in readers)
        self._put(node, step or not init, init)
        self.inputs.append(hi)

    def add_own(self, n: str, replaced: set[str], clone_memo: dict[str, bool],
                builders: dict[int, "_ProgramBuilder"]) -> None:
        """Node N of this host, its inputs from other hosts resolved (received, cloned or reached by name)."""
        s = self.s
        orig = s.nodes[n]
        step, init = n in s.step_set, n in s.init_set
        node = node_def_pb2.NodeDef()
        node.CopyFrom(orig)
        node.device = s.moved.get(n, node.device)
        del node.input[:]
        for i in orig.input:
            control = i.startswith("^")
            p = split_tensor(i.lstrip("^"))[0]
            if p in replaced:
                if control:
                    continue                  # an ordering edge to a batch slice another host now reads itself
                node.input.append(i)          # this host's own placeholder of that slice
                continue
            if s.task[p] == self.task:
                node.input.append(i)
                continue
            if control:
                if n in s.terminal:
                    continue                  # the other host closes its own step / initialiser
                node.input.append("^" + self._receive_token(p, builders[s.task[p]], step, init))
                continue
            if s.dtypes.get(tensor_name(*split_tensor(i))) == tf.resource.as_datatype_enum:
                node.input.append(self._mirror(n, len(node.input), i, builders[s.task[p]], step, init))
                continue
            if s._clonable(p, clone_memo):
                self._copy_closure(p, keep_device=False, step=step, init=init, memo=clone_memo)
                node.input.append(i)
                continue
            if s.frame.get(p, "") or s.input_frame(n):
                raise RewriteError(f"op {n!r} (task {self.task}) reads {i!r} inside a TF1 while loop from task "
                                   f"{s.task[p]}: a loop cannot span two hosts' programs; keep the loop's op "
                                   f"group on one host")
            node.input.append(self._receive(i, builders[s.task[p]], step, init))
        self._after_mirrors_passed_through(n, orig)
        node.input.extend(sorted("^" + a for a in self.mirror_assigns.get(n, ())))
        self._put(node, step, init)

    def _after_mirrors_passed_through(self, n: str, orig: node_def_pb2.NodeDef) -> None:
        """Op N (ORIG) reads a resource output of an op that reads mirrors (a ``While`` passes its loop-invariant
        variable handles through; a gradient takes ``VariableShape`` of them): N waits for those mirrors' assigns
        too. TensorFlow's lowering of a While wires such an output straight to the loop's input, the mirror's
        handle, so the While's own wait does not order N, which would read a mirror not yet assigned."""
        for i in orig.input:
            if i.startswith("^"):
                continue
            p, k = split_tensor(i)
            if p in self.mirror_assigns and self.s.dtypes.get(tensor_name(p, k)) == tf.resource.as_datatype_enum:
                self.mirror_assigns.setdefault(n, set()).update(self.mirror_assigns[p])

    def _mirror(self, n: str, slot: int, handle: str, owner: "_ProgramBuilder", step: bool, init: bool) -> str:
        """A local variable holding this step's value of the variable behind HANDLE (on OWNER's host), for input
        SLOT of function call N, which reads it: the owner reads and sends the value, this host assigns it to
        the mirror before N runs. A host's program reaches no other host's state, so a call that writes such a
        variable cannot be cut (RewriteError)."""
        s = self.s
        var = _variable_behind(s.nodes, handle)
        if var is None or s.nodes[n].op not in FUNCTION_CALL_TYPES:
            raise RewriteError(f"op {n!r} (task {self.task}) takes the handle {handle!r} of a resource on task "
                               f"{owner.task}: a host's program reaches no other host's state (put the op in "
                               f"the op group of its variable)")
        if _function_writes_argument(s.gd.library, s.nodes[n], slot):
            raise RewriteError(f"op {n!r} (task {self.task}) updates variable {var!r} of task {owner.task} inside "
                               f"its function: keep the call in the op group of that variable")
        dtype = s.nodes[var].attr["dtype"].type
        mirror = f"tag/mirror/{var}/to_{self.task}"
        if mirror not in self.out:
            read = node_def_pb2.NodeDef(name=f"tag/mirror_read/{var}", op="ReadVariableOp",
                                        device=s.nodes[split_tensor(handle)[0]].device)
            read.input.append(handle)
            read.attr["dtype"].type = dtype
            owner._put(read, step, init)
            s.nodes.setdefault(read.name, read)
            s.task.setdefault(read.name, owner.task)
            s.dtypes.setdefault(read.name, dtype)
            s.shapes.setdefault(read.name, _static_shape(s.nodes[var]))
            value = self._receive(read.name, owner, step, init)
            device = s.nodes[n].device
            var_node = node_def_pb2.NodeDef(name=mirror, op="VarHandleOp", device=device)
            var_node.attr["dtype"].type = dtype
            var_node.attr["shape"].CopyFrom(s.nodes[var].attr["shape"])
            var_node.attr["shared_name"].s = mirror.encode()
            assign = node_def_pb2.NodeDef(name=mirror + "/assign", op="AssignVariableOp", device=device)
            assign.input.extend([mirror, value])
            assign.attr["dtype"].type = dtype
            self._put(fill_defaults(var_node), step, init)
            self._put(fill_defaults(assign), step, init)
        else:
            self._widen(mirror, step, init)
            self._widen(mirror + "/assign", step, init)
        self.mirror_assigns.setdefault(n, set()).add(mirror + "/assign")
        return mirror

    def _copy_closure(self, p: str, *, keep_device: bool, step: bool, init: bool, memo: dict[str, bool]) -> None:
        """P and everything it is computed from, copied into this program (on this host's device of the first
        reader, or P's own device when KEEP_DEVICE: a resource handle reached by name)."""
        stack = [p]
        while stack:
            q = stack.pop()
            if q in self.out:
                s, i = self.phase[q]
                self.phase[q] = (s or step, i or init)
                continue
            node = node_def_pb2.NodeDef()
            node.CopyFrom(self.s.nodes[q])
            if not keep_device:
                node.device = self.cpu
            self._put(node, step, init)
            stack.extend(split_tensor(i.lstrip("^"))[0] for i in node.input)

    def _key_const(self, name: str, value: int) -> node_def_pb2.NodeDef:
        node = node_def_pb2.NodeDef(name=name, op="Const", device=self.cpu)
        node.attr["dtype"].CopyFrom(attr_type(tf.int32))
        node.attr["value"].tensor.CopyFrom(tensor_proto(np.array(value, np.int32)))
        return node

    def _receive(self, t: str, sender: "_ProgramBuilder", step: bool, init: bool) -> str:
        """The local name of tensor T (produced on SENDER's host), received through a collective broadcast from
        the sender's CPU to this host's CPU (a group of the two, keys derived from T and this host). A shape
        that is not static travels first, in broadcasts of its own."""
        t = tensor_name(*split_tensor(t))
        if t in self.received:
            name = self.received[t]
            self._widen(name, step, init)
            for n in sender.sent[name]:
                sender._widen(n, step, init)
            return name
        shape = self.s.shapes.get(t)
        base = f"{EXCHANGE_PREFIX}{_digest(t)}/to_{self.task}"
        group = exchange_group_key(sender.cpu, self.cpu)
        sender.sent.pop("_shape", None)
        if shape is not None and all(d >= 0 for d in shape):
            shape_node = node_def_pb2.NodeDef(name=base + "/shape_const", op="Const", device=self.cpu)
            shape_node.attr["dtype"].CopyFrom(attr_type(tf.int32))
            shape_node.attr["value"].tensor.CopyFrom(tensor_proto(np.array(shape, np.int32)))
            shape_nodes = [shape_node]
        else:
            shape_nodes = self._shape_exchange(t, sender, base, group, step, init)
        s_nodes, r_nodes = self._bcast_pair(f"{t}|{self.task}", base + "/recv", t, shape_nodes[-1].name, sender,
                                            group, self.s.dtypes[t])
        for node in shape_nodes + r_nodes:
            self._put(node, step, init)
        for node in s_nodes:
            sender._put(node, step, init)
        recv = r_nodes[-1].name
        sender.sent[recv] = [n.name for n in s_nodes] + sender.sent.pop("_shape", [])
        sender.sends += 1
        self.receives += 1
        self.received[t] = recv
        return recv

    def _shape_exchange(self, t: str, sender: "_ProgramBuilder", base: str, group: int, step: bool,
                        init: bool) -> list[node_def_pb2.NodeDef]:
        """Nodes on this side that receive T's shape before T itself (sent by SENDER from a Shape op of T); a T of
        unknown rank sends its rank first. The last node returned is the received shape."""
        shape_op = node_def_pb2.NodeDef(name=base + "/send_shape/of", op="Shape", device=sender.cpu)
        shape_op.input.append(t)
        shape_op.attr["T"].type = self.s.dtypes[t]
        shape_op.attr["out_type"].CopyFrom(attr_type(tf.int32))
        sent = [shape_op]
        mine: list[node_def_pb2.NodeDef] = []
        known = self.s.shapes.get(t)
        if known is not None:
            rank = node_def_pb2.NodeDef(name=base + "/shape/rank", op="Const", device=self.cpu)
            rank.attr["dtype"].CopyFrom(attr_type(tf.int32))
            rank.attr["value"].tensor.CopyFrom(tensor_proto(np.array([len(known)], np.int32)))
            mine.append(rank)
        else:
            size = node_def_pb2.NodeDef(name=base + "/send_rank/of", op="Shape", device=sender.cpu)
            size.input.append(shape_op.name)
            size.attr["T"].CopyFrom(attr_type(tf.int32))
            size.attr["out_type"].CopyFrom(attr_type(tf.int32))
            one = node_def_pb2.NodeDef(name=base + "/rank/shape", op="Const", device=self.cpu)
            one.attr["dtype"].CopyFrom(attr_type(tf.int32))
            one.attr["value"].tensor.CopyFrom(tensor_proto(np.array([1], np.int32)))
            s_nodes, r_nodes = self._bcast_pair(f"{t}|{self.task}|rank", base + "/rank", size.name, one.name,
                                                sender, group, tf.int32.as_datatype_enum)
            sent += [size] + s_nodes
            mine += [one] + r_nodes
            rank = r_nodes[-1]
        s_nodes, r_nodes = self._bcast_pair(f"{t}|{self.task}|shape", base + "/shape", shape_op.name, rank.name,
                                            sender, group, tf.int32.as_datatype_enum)
        for node in sent + s_nodes:
            sender._put(node, step, init)
        sender.sent["_shape"] = [n.name for n in sent + s_nodes]
        return mine + r_nodes

    def _bcast_pair(self, what: str, base: str, value: str, shape: str, sender: "_ProgramBuilder", group: int,
                    dtype: int) -> tuple[list[node_def_pb2.NodeDef], list[node_def_pb2.NodeDef]]:
        """(SENDER's nodes, this host's nodes) of one broadcast of VALUE (a tensor of SENDER's program) to here,
        received with shape SHAPE (a tensor of this program); the last node of each list is the send / the
        received value."""
        instance = _instance_key(what)
        consts = [self._key_const(f"{base}/{k}", v) for k, v in (("group_size", 2), ("group_key", group),
                                                                   ("instance_key", instance))]
        recv = node_def_pb2.NodeDef(name=base, op="CollectiveBcastRecvV2", device=self.cpu)
        recv.input.extend([c.name for c in consts] + [shape])
        recv.attr["T"].type = dtype
        recv.attr["Tshape"].CopyFrom(attr_type(tf.int32))
        recv.attr["communication_hint"].s = b"ring"
        sconsts = [sender._key_const(f"{base}/send/{k}", v) for k, v in (("group_size", 2), ("group_key", group),
                                                                           ("instance_key", instance))]
        send = node_def_pb2.NodeDef(name=base + "/send", op="CollectiveBcastSendV2", device=sender.cpu)
        send.input.extend([value] + [c.name for c in sconsts])
        send.attr["T"].type = dtype
        send.attr["communication_hint"].s = b"ring"
        return sconsts + [fill_defaults(send)], consts + [fill_defaults(recv)]

    def _receive_token(self, p: str, sender: "_ProgramBuilder", step: bool, init: bool) -> str:
        """A local op that completes once op P (on SENDER's host) has run: a token P's host sends after it."""
        token = f"{EXCHANGE_PREFIX}token/{p}"
        if token not in sender.out:
            node = node_def_pb2.NodeDef(name=token, op="Const", device=sender.s.nodes[p].device)
            node.attr["dtype"].CopyFrom(attr_type(tf.int32))
            node.attr["value"].tensor.CopyFrom(tensor_proto(np.array(0, np.int32)))
            node.input.append("^" + p)
            sender._put(node, step, init)
            sender.s.dtypes.setdefault(token, tf.int32.as_datatype_enum)
            sender.s.shapes.setdefault(token, [])
            sender.s.nodes.setdefault(token, node)
            sender.s.task.setdefault(token, sender.task)
        else:
            sender._widen(token, step, init)
        return self._receive(token, sender, step, init)

    def _widen(self, name: str, step: bool, init: bool) -> None:
        if name in self.phase:
            s, i = self.phase[name]
            self.phase[name] = (s or step, i or init)

    # -- result ---------------------------------------------------------------------------------
    def finish(self) -> HostProgram:
        s = self.s
        gd = graph_pb2.GraphDef()
        gd.versions.CopyFrom(s.gd.versions)
        gd.library.CopyFrom(s.gd.library)
        nodes = list(self.out.values())
        read_in: dict[str, set[str]] = {}          # node -> nodes of this program that read it, by phase
        for node in nodes:
            for i in node.input:
                read_in.setdefault(split_tensor(i.lstrip("^"))[0], set()).add(node.name)
        step_sinks, init_sinks = [], []
        for node in nodes:
            step, init = self.phase[node.name]
            readers = read_in.get(node.name, set())
            if step and not any(self.phase[r][0] for r in readers):
                step_sinks.append(node.name)
            if init and not any(self.phase[r][1] for r in readers):
                init_sinks.append(node.name)
        gd.node.extend(nodes)
        for name, sinks in ((STEP_OP, step_sinks), (INIT_OP, init_sinks)):
            op = gd.node.add(name=name, op="NoOp", device=self.cpu)
            op.input.extend("^" + n for n in sinks)
        loss = s.result.loss
        if loss is not None and s.task.get(split_tensor(loss)[0]) != self.task:
            loss = None
        variables: dict[str, list[str]] = {}
        for v, copies in s.result.variables.items():
            mine = [c for c in copies if c in self.out and s.task.get(c) == self.task]
            if mine:
                variables[v] = mine
        primary = {}
        for v, copies in s.result.variables.items():
            kept = sorted(c for c in copies if c in s.step_set or c in s.init_set)
            if kept:
                c = kept[0]
                primary[v] = (c, s.nodes[c].device, int(s.nodes[c].attr["dtype"].type),
                              s.nodes[c].SerializeToString(deterministic=True))
        return HostProgram(s.hosts[self.task], self.task, gd, STEP_OP, INIT_OP, loss, sorted(
            self.inputs, key=lambda h: (h.source, h.lo, h.name)), variables, primary, self.sends, self.receives,
            self.cpu, int(s.result.batch_size))
