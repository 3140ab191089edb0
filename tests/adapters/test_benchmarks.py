"""The GPU benchmarks time what they say they time, checked on the CPU at a tiny size."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mtp_hooks.demo import tiny_models

from model_fixtures import SEQ, VOCAB, has_detach_field, has_hybrid
from ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden", "64", "--layers", "2", "--ffn", "128", "--vocab", "256", "--seq", "32"]


@pytest.fixture
def steps():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_mtp

        yield gpu_mtp.batch_and_steps(SimpleNamespace(vocab=VOCAB, seq=SEQ, batch=1, device="cpu"))[
            1
        ]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_timed_steps_leave_mode_switches_and_clearing_gradients_to_the_caller(build, steps):
    # train(), eval() and zero_grad() walk every module or parameter: inside a timed step the MTP
    # model, which has more of them, would pay more than the model built without MTP.
    train_step, _, eval_forward = steps
    model = build(attention="sdpa")  # megatron's local attention needs a mask on the CPU
    model.train()
    train_step(model)
    first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    train_step(model)
    assert first and all(
        torch.equal(p.grad, 2 * first[n]) for n, p in model.named_parameters() if n in first
    )
    eval_forward(model)
    assert all(m.training for m in model.modules())
    model.eval()
    eval_forward(model)
    assert not any(m.training for m in model.modules())


def mtp_runs_without_labels() -> bool:
    """Whether this megatron-core runs MTP in a forward without labels (0.16 cannot)."""
    model = tiny_models.build_gpt(tiny_models.TinySpec(seq_length=SEQ), attention="sdpa")
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    with torch.no_grad():
        try:
            model(ids, torch.arange(SEQ).unsqueeze(0), None)
        except AttributeError:  # labels.clone() on None
            return False
    return True


def run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/NAME`` with ``args`` in a fresh process, without this process's
    mtp-hooks switches and on a port of its own (this process may hold the inherited one);
    fails the test with its stderr if it fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_HOOKS_")}
    env["MASTER_PORT"] = str(free_port())
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.parametrize("pair, ratios", [("run", {"b/a", "a2/a"}), ("skip", {"c/d", "d2/d"})])
def test_the_ab_benchmark_reports_its_pair_beside_a_control(megatron_cpu, tmp_path, pair, ratios):
    if pair == "run" and not mtp_runs_without_labels():
        pytest.skip("the run pair's log-prob forward runs MTP without labels: megatron-core 0.16")
    run_script(
        "gpu_hooks_ab.py",
        *["--device", "cpu", "--model", "gpt", "--pair", pair, "--rounds", "3", "--warmup", "1"],
        *["--out", str(tmp_path), *TINY],
    )
    suffix = "" if pair == "run" else "_skip"
    result = json.loads((tmp_path / f"gpu_hooks_ab_gpt_local_bf16{suffix}.json").read_text())
    assert set(result["ratios"]) == ratios
    for per_timing in result["ratios"].values():
        assert set(per_timing) == {"train", "fwd", "eval"}
        for r in per_timing.values():
            assert 0 < r["low"] <= r["median"] <= r["high"]


def test_the_change_pair_times_a_skip_right_after_a_decision_change_beside_the_steady_state(
    megatron_cpu, tmp_path
):
    run_script(
        "gpu_hooks_ab.py",
        *["--device", "cpu", "--model", "gpt", "--pair", "change", "--rounds", "3"],
        *["--warmup", "1", "--out", str(tmp_path), *TINY],
    )
    result = json.loads((tmp_path / "gpu_hooks_ab_gpt_local_bf16_change.json").read_text())
    assert set(result["ratios"]) == {"s/d", "c/d", "x/d", "x/s", "w/s", "d2/d"}
    assert set(result["medians_ms"]) == {"d", "s", "c", "x", "w", "d2"}
    # per round: x runs MTP in its untimed step; s, c and w skip twice, x once in its timed
    # step; and three calibration steps each way
    assert result["decisions"] == {"run": 4 + 3, "skip": 4 * 7 + 3}
    assert result["burn"]["products"] >= 1
    for r in result["ratios"].values():
        assert 0 < r["low"] <= r["median"] <= r["high"]


def test_the_determinism_probe_names_the_innermost_module_that_differs_by_itself(
    megatron_cpu, monkeypatch, tmp_path
):
    if not has_hybrid():
        pytest.skip("the Nemotron-3-shaped model is a HybridModel: megatron-core 0.18+")
    monkeypatch.setenv("MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD", "1")  # build_models sets it
    sys.path.insert(0, str(ROOT / "benchmarks" / "nemotron"))
    try:
        import determinism
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "nemotron"))
    built = determinism.build_models

    def with_a_noisy_projection(args, *with_mtp):
        (model,) = built(args, *with_mtp)
        noisy = model.decoder.layers[1].mlp.linear_fc2  # adds noise to its own output alone
        noisy.register_forward_hook(
            lambda module, args, out: (out[0] + 1e-3 * torch.randn_like(out[0]), *out[1:])
        )
        return [model]

    monkeypatch.setattr(determinism, "build_models", with_a_noisy_projection)
    monkeypatch.setattr(determinism, "profiler", lambda: torch.profiler.profile())
    monkeypatch.setattr(
        sys,
        "argv",
        ["determinism.py", "--model", "nemotron", "--device", "cpu", "--pattern", "*-*-/*-"]
        + ["--hidden", "64", "--ffn", "64", "--vocab", "256", "--seq", "32", "--batch", "2"]
        + ["--out", str(tmp_path)],
    )
    determinism.main()
    result = json.loads((tmp_path / "determinism.json").read_text())
    # the noisy projection and every module around it differ between runs; replayed alone on
    # the same input, the projection differs by itself, and nothing inside it does
    assert result["innermost"] == ["decoder.layers.1.mlp.linear_fc2"]
    assert "decoder.layers.0.mlp" not in result["differ"]
    assert {"decoder.layers.1.mlp", "decoder", ""} <= set(result["differ"])
    assert result["output_difference"] > 0
    assert result["kernels"]["decoder.layers.1.mlp.linear_fc2"]["host_ms"] > 0


DRAFTER = ROOT / "benchmarks" / "rl_drafter"
TINY_RL = [  # the RL drafter loop at a size that runs in seconds on a CPU
    *("--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "128", "--phrases", "32"),
    *("--seq", "64", "--batch", "4", "--pretrain-steps", "20", "--rl-steps", "10"),
    *("--every", "5", "--prompts", "2", "--prompt-len", "8", "--gen", "8", "--device", "cpu"),
]


def test_the_rl_drafter_loop_keeps_the_policy_of_a_skip_under_detach_and_reports_each_goal(
    tmp_path,
):
    if not has_detach_field():
        pytest.skip("+detach needs mtp_detach_heads (megatron-core 0.19 on)")
    out = run_script("rl_drafter/gpu_rl_drafter.py", "--out", str(tmp_path), *TINY_RL)
    result = json.loads((tmp_path / "rl_drafter.json").read_text())
    trunks = {arm: data["trunk_vs_A"]["bit_identical"] for arm, data in result["arms"].items()}
    assert trunks == {"A": True, "B": False, "C": True, "D": True}
    assert [len(result["arms"][arm]["rows"]) for arm in "ABCD"] == [3, 3, 3, 3]
    assert result["arms"]["A"]["mtp_trained_steps"] == 0
    assert result["arms"]["B"]["mtp_trained_steps"] == 10
    assert "| A, C and D end with bit-identical trunk weights | yes |" in out.stdout


def test_an_rl_batch_marks_as_response_exactly_the_labels_that_are_response_tokens():
    sys.path.insert(0, str(DRAFTER))
    try:
        import gpu_rl_drafter as bench
        import rl_drafter_corpus as corpus
    finally:
        sys.path.remove(str(DRAFTER))
    args = bench.parse_args(["--seq", "40", "--batch", "6", "--prompt-len", "8", "--gen", "12"])
    lang = corpus.PhraseLanguage(64, 16, 1)
    batch = corpus.rl_batch(lang, lang, args, (3,), True)
    labels = torch.roll(batch.ids, -1, dims=1)
    for row in range(6):
        n = int((batch.ids[row, 8:] != corpus.PAD).sum())  # phrase tokens are never the pad
        assert 6 <= n <= 32 and bool((batch.ids[row, 8 + n :] == corpus.PAD).all())
        marked = batch.response[row].nonzero().flatten().tolist()
        assert marked == list(range(7, 7 + n))
        assert bool((labels[row, marked] != corpus.PAD).all())
    again = corpus.rl_batch(lang, lang, args, (3,), False)
    assert torch.equal(again.ids, batch.ids) and not again.mtp_response_only


def test_the_mask_arms_train_one_policy_and_differ_only_in_what_mtp_trains_on(tmp_path):
    if not has_detach_field():
        pytest.skip("+detach needs mtp_detach_heads (megatron-core 0.19 on)")
    out = run_script(
        "rl_drafter/gpu_rl_drafter.py", "--arms", "P,R", "--out", str(tmp_path), *TINY_RL
    )
    arms = json.loads((tmp_path / "rl_drafter.json").read_text())["arms"]
    assert arms["R"]["trunk_vs_P"] == {"bit_identical": True}
    forced = {arm: [row["teacher_forced"] for row in arms[arm]["rows"]] for arm in "PR"}
    assert forced["P"][0] == forced["R"][0]  # the same pretrained model at the first measurement
    assert forced["P"][-1]["loss"] != forced["R"][-1]["loss"]  # MTP learnt different tokens
    assert "| MTP trained on the response only drafts at least as well" in out.stdout


RECORDED = ROOT / "docs" / "benchmarks" / "rl_drafter"


def rl_drafter_report():
    sys.path.insert(0, str(DRAFTER))
    try:
        import rl_drafter_report
    finally:
        sys.path.remove(str(DRAFTER))
    return rl_drafter_report


def test_the_rl_drafter_report_sets_each_arm_against_the_a_of_its_own_run():
    report = rl_drafter_report()
    single = json.loads((RECORDED / "smoke_small_all_arms.json").read_text())  # one process
    text = report.report(single)
    assert "nan" not in text and text.count("A of its run:") == len(single["arms"])
    a = statistics.median(single["arms"]["A"]["train_step_ms"])
    assert all(report.baseline_ms(single, arm) == a for arm in single["arms"])
    assert f"A of its run: {a:.2f}" in text
    merged = json.loads((RECORDED / "rl_drafter.json").read_text())  # arms of several runs
    assert all("baseline_ms" in data for data in merged["arms"].values())
    del merged["arms"]["B"]["baseline_ms"]  # as if B's run had had no A
    without_a = ["B"]
    text = report.report(merged)
    assert "nan" not in text
    assert text.count("no A in its run") == len(without_a)
    import rl_drafter_goals  # imported with the report, from its folder

    assert set(rl_drafter_goals.mtp_cost(merged)) == set(merged["arms"]) - set(without_a)


def test_the_rl_drafter_report_prints_no_nan_where_c_drafted_nothing_after_the_shift():
    # On the H200, every arm's drafter accepted nothing right after the shift, and K/C read 0/0.
    report = rl_drafter_report()
    results = json.loads((RECORDED / "objectives" / "greedy.json").read_text())
    text = report.report(results)
    assert "nan" not in text and "K/C 1.000, -, 0.046" in text
    import rl_drafter_goals

    row = {"engine": {"2": {"accepted_length": 0.5}}}
    zero = {"engine": {"2": {"accepted_length": 0.0}}}
    ratio = rl_drafter_goals.length_ratio
    assert ratio(row, row) == 1.0 and ratio(row, zero) == float("inf")
    assert ratio(zero, zero) is None and rl_drafter_goals.even(None) == 1.0


def test_the_single_position_goal_sets_the_figure_against_the_engine_one_request_at_a_time():
    rl_drafter_report()  # puts the benchmark's folder on the path for its goals
    import rl_drafter_goals

    def row(single: float, alone: float | None) -> dict:
        engine = {
            "accepted_length": 0.9,
            **({} if alone is None else {"alone_accepted_length": alone}),
        }
        return {
            "engine": {"2": engine},
            "teacher_forced": {"single_position_accepted_length": single},
        }

    near = {"args": {}, "arms": {"C": {"rows": [row(1.02, 1.0), row(0.1, 0.1), row(1.0, None)]}}}
    [(goal, met, numbers)] = rl_drafter_goals.single_position_goal(near, sampling=False)
    assert met and "one request at a time within 5%" in goal
    assert "over 1 measurements" in numbers and "max 0.020" in numbers  # 0.1 is below 0.2
    far = {"args": {}, "arms": {"C": {"rows": [row(1.2, 1.0)]}}}
    assert rl_drafter_goals.single_position_goal(far, sampling=False)[0][1] is False
    assert rl_drafter_goals.single_position_goal(far, sampling=True) == []  # no sampled figure


def test_the_rl_drafter_plot_gives_each_arm_one_colour_in_every_panel(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_rgba_array

    report = rl_drafter_report()
    results = json.loads((RECORDED / "rl_drafter.json").read_text())
    figure = report.plot(results, str(tmp_path / "plot.png"))
    seen: dict[str, set[tuple[float, ...]]] = {}
    for axis in figure.axes:
        for artist in [*axis.lines, *axis.collections, *axis.patches]:
            arm = artist.get_label().split(" ")[0]  # "B" or "B k=2"
            if arm not in results["arms"]:
                continue  # the diagonal and matplotlib's own artists
            if hasattr(artist, "get_color"):
                colour = artist.get_color()
            else:
                colour = artist.get_facecolor()
            rgba = tuple(round(float(x), 6) for x in to_rgba_array(colour)[0])
            seen.setdefault(arm, set()).add(rgba)
    assert set(seen) == set(results["arms"])
    assert all(len(colours) == 1 for colours in seen.values()), seen
    assert len({colours.pop() for colours in seen.values()}) == len(seen)  # none shared


def test_the_objective_arms_keep_cs_trunk_and_sampled_rollouts_carry_the_sampled_figure(
    tmp_path,
):
    if not has_detach_field():
        pytest.skip("+detach needs mtp_detach_heads (megatron-core 0.19 on)")
    out = run_script(
        "rl_drafter/gpu_rl_drafter.py", "--arms", "C,K,T", "--temperature", "1",
        "--out", str(tmp_path),
        *TINY_RL,
    )  # fmt: skip
    arms = json.loads((tmp_path / "rl_drafter.json").read_text())["arms"]
    assert arms["K"]["trunk_vs_C"] == {"bit_identical": True}
    assert arms["T"]["trunk_vs_C"] == {"bit_identical": True}
    forced = {arm: [row["teacher_forced"] for row in arms[arm]["rows"]] for arm in "CKT"}
    assert forced["C"][0] == forced["K"][0] == forced["T"][0]  # one pretrained model
    assert forced["K"][-1]["loss"] != forced["C"][-1]["loss"]  # they learnt differently
    assert all(0 < row["sampled_accepted_length"] <= 2 for rows in forced.values() for row in rows)
    assert arms["K"]["mtp_trained_steps"] == arms["C"]["mtp_trained_steps"] == 10
    assert "| K's and T's trunks end bit-identical to C's" in out.stdout
    assert "| Sampled: K or T at least C's after the shift" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the benchmarks run")
@pytest.mark.parametrize("name", ["gpu_mtp.py", "gpu_hooks_ab.py"])
def test_a_gpu_benchmark_without_a_gpu_stops_with_one_line_naming_the_fix(name):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), "--model", "gpt"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "no CUDA GPU is visible here" in out.stderr and "--device cpu" in out.stderr
