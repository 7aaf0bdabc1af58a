"""Training on a tiny target: it learns, it resumes exactly, and 2 processes equal 1."""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch import distributed as dist

from diffdraft.drafters.checkpoint import load_draft_model
from diffdraft.drafters.dart_model import DART
from diffdraft.drafters.deer_model import DEER
from diffdraft.drafters.dflash_model import DFLARE, DFLASH
from diffdraft.drafters.families import make_drafter
from diffdraft.errors import CheckpointError, InvalidRequestError, TrainingDivergedError
from diffdraft.target.model import TargetModel
from diffdraft.train.config import TrainConfig
from diffdraft.train.dataset import TrainingSample
from diffdraft.train.draft_vocab import frequent_tokens
from diffdraft.train.evaluate import evaluate_drafter
from diffdraft.train.features import capture_features
from diffdraft.train.trainer import Trainer
from diffdraft.trees import DDTreeBuilder

from diffdraft_testing.engine import speculated_tokens
from diffdraft_testing.pickles import RunsCode
from diffdraft_testing.targets import hf_greedy, tiny_target, windowed_target

RESPONSE = 24


def make_samples(model, count: int, seed: int) -> list[TrainingSample]:
    """The target's own greedy responses to random prompts (what regeneration produces)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        prompt = torch.randint(1, model.config.vocab_size - 1, (6,), generator=g)
        out = model.generate(
            prompt[None],
            max_new_tokens=RESPONSE,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=RESPONSE,
        )
        samples.append(TrainingSample(f"s{seed}-{i}", out[0], 6))
    return samples


def config(tmp_path, **overrides) -> TrainConfig:
    base = dict(
        output_dir=str(tmp_path),
        num_layers=1,
        block_size=4,
        target_layer_ids=[0, 2],
        mask_token_id=62,
        batch_size=4,
        epochs=1,
        learning_rate=3e-3,
        save_every=5,
        anchors_per_sequence=8,
        seed=0,
    )
    base.update(overrides)
    return TrainConfig(**base)


def chain_tau(model, drafter_model, samples) -> float:
    evaluation = evaluate_drafter(drafter_model, TargetModel(model), samples, budgets=(4,), max_new_tokens=20)
    return evaluation.tau["chain"]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=11, vocab=64, layers=3)


@pytest.fixture(scope="module")
def bigram_target():
    """A target whose next token depends on the current token only (attention output zeroed).

    A random transformer's continuations are too arbitrary to generalize from 48 samples; this
    one has structure a drafter can learn in seconds, and learning it is what the test is about.
    """
    model = tiny_target("llama", seed=11, vocab=64, layers=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


@pytest.fixture(scope="module")
def bigram_data(bigram_target) -> tuple[list[TrainingSample], list[TrainingSample]]:
    """48 training samples and 6 held out, the bigram target's own greedy responses: generated once for
    every test that learns from them (a trainer only reads its samples)."""
    return make_samples(bigram_target, 48, seed=1), make_samples(bigram_target, 6, seed=2)


@pytest.mark.parametrize(
    ("variant", "draft_vocab_size", "compute_dtype"),
    [
        (DFLASH, 0, "float32"),
        (DFLARE, 0, "float32"),
        (DFLASH, 40, "float32"),
        (DFLARE, 0, "bfloat16"),
        (DART, 0, "float32"),
        (DART, 40, "float32"),
        (DEER, 0, "float32"),
    ],
)
def test_a_few_hundred_steps_clearly_beat_the_untrained_drafter(
    bigram_target, bigram_data, tmp_path, variant, draft_vocab_size, compute_dtype
):
    """A step's 4 sequences run as one micro-batch: one forward, in half the time of four, and the same
    step as one sequence at a time (the micro-batch test below checks that for every variant here)."""
    target = bigram_target
    train, held_out = bigram_data
    settings = config(
        tmp_path,
        variant=variant,
        epochs=25,
        batch_size=4,
        micro_batch_size=4,
        draft_vocab_size=draft_vocab_size,
        compute_dtype=compute_dtype,
        draft_length=2,
    )
    trainer = Trainer(settings, TargetModel(target), train)
    if draft_vocab_size:
        assert trainer.drafter.draft_vocab.tolist() == frequent_tokens(train, 64, draft_vocab_size).tolist()
    untrained = chain_tau(target, load_draft_model_copy(trainer), held_out)
    trainer.train()
    trained = chain_tau(target, load_draft_model(tmp_path / "final").to(target.dtype), held_out)
    assert trainer.state.step == 300
    assert trained > untrained + 0.5, (untrained, trained)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 300


@pytest.mark.parametrize("variant", [DFLASH, DFLARE, DART, DEER])
def test_drafters_of_a_sliding_window_target_train_on_its_taps_and_keep_its_output(tmp_path, variant):
    """Gemma 3 with a window of 4: shorter than every training sequence and every generation."""
    target = windowed_target("gemma3", 4, seed=11, vocab=64, layers=4)
    samples = make_samples(target, 8, seed=1)
    settings = config(tmp_path, variant=variant, target_layer_ids=[0, 2], draft_length=2, mask_token_id=62)
    Trainer(settings, TargetModel(target), samples).train()
    wrapped = TargetModel(target)
    drafter = make_drafter(load_draft_model(tmp_path / "final").to(target.dtype), wrapped)
    prompt = samples[0].token_ids[:10].tolist()
    assert speculated_tokens(wrapped, drafter, DDTreeBuilder(8), prompt, 20) == hf_greedy(
        target, prompt, 20, None
    )


@pytest.mark.parametrize("stage", [1, 2])
def test_deer_learns_from_token_labels_without_any_target_forward(
    bigram_target, bigram_data, tmp_path, stage
):
    """DEER reads tokens only: on the data's tokens its training never runs the target. A step's 4
    sequences run as one micro-batch, as in the test above."""
    target = TargetModel(bigram_target)
    train, held_out = bigram_data
    settings = config(
        tmp_path, variant=DEER, labels="tokens", stage=stage, max_suffix=4, epochs=25, micro_batch_size=4
    )
    trainer = Trainer(settings, target, train)
    untrained = chain_tau(bigram_target, load_draft_model_copy(trainer), held_out)

    def refuse(*args, **kwargs):
        raise AssertionError("the target ran during DEER training on token labels")

    target.model.forward = refuse
    trainer.train()
    del target.model.forward
    trained = chain_tau(bigram_target, load_draft_model(tmp_path / "final").to(bigram_target.dtype), held_out)
    assert trained > untrained + 0.5, (untrained, trained)


def test_a_non_finite_loss_stops_training_before_the_weights_change(target, tmp_path):
    trainer = Trainer(
        config(tmp_path, variant=DEER, labels="tokens", max_steps=3),
        TargetModel(target),
        make_samples(target, 8, 3),
    )
    before = copy.deepcopy(trainer.drafter.state_dict())
    trainer.batch_loss = lambda *args: (
        (torch.tensor(float("nan"), requires_grad=True),) + (torch.zeros(5),) * 3
    )
    with pytest.raises(TrainingDivergedError, match="diverged at step 1"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in trainer.drafter.state_dict().items())


def load_draft_model_copy(trainer: Trainer):
    return copy.deepcopy(trainer.drafter).to(trainer.target.dtype).eval()


def test_kill_and_resume_gives_the_same_weights_as_an_uninterrupted_run(target, tmp_path):
    samples = make_samples(target, 16, seed=3)
    straight = Trainer(config(tmp_path / "straight", epochs=4), TargetModel(target), samples)
    straight.train()

    class Killed(Exception):
        pass

    def kill_at_step_7(step):
        if step == 7:
            raise Killed

    interrupted = Trainer(config(tmp_path / "resumed", epochs=4), TargetModel(target), samples)
    with pytest.raises(Killed):
        interrupted.train(on_step=kill_at_step_7)
    with (tmp_path / "resumed" / "metrics.jsonl").open("a") as log:
        log.write('{"step": 8, "lo')  # the kill landed mid-write
    resumed = Trainer(config(tmp_path / "resumed", epochs=4), TargetModel(target), samples)
    assert resumed.state.step == 5  # the last checkpoint before the kill
    resumed.train()
    for name, tensor in straight.drafter.state_dict().items():
        torch.testing.assert_close(resumed.drafter.state_dict()[name], tensor, rtol=0, atol=0)
    rows = {
        run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("straight", "resumed")
    }
    assert [r["step"] for r in rows["resumed"]] == list(range(1, straight.total_steps + 1))  # once each
    assert [r["loss"] for r in rows["resumed"]] == [r["loss"] for r in rows["straight"]]


def test_cached_features_train_exactly_like_online_features(target, tmp_path):
    samples = make_samples(target, 8, seed=4)
    # a cache holds features only, so it serves cross-entropy on the tokens
    online = Trainer(config(tmp_path / "online", epochs=2, labels="tokens"), TargetModel(target), samples)
    online.train()

    def capture() -> int:
        pairs = ((s.sample_id, s.token_ids) for s in samples)
        return capture_features(TargetModel(target), [0, 2], pairs, tmp_path / "cache", 3, torch.float64)

    assert capture() == 8
    assert capture() == 0  # resumable: nothing left to capture
    cached = Trainer(
        config(tmp_path / "cached", epochs=2, labels="tokens"),
        TargetModel(target),
        samples,
        feature_cache=tmp_path / "cache",
    )
    cached.train()
    for name, tensor in online.drafter.state_dict().items():
        torch.testing.assert_close(cached.drafter.state_dict()[name], tensor)


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    # gloo on the loopback device: left to pick an interface it flaked on our CI machines (resets)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = tiny_target("llama", seed=11, vocab=64, layers=3)
        trainer = Trainer(config(out_dir, epochs=2), TargetModel(model), make_samples(model, 16, seed=5))
        trainer.train()  # rank 0 writes out_dir/final
    finally:
        dist.destroy_process_group()


def test_two_processes_equal_one_with_the_same_global_batch(target, tmp_path):
    single = Trainer(
        config(tmp_path / "single", epochs=2), TargetModel(target), make_samples(target, 16, seed=5)
    )
    single.train()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _ddp_worker, args=(2, port, str(tmp_path / "ddp")), nprocs=2, join=True, start_method="spawn"
    )
    ddp_weights = load_draft_model(tmp_path / "ddp" / "final").state_dict()
    for name, tensor in single.drafter.state_dict().items():
        torch.testing.assert_close(ddp_weights[name], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", [DFLASH, DFLARE, DART, DEER])
def test_micro_batches_of_padded_sequences_train_the_weights_one_at_a_time_does(target, tmp_path, variant):
    """Sequences of different lengths, three per forward (right-padded) or one: the same steps."""
    samples = [
        TrainingSample(s.sample_id, s.token_ids[: 12 + 3 * i], s.response_start)
        for i, s in enumerate(make_samples(target, 8, seed=12))
    ]
    trained = []
    for micro_batch_size in (1, 3):
        out = tmp_path / str(micro_batch_size)
        settings = config(out, variant=variant, batch_size=8, max_steps=3, micro_batch_size=micro_batch_size)
        Trainer(settings, TargetModel(target), samples).train()
        trained.append((load_draft_model(out / "final").state_dict(), read_metrics(out)))
    (one_weights, one_log), (batched_weights, batched_log) = trained
    for name, tensor in one_weights.items():
        torch.testing.assert_close(batched_weights[name], tensor, rtol=1e-4, atol=1e-5)
    for one, batched in zip(one_log, batched_log, strict=True):
        assert one["loss"] == pytest.approx(batched["loss"], rel=1e-5)
        assert one["accuracy_by_position"] == batched["accuracy_by_position"]


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_bad_inputs_are_clear_errors(target, tmp_path):
    samples = make_samples(target, 2, seed=6)
    with pytest.raises(InvalidRequestError, match="fewer than one batch"):
        Trainer(config(tmp_path / "a", batch_size=4), TargetModel(target), samples)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(InvalidRequestError, match="cannot write to the output directory"):
        Trainer(config(blocker / "out"), TargetModel(target), samples)


def test_bfloat16_compute_runs_the_matmuls_in_bfloat16_and_keeps_float32_weights(target, tmp_path):
    trainer = Trainer(
        config(tmp_path, max_steps=1, compute_dtype="bfloat16"),
        TargetModel(target),
        make_samples(target, 4, 9),
    )
    seen = []
    trainer.drafter.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    trainer.train()
    assert seen and set(seen) == {torch.bfloat16}
    assert {p.dtype for p in trainer.drafter.parameters()} == {torch.float32}
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in trainer.drafter.parameters())


def test_a_new_drafter_starts_with_unit_scale_logits_through_the_target_head(target, tmp_path):
    trainer = Trainer(config(tmp_path), TargetModel(target), make_samples(target, 4, seed=7))
    rows = target.get_output_embeddings().weight.detach().float().norm(dim=1)
    assert torch.allclose(trainer.drafter.norm.weight * rows.pow(2).mean().sqrt(), torch.tensor(1.0))


def test_max_steps_replaces_the_epoch_count_and_the_schedules_end_there(target, tmp_path):
    trainer = Trainer(
        config(tmp_path, epochs=5, max_steps=3), TargetModel(target), make_samples(target, 8, 8)
    )
    trainer.train()
    assert trainer.state.step == 3  # 2 steps per epoch: the third step starts a second epoch
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and records[-1]["lr"] == 0.0


def test_distillation_needs_the_online_forward_so_a_feature_cache_is_refused(target, tmp_path):
    samples = make_samples(target, 4, seed=5)
    with pytest.raises(InvalidRequestError, match="labels 'tokens'"):
        Trainer(config(tmp_path, labels="target"), TargetModel(target), samples, feature_cache=tmp_path / "c")


def test_eval_measures_agreement_with_the_target_and_the_target_s_own_ceiling(target, tmp_path):
    """On the target's greedy answers the target's top-1 is the text: ceiling 1, agreement = accuracy."""
    samples = make_samples(target, 4, seed=6)
    trainer = Trainer(config(tmp_path, max_steps=2), TargetModel(target), samples)
    trainer.train()
    evaluation = evaluate_drafter(trainer.drafter, TargetModel(target), samples, (4,), max_new_tokens=4)
    assert evaluation.target_accuracy == 1.0
    assert evaluation.agreement_by_position == evaluation.accuracy_by_position


def test_a_time_limit_stops_at_a_checkpoint_and_a_rerun_finishes_like_one_run(target, tmp_path, capsys):
    samples = make_samples(target, 16, seed=5)
    straight = Trainer(config(tmp_path / "straight", epochs=2), TargetModel(target), samples)
    straight.train()
    limited = config(tmp_path / "leased", epochs=2, save_every=1000, max_minutes=1e-9)
    stopped = Trainer(limited, TargetModel(target), samples).train()
    assert stopped.step == 1 < straight.total_steps  # the time was up after the first step
    assert (tmp_path / "leased" / "checkpoint-1").is_dir() and not (tmp_path / "leased" / "final").exists()
    assert "run again to resume" in capsys.readouterr().err
    resumed = Trainer(config(tmp_path / "leased", epochs=2), TargetModel(target), samples)
    assert resumed.state.step == 1
    resumed.train()
    assert (tmp_path / "leased" / "final").is_dir()
    for name, tensor in straight.drafter.state_dict().items():
        torch.testing.assert_close(resumed.drafter.state_dict()[name], tensor, rtol=0, atol=0)


def test_checkpoints_by_the_clock_as_well_as_by_steps(target, tmp_path):
    samples = make_samples(target, 8, seed=6)
    trainer = Trainer(
        config(tmp_path, epochs=1, save_every=1000, save_every_minutes=1e-9), TargetModel(target), samples
    )
    trainer.train()
    saved = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*"))
    assert saved == list(range(1, trainer.total_steps + 1))


def straight_and_half_written_runs(target, tmp_path, **settings):
    """(an uninterrupted run, trained; the samples) and a second run killed after step 7 (the last
    checkpoint before the kill is step 5): the two runs the resume tests compare."""
    samples = make_samples(target, 16, seed=3)
    straight = Trainer(config(tmp_path / "straight", **settings), TargetModel(target), samples)
    straight.train()

    def kill_at_step_7(step):
        if step == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Trainer(config(tmp_path / "resumed", **settings), TargetModel(target), samples).train(kill_at_step_7)
    return straight, samples


def assert_trained_alike(straight: Trainer, resumed: Trainer, run_dir) -> None:
    for name, tensor in straight.drafter.state_dict().items():
        torch.testing.assert_close(resumed.drafter.state_dict()[name], tensor, rtol=0, atol=0)
    assert [r["loss"] for r in read_metrics(run_dir)] == [
        r["loss"] for r in read_metrics(straight.output_dir)
    ]
    final = load_draft_model(run_dir / "final").state_dict()
    assert all(torch.equal(final[k], v.to(final[k].dtype)) for k, v in straight.drafter.state_dict().items())


def test_half_written_checkpoints_are_removed_on_resume_and_the_run_ends_like_one_run(
    target, tmp_path, capsys
):
    straight, samples = straight_and_half_written_runs(target, tmp_path, epochs=4)
    run = tmp_path / "resumed"
    # what kills at other instants leave: an older writer's staging folder (with the part of its state
    # file written so far), the present writer's, a checkpoint folder without its state, final/'s staging
    (run / "checkpoint-10.tmp").mkdir()
    (run / "checkpoint-10.tmp" / "training_state.pt").write_bytes(b"PK\x03\x04 cut")
    (run / ".checkpoint-10.tmp-0123abcd").mkdir()
    (run / "checkpoint-15").mkdir()
    (run / "checkpoint-15" / "config.json").write_text("{}")
    (run / ".final.tmp-0123abcd").mkdir()
    capsys.readouterr()
    resumed = Trainer(config(run, epochs=4), TargetModel(target), samples)
    err = capsys.readouterr().err
    assert err.startswith("diffdraft train: removed .checkpoint-10.tmp-0123abcd, .final.tmp-0123abcd, ")
    assert "checkpoint-10.tmp, checkpoint-15 from" in err and err.count("\n") == 1
    assert resumed.state.step == 5
    resumed.train()
    assert_trained_alike(straight, resumed, run)
    assert not [p for p in run.iterdir() if "tmp" in p.name]


def test_resume_refuses_a_state_that_would_run_code_and_resumes_once_it_is_deleted(target, tmp_path):
    straight, samples = straight_and_half_written_runs(target, tmp_path, epochs=2)
    run, marker = tmp_path / "resumed", tmp_path / "ran"
    torch.save({"state": RunsCode(marker)}, run / "checkpoint-5" / "training_state.pt")
    with pytest.raises(CheckpointError, match="does not unpickle those"):
        Trainer(config(run, epochs=2), TargetModel(target), samples)
    assert not marker.exists()
    shutil.rmtree(run / "checkpoint-5")  # as the error says: resume from the one before
    resumed = Trainer(config(run, epochs=2), TargetModel(target), samples)
    assert resumed.state.step == 0  # none before it: a fresh start, which trains alike too
    resumed.train()
    assert_trained_alike(straight, resumed, run)


def _write_until_killed(out_dir: str, writing: mp.Event) -> None:
    """Train 4 steps, checkpointing every 2, and stop for good halfway through writing checkpoint-4's
    state file, then signal: the parent kills this process there."""
    import time

    torch.set_num_threads(1)
    model = tiny_target("llama", seed=11, vocab=64, layers=3)
    real_save = torch.save

    def half_then_hang(state, path):
        if path.parent.name.startswith(".checkpoint-4.tmp-"):
            buffer = io.BytesIO()
            real_save(state, buffer)
            with open(path, "wb") as file:
                file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            writing.set()
            time.sleep(600)
        real_save(state, path)

    torch.save = half_then_hang
    Trainer(
        config(out_dir, max_steps=4, save_every=2), TargetModel(model), make_samples(model, 8, seed=3)
    ).train()


def test_a_writer_killed_mid_checkpoint_leaves_a_run_that_resumes_exactly(target, tmp_path, capsys):
    run = tmp_path / "killed"
    spawn = mp.get_context("spawn")
    writing = spawn.Event()
    writer = spawn.Process(target=_write_until_killed, args=(str(run), writing))
    writer.start()  # importing takes the child seconds: the straight run trains meanwhile
    samples = make_samples(target, 8, seed=3)
    straight = Trainer(config(tmp_path / "straight", max_steps=4, save_every=2), TargetModel(target), samples)
    straight.train()
    try:
        assert writing.wait(timeout=120), "the writer never reached checkpoint-4"
    finally:
        writer.kill()  # SIGKILL: nothing of the writer's own runs after it
        writer.join()
    staging = [p.name for p in run.glob(".checkpoint-4.tmp-*")]
    assert len(staging) == 1 and not (run / "checkpoint-4").exists()
    assert (run / staging[0] / "training_state.pt").stat().st_size > 0  # killed with half of it written
    capsys.readouterr()
    resumed = Trainer(config(run, max_steps=4, save_every=2), TargetModel(target), samples)
    assert f"diffdraft train: removed {staging[0]} from {run}" in capsys.readouterr().err
    assert resumed.state.step == 2
    resumed.train()
    assert_trained_alike(straight, resumed, run)
