"""Train the GNN policy by self-play in the simulator and write the shipped weights (``tag/gnn/policy_weights.npz``).

Cases: small zoo models (``tag.gnn.cases.TRAIN_ZOO``; never inception_v3, mobilenet_v2 or bert_large) and
random layered graphs, each on its own GENERATED cluster (``random_topology_text``; never a ready
topology file), at 2, 8 or 32 examples per device. The tree search runs as ``tag.optimize`` runs it
(decision order ``auto``, seeded with the best uniform strategy). Generation 0 runs it with the default
uniform-value prior (which the untrained network equals); later generations with the network being
trained (AlphaZero-style); after each generation the network is trained on every sample so far
(cross-entropy to the nodes' visit distributions, sharpened and blended with the candidates' completed
values: ``tag.gnn.selfplay.self_play``). Finally the policy is compared with the default prior at equal
playouts on fresh generated cases, the weights saved with the network's output on the reference state,
and the command and figures written to ``--record`` (tag/gnn/TRAINING.md).

Usage::

    python scripts/train_gnn.py                                    # the shipped run (seed 0)
    python scripts/train_gnn.py --cases 6 --generations 1 --epochs 1 --out w.npz --record t.md
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from tag.cluster.topology import parse_topology
from tag.gnn.cases import TRAIN_ZOO, random_layered_graph, random_topology_text, zoo_graph
from tag.gnn.model import PolicyNet
from tag.gnn.policy import WEIGHTS_PATH, GNNPolicy, reference_log_probs
from tag.gnn.selfplay import Trainer, self_play
from tag.search.driver import best_uniform
from tag.search.env import SearchEnv
from tag.search.mcts import mcts
from tag.strategy.grouping import group_ops
from tag_bench.machine import load1
from tag_bench.records import command_line
from tag_bench.stats import geomean

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the training record is tag/gnn/TRAINING.md

GROUPS = 64
LOG: list[str] = []


def say(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


def make_case(rng: np.random.Generator, index: int, zoo_every: int) -> tuple[str, SearchEnv]:
    """Case INDEX: every ZOO_EVERY-th a small zoo model, else a random layered graph; a generated cluster."""
    topo = parse_topology(random_topology_text(rng, name=f"gen{index}"))
    per_device = int(rng.choice([2, 8, 32]))
    if zoo_every and index % zoo_every == 0:
        names = sorted(TRAIN_ZOO)
        name = names[(index // zoo_every) % len(names)]
        tg = zoo_graph(name)
    else:
        name = "layered"
        tg = random_layered_graph(rng, batch=32, name=f"layered{index}")
    grouping = group_ops(tg, target_groups=GROUPS)
    env = SearchEnv(tg, topo, grouping, batch_size=per_device * topo.num_devices)
    label = f"{name}/{topo.num_devices}dev/{len(topo.groups)}dg/b{env.batch_size}/{grouping.num_groups}g"
    return label, env


def compare(policy: GNNPolicy, rng: np.random.Generator, n: int, zoo_every: int, start: int,
            playouts: int = 200) -> float:
    """Geomean over N fresh generated cases of the best value found by the tree search (as tag.optimize runs
    it: order auto, seeded with the best uniform strategy) with the GNN prior over the default prior, both
    at PLAYOUTS playouts."""
    ratios = []
    for i in range(n):
        label, env = make_case(rng, start + i, zoo_every)
        found = {}
        for key, prior in (("gnn", policy), ("default", None)):
            fresh = SearchEnv(env.graph, env.topology, env.grouping, batch_size=env.batch_size,
                              simulator=env.simulator)
            tree = mcts(fresh, order="auto", playouts=playouts, seed=0, prior=prior, start=best_uniform(fresh)[0])
            found[key] = max(tree.outcome.value, 1e-3)
        ratios.append(found["gnn"] / found["default"])
        say(f"  eval {label}: gnn {found['gnn']:.3f} default {found['default']:.3f}")
    return geomean(ratios)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, default=40, help="cases of generation 0")
    p.add_argument("--cases-per-generation", type=int, default=12, help="new cases of each later generation")
    p.add_argument("--zoo-every", type=int, default=4, help="every Nth case is a small zoo model (0: none)")
    p.add_argument("--playouts0", type=int, default=600, help="playouts of generation 0 (default prior)")
    p.add_argument("--playouts", type=int, default=600, help="playouts of later generations (network prior)")
    p.add_argument("--generations", type=int, default=2, help="generations after generation 0")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--min-visits", type=int, default=20, help="nodes visited less often give no sample")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--visit-temperature", type=float, default=0.5, help="visit-count temperature of the targets")
    p.add_argument("--value-weight", type=float, default=0.5,
                   help="weight of the completed-value softmax in the targets (the rest: visits)")
    p.add_argument("--value-temperature", type=float, default=0.05)
    p.add_argument("--eval-cases", type=int, default=6)
    p.add_argument("--budget-min", type=float, default=35.0,
                   help="no new generation starts after 60%% of this many minutes")
    p.add_argument("--out", default=WEIGHTS_PATH)
    p.add_argument("--record", default=os.path.join(ROOT, "tag", "gnn", "TRAINING.md"))
    args = p.parse_args(argv)
    t0 = time.time()
    rng = np.random.default_rng(args.seed)
    net = PolicyNet(seed=args.seed)
    trainer = Trainer(net, learning_rate=args.lr)
    policy = GNNPolicy(net, mix=0.1)
    samples = []
    case_index = 0
    for gen in range(args.generations + 1):
        if gen and time.time() - t0 > args.budget_min * 60 * 0.6:
            say(f"generation {gen}: skipped (time budget)")
            break
        n_cases = args.cases if gen == 0 else args.cases_per_generation
        tg = time.time()
        new = []
        for _ in range(n_cases):
            label, env = make_case(rng, case_index, args.zoo_every)
            case_index += 1
            got, tree = self_play(env, None if gen == 0 else policy, args.playouts0 if gen == 0 else args.playouts,
                                  seed=args.seed + case_index, order="auto", min_visits=args.min_visits,
                                  visit_temperature=args.visit_temperature, value_weight=args.value_weight,
                                  value_temperature=args.value_temperature)
            new += got
            say(f"gen {gen} case {label}: {len(got)} samples, best speedup {tree.outcome.value:.3f}")
        samples += new
        say(f"generation {gen}: {len(new)} new samples ({len(samples)} in all), self-play {time.time() - tg:.0f} s, "
            f"load {load1():.2f}")
        te = time.time()
        say(f"  mean target entropy (the best possible loss) {trainer.target_entropy(samples):.4f}")
        for epoch in range(args.epochs):
            loss = trainer.epoch(samples, args.batch, rng)
            say(f"  epoch {epoch}: loss {loss:.4f}")
        say(f"  training {time.time() - te:.0f} s, load {load1():.2f}")
        policy.forget()
    policy.mix = 0.0
    policy.forget()
    say("evaluation on fresh generated cases (never trained on), equal playouts:")
    ratio = compare(policy, rng, args.eval_cases, args.zoo_every, 10_000)
    say(f"  geomean gnn/default {ratio:.3f}")
    ref = reference_log_probs(net)
    net.save_npz(args.out, {"__reference_log_probs": ref.astype(np.float32),
                            "__seed": np.array(args.seed)})
    wall = time.time() - t0
    say(f"saved {args.out} ({os.path.getsize(args.out) / 1e6:.2f} MB); wall {wall / 60:.1f} min, load {load1():.2f}")
    if args.record:
        with open(args.record, "w") as f:
            f.write(_record(command_line(__file__, argv), wall))
    return 0


def _record(cmd: str, wall: float) -> str:
    return ("# GNN policy: training record\n\n"
            "The shipped weights `tag/gnn/policy_weights.npz` come from this command (fixed seed, CPU only, "
            "on a shared 2-core machine):\n\n"
            f"    {cmd}\n\n"
            f"Wall time: {wall / 60:.1f} min. Training cases are generated clusters and random layered graphs plus "
            "small zoo models (mlp, vgg19, resnet50, transformer, bert_base); the ready topology files and "
            "inception_v3, mobilenet_v2 and bert_large (the validation set of scripts/bench_gnn.py) are never "
            "used. What it printed:\n\n```\n"
            + "\n".join(LOG) + "\n```\n")


if __name__ == "__main__":
    sys.exit(main())
