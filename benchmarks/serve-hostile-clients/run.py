"""``diffdraft serve`` under hostile and heavy clients, on loopback only (issue 83, part 3).

Starts ``diffdraft serve --target default`` on 127.0.0.1, takes the normal request's text when the
server answers it alone, then runs :mod:`diffdraft.serve.hostile_load` twice for ``--seconds`` each:
the normal clients alone (the baseline), then the same normal clients beside one client of each
hostile kind. Records each kind's outcomes, the normal clients' latency in both runs and whether
every answer was complete and correct, /health's latency, the server's resident memory (RSS) before,
between and after the runs, and the CPU the server, the clients and other processes used meanwhile
(/proc/stat: this machine is shared). Then stops the server with SIGTERM. Writes results.json and
report.md beside this file (or into ``--out``). See README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

from diffdraft.serve.hostile_load import MixSettings, run_mix
from diffdraft.serve.limits import ServerLimits

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
NORMAL_BODY = {"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
SCHEMA = 1


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rss_mb(pid: int) -> dict[str, float]:
    """The server's resident memory now and at its peak (VmHWM), in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {name: int(fields[key].split()[0]) / 1024 for name, key in (("rss", "VmRSS"), ("peak", "VmHWM"))}


class CpuUse:
    """The CPU (cores, on average) the server, this load script and every other process used while
    the block ran: the two processes' own times, and all busy time in /proc/stat less theirs."""

    def __init__(self, server_pid: int) -> None:
        self.pids = {"server": server_pid, "clients": os.getpid()}

    def _ticks(self) -> dict[str, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        ticks = {"busy": sum(fields) - fields[3] - fields[4]}  # all but idle and iowait
        for name, pid in self.pids.items():
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks[name] = int(stat[11]) + int(stat[12])  # utime, stime
        return ticks

    def __enter__(self) -> CpuUse:
        self.start, self.begin = time.monotonic(), self._ticks()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._ticks()
        scale = os.sysconf("SC_CLK_TCK") * (time.monotonic() - self.start)
        used = {name: (end[name] - self.begin[name]) / scale for name in end}
        self.cores = {
            "server": round(used["server"], 2),
            "clients": round(used["clients"], 2),
            "other processes": round(max(0.0, used["busy"] - used["server"] - used["clients"]), 2),
        }


def wait_healthy(port: int, process: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode} before it served")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"the server did not answer /health within {seconds:.0f} s")


def alone_text(port: int) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    connection.request(
        "POST", "/v1/completions", json.dumps(NORMAL_BODY), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    if response.status != 200:
        raise SystemExit(f"the normal request alone got HTTP {response.status}: {response.read()[:300]!r}")
    return json.loads(response.read())["choices"][0]["text"]


def machine() -> dict:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {"cpu": model, "cores": os.cpu_count(), "commit": commit.stdout.strip()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="each run's length (default: 60)")
    parser.add_argument("--normal-clients", type=int, default=4)
    parser.add_argument("--method", default="ar", help="the server's --method (default: ar)")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    with tempfile.TemporaryFile("w+") as server_log:  # not a pipe: a full pipe would stall the server
        record = measure(args, server_log)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "report.md").write_text(report_md(record))
    log(f"wrote {args.out / 'results.json'} and report.md")
    return 0


def measure(args: argparse.Namespace, server_log: IO[str]) -> dict:
    """Start the server, run the baseline and the mix, stop it; every figure in one record."""
    limits = ServerLimits()
    port = free_port()
    command = [sys.executable, "-m", "diffdraft.cli", "serve", "--target", "default", "--method", args.method]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    log(f"starting: {' '.join(command[1:])}")
    server = subprocess.Popen(command, stderr=server_log, text=True)
    record: dict = {"schema": SCHEMA, "date": datetime.date.today().isoformat(), "machine": machine()}
    record["settings"] = {
        "server": command[3:],
        "limits": dataclasses.asdict(limits),
        "normal_body": NORMAL_BODY,
        "normal_clients": args.normal_clients,
        "seconds": args.seconds,
    }
    try:
        wait_healthy(port, server, 900)
        expected = alone_text(port)
        log(f"alone: {expected!r}")
        record["expected_text"] = expected
        record["rss_mb"] = {"start": rss_mb(server.pid)}
        settings = dict(
            url=f"http://127.0.0.1:{port}",
            normal_body=NORMAL_BODY,
            expected_text=expected,
            duration=args.seconds,
            normal_clients=args.normal_clients,
            max_tokens_cap=limits.max_tokens_cap,
        )
        log("warm-up: one request per normal client, together (a batch's first rounds are slow)")
        with ThreadPoolExecutor(args.normal_clients) as pool:
            texts = set(pool.map(alone_text, [port] * args.normal_clients))
        record["warm_up_texts_same"] = texts == {expected}
        for name, hostile in (("baseline", False), ("mix", True)):
            log(f"{name}: {args.seconds:.0f} s")
            with CpuUse(server.pid) as cpu:
                report = run_mix(MixSettings(**settings, hostile=hostile))
            record[name] = {**report.summary(), "cpu_cores": cpu.cores}
            record["rss_mb"][f"after {name}"] = rss_mb(server.pid)
            log(json.dumps(record[name]["normal"]))
        record["after_mix_alone_text_same"] = alone_text(port) == expected
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        server_log.seek(0)
        record["server_exit"] = server.returncode
        record["server_stderr_tail"] = server_log.read().splitlines()[-5:]
    return record


def report_md(record: dict) -> str:
    base, mix = record["baseline"], record["mix"]
    rss = record["rss_mb"]
    settings = record["settings"]

    def latency(run: dict) -> str:
        lat = run["normal"]["latency_ms"]
        return f"{lat['p50']:.0f} / {lat['p95']:.0f} / {lat['max']:.0f}"

    lines = [
        "# diffdraft serve under hostile clients",
        "",
        f"`benchmarks/serve-hostile-clients/run.py` at {record['machine']['commit']} on {record['date']}, "
        f"{record['machine']['cores']} cores ({record['machine']['cpu']}), the server and the clients on the "
        f"same machine over loopback: `diffdraft {' '.join(settings['server'])}` with its default limits "
        f"({json.dumps(settings['limits'])}). {settings['normal_clients']} normal clients send "
        f"`{json.dumps(settings['normal_body'])}` in a loop (streamed and not, in turn) for "
        f"{settings['seconds']:.0f} s alone, then {settings['seconds']:.0f} s beside one client of each "
        "hostile kind.",
        "",
        "## Normal clients",
        "",
        "| run | requests | correct (the text alone) | wrong or failed | req/s "
        "| latency p50 / p95 / max (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in (("alone", base), ("beside hostile clients", mix)):
        normal = run["normal"]
        lines.append(
            f"| {name} | {normal['requests']} | {normal['correct']} | {len(normal['wrong_or_failed'])} "
            f"| {normal['requests_per_s']} | {latency(run)} |"
        )
    lines += [
        "",
        "CPU used on average (cores of the machine's "
        f"{record['machine']['cores']}; other processes: other users of this shared machine):",
        "",
        "| run | server | load script (all clients) | other processes |",
        "|---|---|---|---|",
        *(
            f"| {name} | {run['cpu_cores']['server']} | {run['cpu_cores']['clients']} "
            f"| {run['cpu_cores']['other processes']} |"
            for name, run in (("alone", base), ("beside hostile clients", mix))
        ),
        "",
        f"/health during the mix: {mix['health']['probes']} probes, {mix['health']['failures']} failed, "
        f"p50 {mix['health']['latency_ms']['p50']} ms, max {mix['health']['latency_ms']['max']} ms "
        f"(alone: p50 {base['health']['latency_ms']['p50']} ms, "
        f"max {base['health']['latency_ms']['max']} ms).",
        "",
        "## Hostile clients (one of each kind, in a loop)",
        "",
        "Two of them generate beside the normal clients, as any client may: the tiny-temperature one "
        "(greedy, the normal request's own text) and the slow reader (a stream of up to "
        f"{settings['limits']['max_tokens_cap']} tokens, the cap, which holds a batch slot until it "
        "gives up at the deadline). The batch then holds up to "
        f"{settings['normal_clients'] + 2} sequences instead of {settings['normal_clients']}: part of "
        "the normal clients' slowdown is that load, not the hostility.",
        "",
        "| kind | outcomes | slowest answer (s) |",
        "|---|---|---|",
    ]
    for kind, result in mix["hostile"].items():
        outcomes = ", ".join(f"{outcome}: {count}" for outcome, count in result["outcomes"].items())
        lines.append(f"| {kind} | {outcomes} | {result['slowest_answer_s']} |")
    lines += [
        "",
        "## Server memory (RSS, MB)",
        "",
        "| when | RSS | peak so far |",
        "|---|---|---|",
        *(f"| {when} | {value['rss']:.0f} | {value['peak']:.0f} |" for when, value in rss.items()),
        "",
        "After the mix, the normal request alone still gets its text: "
        f"{record['after_mix_alone_text_same']}; "
        f"the server stopped on SIGTERM with exit code {record['server_exit']}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
