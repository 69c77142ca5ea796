"""A new machine's warm start when the shared cache is far away: compile + first step of a job on a
brand-new machine whose only cache is a Redis server one round trip of 0, 50 or 100 ms away.

The network is real but local (``tests/_network.py``): the Redis server runs in a network namespace
of its own, the jobs in another, joined by a veth pair; a round trip above 0 goes through a relay
that holds every chunk for half of it in each direction (and charges the TCP handshake's round trip
to a connection's first bytes), since the kernel's ``netem`` may be missing. Bandwidth is not
limited: what a far server costs here is its round trips. Needs root (``ip netns``).

Per model:

* a producer (a new machine in the server's namespace, on loopback, holding the Ed25519 signing key)
  fills the shared cache;
* ``torch local-warm``: the job without warmstart run twice on one machine (the second is the figure),
  torch's own local caches warm: what a warm start could at best come down to;
* ``warmstart, rtt N ms``: a new machine each run (nothing local warm), a verify-only reader (the
  public key), its cache N ms away.

Warm configurations run ``--repeats`` times, interleaved. Figures per run: ``compile_s`` (compile +
first step, from the job), the process's wall time, the losses, and warmstart's store counters:
``round_trips`` (round trips to the server made by the job's own threads, each on the path of a
lookup), ``round_trips_ahead`` (those of the fetch ahead, on a thread of its own),
``fetched_ahead_hits`` and ``fetch_ahead_wait_s`` (how long lookups waited for the fetch). The round
trips on the critical path are the job's own plus the wait expressed in round trips. With
``--compare-off`` each round trip is also run with ``WARMSTART_FETCH_AHEAD=0`` (one lookup at a
time, as before fetching ahead). Usage::

    sudo python benchmarks/warm_start_network.py [--models mlp,dcn,encoder,deepfm] [--rtt-ms 0,50,100]
                                                 [--repeats 2] [--compare-off] [--json FILE]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _network import FarServer, netns_skip_reason
from _new_machine import MACHINE, finish, run_job

LOCAL_WARM = "torch local-warm"
COUNTERS = ("round_trips", "round_trips_ahead", "fetched_ahead_hits", "fetch_ahead_wait_s", "slow_trips")


def run(prefix: list[str], machine: Path, model: str, env: dict[str, str]) -> dict:
    """The job on ``machine``, in the namespace of ``prefix``; its RESULT, wall time and counters."""
    result = run_job(machine, model, env, prefix=prefix)
    counters = result.get("counters", {})
    remote = result.get("store", {}).get("remote", {})
    return {
        **result,
        **{name: counters.get(name, 0) for name in COUNTERS},
        "remote_hits": sum(kind.get("hits", 0) for kind in remote.values()),
        "remote_misses": sum(kind.get("misses", 0) for kind in remote.values()),
    }


def label(rtt_ms: float, off: bool = False) -> str:
    return f"warmstart, rtt {rtt_ms:g} ms" + (", fetch ahead off" if off else "")


def bench_model(
    model: str,
    far: FarServer,
    work: Path,
    keys: dict[str, str],
    rtts: list[float],
    repeats: int,
    progress,
    compare_off: bool = False,
) -> dict:
    results: dict = {}
    producer = {"WARMSTART": "1", "WARMSTART_CACHE_URL": far.local_url, "WARMSTART_KEY_FILE": keys["signing"]}
    progress(f"{model}: producer fills the shared cache (a new machine beside the server)")
    results["producer"] = [run(far.server_prefix, work / f"{model}-producer", model, producer)]
    progress(f"{model}: torch cold, the first of torch local-warm's two runs")
    results["torch cold"] = [run(far.client_prefix, work / f"{model}-local", model, {})]
    # Interleaved, so that a slow spell on this shared machine does not fall on one configuration.
    for r in range(repeats):
        progress(f"{model}: {LOCAL_WARM} ({r + 1}/{repeats})")
        results.setdefault(LOCAL_WARM, []).append(run(far.client_prefix, work / f"{model}-local", model, {}))
        for rtt in rtts:
            for off in (False, True) if compare_off else (False,):
                progress(f"{model}: {label(rtt, off)}, a new machine ({r + 1}/{repeats})")
                reader = {"WARMSTART": "1", "WARMSTART_CACHE_URL": far.url(rtt), "WARMSTART_KEY_FILE": keys["verify"]}
                if off:
                    reader["WARMSTART_FETCH_AHEAD"] = "0"
                machine = work / f"{model}-rtt{rtt:g}-{r}{'-off' if off else ''}"
                results.setdefault(label(rtt, off), []).append(run(far.client_prefix, machine, model, reader))
                shutil.rmtree(machine, ignore_errors=True)  # its compiled code is not needed again
    return results


def mean(runs: list[dict], name: str) -> float:
    return statistics.fmean(x.get(name, 0) for x in runs)


def summarize(r: dict, rtts: list[float]) -> dict:
    """Per configuration: the means, and the ratios to rtt 0 (or the lowest round trip asked for,
    the same setting) and to torch local-warm; the round trips on the critical path; whether every
    warm run's losses are the producer's."""
    local = mean(r[LOCAL_WARM], "compile_s")
    out = {}
    names = [LOCAL_WARM] + [label(rtt, off) for off in (False, True) for rtt in rtts if label(rtt, off) in r]
    for name in names:
        runs = r[name]
        base = mean(r[label(rtts[0], name.endswith("fetch ahead off"))], "compile_s")
        rtt_s = next((rtt for rtt in rtts if name.startswith(label(rtt))), 0.0) / 1000
        compile_s = mean(runs, "compile_s")
        waited = mean(runs, "fetch_ahead_wait_s")
        out[name] = {
            # The job's own round trips, and the time it waited for the fetch ahead in round trips.
            "path_round_trips": mean(runs, "round_trips") + (waited / rtt_s if rtt_s else 0.0),
            "compile_s": compile_s,
            "wall_s": mean(runs, "wall_s"),
            "over_base": compile_s / base,
            "over_local_warm": compile_s / local,
            **{c: mean(runs, c) for c in (*COUNTERS, "remote_hits", "remote_misses")},
            "same_loss": all(x["losses"] == r["producer"][0]["losses"] for x in runs),
        }
    return out


def tables(out: dict, rtts: list[float]) -> list:
    from rich.table import Table

    base = f"rtt {rtts[0]:g}"
    detail = Table(
        title=f"compile + first step on a new machine, the shared cache across a delayed network; means of "
        f"{out['repeats']}; round trips on the path: the job's own, plus its wait for the fetch ahead in "
        "round trips",
        title_justify="left",
    )
    columns = (
        "model",
        "configuration",
        "compile s",
        "wall s",
        f"/ {base}",
        "/ local-warm",
        "round trips on the path",
        "job's own",
        "fetched ahead",
        "fetched-ahead hits",
        "waited for it s",
        "remote hits",
        "remote misses",
        "same loss",
    )
    for column in columns:
        detail.add_column(column, justify="left" if column in ("model", "configuration") else "right")
    for model, r in out["models"].items():
        for name, s in r["summary"].items():
            warm = name != LOCAL_WARM
            detail.add_row(
                model,
                name,
                f"{s['compile_s']:.2f}",
                f"{s['wall_s']:.2f}",
                f"{s['over_base']:.2f}x" if warm else "",
                f"{s['over_local_warm']:.2f}x" if warm else "",
                f"{s['path_round_trips']:.1f}" if warm else "",
                f"{s['round_trips']:.0f}" if warm else "",
                f"{s['round_trips_ahead']:.0f}" if warm else "",
                f"{s['fetched_ahead_hits']:.0f}" if warm else "",
                f"{s['fetch_ahead_wait_s']:.2f}" if warm else "",
                f"{s['remote_hits']:.0f}" if warm else "",
                f"{s['remote_misses']:.0f}" if warm else "",
                "yes" if s["same_loss"] else "NO",
            )
    summary = Table(
        title=f"summary: each round trip's compile + first step over {base}'s and over torch local-warm's, "
        "mean across models",
        title_justify="left",
    )
    for column in (
        "round trip",
        "fetch ahead",
        f"/ {base}",
        f"/ {base}, on",
        "/ local-warm",
        "round trips on the path",
        f"s added over {base}",
    ):
        summary.add_column(column, justify="left" if column in ("round trip", "fetch ahead") else "right")
    out["summary"] = {}
    for off in (False, True):
        for rtt in rtts:
            name = label(rtt, off)
            if not all(name in r["summary"] for r in out["models"].values()):
                continue
            rows = [r["summary"][name] for r in out["models"].values()]
            bases = [r["summary"][label(rtts[0], off)] for r in out["models"].values()]
            on_bases = [r["summary"][label(rtts[0])] for r in out["models"].values()]
            figures = {
                "over_base": statistics.fmean(s["over_base"] for s in rows),
                # Against the loopback run with fetch ahead on: the figure a far machine should match.
                "over_base_on": statistics.fmean(
                    s["compile_s"] / b["compile_s"] for s, b in zip(rows, on_bases, strict=True)
                ),
                "over_local_warm": statistics.fmean(s["over_local_warm"] for s in rows),
                "path_round_trips": statistics.fmean(s["path_round_trips"] for s in rows),
                "added_s": statistics.fmean(s["compile_s"] - b["compile_s"] for s, b in zip(rows, bases, strict=True)),
            }
            out["summary"][f"{rtt:g}{' off' if off else ''}"] = figures
            summary.add_row(
                f"{rtt:g} ms",
                "off" if off else "on",
                f"{figures['over_base']:.2f}x",
                f"{figures['over_base_on']:.2f}x",
                f"{figures['over_local_warm']:.2f}x",
                f"{figures['path_round_trips']:.1f}",
                f"{figures['added_s']:.2f}",
            )
    return [detail, summary]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,dcn,encoder,deepfm")
    parser.add_argument("--rtt-ms", default="0,50,100", help="round trips to the cache, ms (the first is the base)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each warm configuration (mean reported)")
    parser.add_argument(
        "--compare-off", action="store_true", help="also run each round trip with WARMSTART_FETCH_AHEAD=0"
    )
    parser.add_argument("--json", default=None, help="write all figures here")
    args = parser.parse_args()
    reason = netns_skip_reason()
    if reason is not None:
        sys.exit(f"warm_start_network.py cannot run here: {reason}")
    from rich.console import Console

    from warmstart.compile_cache.signing import generate_key_pair

    console = Console(width=200)
    rtts = [float(x) for x in args.rtt_ms.split(",")]
    work = Path(tempfile.mkdtemp(prefix="ws-bench-network-"))
    generate_key_pair(work / "signing.key", work / "verify.pub")
    keys = {"signing": str(work / "signing.key"), "verify": str(work / "verify.pub")}
    out: dict = {"machine": MACHINE, "repeats": args.repeats, "rtt_ms": rtts, "models": {}}
    try:
        with FarServer(work / "redis", rtts_ms=rtts) as far, console.status("") as status:
            for model in args.models.split(","):
                out["models"][model] = bench_model(
                    model,
                    far,
                    work,
                    keys,
                    rtts,
                    args.repeats,
                    lambda msg: status.update(f"compiling {msg}"),
                    args.compare_off,
                )
                out["models"][model]["summary"] = summarize(out["models"][model], rtts)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    finish(console, tables(out, rtts), out, args.json)


if __name__ == "__main__":
    main()
