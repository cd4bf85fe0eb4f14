"""What Ray's own object transfer costs, beside the broadcast's relay: one of the compiled data
planes the fleet could have used instead of its relays.

    python scripts/lab/ray_transfer.py --size-mib 1024 --reps 5

Two Ray nodes on this machine (ray.cluster_utils: a raylet, an object store and an object manager
each, on loopback); an object of --size-mib random bytes is made on the first, and a task on the
second takes it as its argument, which makes the second node's object manager pull it from the
first's (gRPC chunks between the raylets, into shared memory). Per run: the pull's wall time (the
task's call to its answer) and the CPU every process of the cluster spent on it (raylets, object
stores, workers; what the cluster burns idle over the same time taken off), per GB moved. Then the
medians. Ray checks nothing against a content name or a run key here: a relay on top of it would
still hash every chunk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

MiB = 1024 * 1024


def cluster_cpu_seconds() -> float:
    """User + system CPU of every process under this one (Ray's, started by cluster_utils)."""
    parents, ticks = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # gone since the listing
            continue
        # After the command's closing parenthesis: state, ppid, ... utime (12th), stime (13th).
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = int(fields[11]) + int(fields[12])
    mine, total = {os.getpid()}, 0
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in mine and pid not in mine:
                mine.add(pid)
                total += ticks[pid]
                grew = True
    return total / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    import numpy
    import ray
    from ray.cluster_utils import Cluster

    store = 2 * args.size_mib * MiB + 256 * MiB
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"sender": 1}, "object_store_memory": store, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"receiver": 1}, object_store_memory=store)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        @ray.remote(resources={"sender": 1})
        def make(size: int):
            return numpy.frombuffer(os.urandom(size), dtype=numpy.uint8)

        @ray.remote(resources={"receiver": 1})
        def take(array) -> int:
            return int(array.nbytes)

        ray.get(take.remote(make.remote(MiB)))  # both workers up before the clock
        rates, cpus = [], []
        for rep in range(args.reps):
            ref = make.remote(args.size_mib * MiB)
            ray.wait([ref], fetch_local=False)
            idle_from, idle_started = cluster_cpu_seconds(), time.monotonic()
            time.sleep(1.0)
            idle = (cluster_cpu_seconds() - idle_from) / (time.monotonic() - idle_started)
            before, started = cluster_cpu_seconds(), time.monotonic()
            moved = ray.get(take.remote(ref))
            seconds = time.monotonic() - started
            cpu = cluster_cpu_seconds() - before - idle * seconds
            gb = moved / 1e9
            rates.append(gb / seconds)
            cpus.append(cpu / gb)
            print(f"run {rep + 1}: {gb:.2f} GB in {seconds:.2f} s ({gb / seconds:.2f} GB/s), "
                  f"{cpu / gb:.2f} s CPU per GB (the cluster's, idle {idle:.2f} CPU s/s taken off)", flush=True)
            del ref
        print(f"medians of {args.reps}: {statistics.median(rates):.2f} GB/s, "
              f"{statistics.median(cpus):.2f} s CPU per GB moved")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
