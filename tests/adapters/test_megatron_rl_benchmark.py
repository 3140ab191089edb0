"""The Megatron-LM GRPO benchmark's own parts (benchmarks/megatron_rl/), checked on the CPU:
the task and its reward, the tokenizer, the corpus, the pin check, the launcher's response mask
and arms, and the step recorder on a real model. Megatron-LM's RL code itself is not on the
package index; the agent's test runs where ``MEGATRON_LM`` names a checkout of it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mtp_hooks

from model_fixtures import has_detach_field

HERE = Path(__file__).resolve().parents[2] / "benchmarks" / "megatron_rl"


@pytest.fixture(autouse=True)
def benchmark_path():
    sys.path.insert(0, str(HERE))
    yield
    sys.path.remove(str(HERE))
    for name in ("task", "tokenizer", "corpus", "pin", "launch", "steps", "agent", "report"):
        sys.modules.pop(name, None)


def test_prompts_are_fixed_by_seed_and_index_and_differ_between_seeds():
    import task

    assert task.problem(1, 7) == task.problem(1, 7)
    assert task.problem(1, 7) != task.problem(2, 7) and task.problem(1, 7) != task.problem(1, 8)
    example = task.problem(3, 0)
    assert example.prompt.startswith("count ") and example.prompt.endswith(" =")
    assert task.SHORTEST <= len(example.numbers) <= task.LONGEST
    pairs = zip(example.numbers, example.numbers[1:], strict=False)
    steps = {(b - a) % task.NUMBERS for a, b in pairs}
    assert steps <= {1, task.STEP}
    assert isinstance(example.problem_id, str)  # megatron's rollout records want a string


def test_the_reward_pays_for_each_step_of_two_and_charges_for_missing_or_extra_numbers():
    import task

    example = task.problem(1, 0)
    target = " ".join(map(str, example.target))
    by_one = " ".join(str((example.last + i) % task.NUMBERS) for i in range(1, 33))
    assert len(example.target) == task.ANSWER_LENGTH
    assert task.reward(target + " <eos>", example.last) == 1.0
    assert task.reward(target + " <eos> 5 5", example.last) == 1.0  # after the end: ignored
    assert task.reward(by_one, example.last) == 0.0
    assert task.reward("", example.last) == 0.0
    assert task.reward(target + " 1 2", example.last) == 32 / 34  # 1 -> 2 is no step of two
    half = example.target[:16]
    assert task.reward(" ".join(map(str, half)), example.last) == 16 / 32
    # each step counts on its own: one wrong number costs its own step and the next one
    wrong = [*example.target[:5], -7, *example.target[6:]]
    spoken = " ".join("x" if n == -7 else str(n) for n in wrong)
    assert task.reward(spoken, example.last) == 30 / 32
    assert task.reward("count = x", example.last) == 0.0


def test_pretraining_steps_by_two_with_the_given_probability_in_prompt_and_answer():
    import task

    rng = random.Random(0)
    twos = total = 0
    for _ in range(400):
        words = task.pretraining_document(rng, 0.3).split()
        cut = words.index(task.SEPARATOR)
        numbers = [int(w) for w in words[1:cut] + words[cut + 1 :]]
        assert len(words) - cut - 1 == task.ANSWER_LENGTH
        pairs = zip(numbers, numbers[1:], strict=False)
        differences = [(b - a) % task.NUMBERS for a, b in pairs]
        assert set(differences) <= {1, task.STEP}
        twos += differences.count(task.STEP)
        total += len(differences)
    assert 0.27 < twos / total < 0.33
    with pytest.raises(ValueError, match="probability"):
        task.pretraining_document(rng, 1.5)


def test_the_tokenizer_has_one_token_per_word_pads_with_1_and_ends_with_3(tmp_path):
    pytest.importorskip("tokenizers")
    import task
    import tokenizer
    from tokenizers import Tokenizer

    loaded = Tokenizer.from_file(str(Path(tokenizer.write(str(tmp_path))) / "tokenizer.json"))
    vocabulary = task.vocabulary()
    assert [loaded.token_to_id(w) for w in vocabulary] == list(range(len(vocabulary)))
    assert loaded.token_to_id(task.PAD) == 1 and loaded.token_to_id(task.EOS) == 3
    text = task.problem(1, 0).prompt
    ids = loaded.encode(text).ids
    assert len(ids) == len(text.split()) and loaded.decode(ids) == text
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["pad_token"] == task.PAD and config["eos_token"] == task.EOS


def test_the_corpus_is_megatrons_indexed_format_with_an_end_token_after_each_document(tmp_path):
    pytest.importorskip("tokenizers")
    import corpus
    import tokenizer
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokenizer.write(str(tmp_path))
    written = corpus.write(str(tmp_path), str(tmp_path / "c"), 50, 0.3, seed=1)
    documents = IndexedDataset(str(tmp_path / "c"))
    assert len(documents) == 50 and sum(len(d) for d in documents) == written
    assert all(d[-1] == 3 and 3 not in d[:-1] and d[0] == 4 for d in documents)  # copy ... eos


def test_the_pin_check_refuses_a_tree_that_differs_by_one_byte(tmp_path, monkeypatch):
    import pin

    tree = tmp_path / "mlm"
    (tree / "megatron").mkdir(parents=True)
    (tree / "train_rl.py").write_text("print('rl')\n")
    (tree / "megatron" / "__init__.py").write_text("")
    digest = pin.tree_digest(str(tree))
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps({"trees": [{"name": "t", "commit": "c", "digest": digest}]}))
    monkeypatch.setattr(pin, "PINS", str(pins))
    assert pin.check(str(tree))["name"] == "t"
    (tree / "megatron" / "__pycache__").mkdir()  # what importing and building leave behind
    (tree / "megatron" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (tree / "megatron" / "helpers.so").write_bytes(b"\0")
    assert pin.tree_digest(str(tree)) == digest
    (tree / "train_rl.py").write_text("print('rl!')\n")
    with pytest.raises(SystemExit, match="is not pinned"):
        pin.check(str(tree))


def test_the_pinned_trees_name_a_commit_and_a_digest_each():
    import pin

    trees = pin.pinned()
    assert trees and all(len(t["commit"]) == 40 and len(t["digest"]) == 64 for t in trees)


def test_the_response_mask_marks_exactly_the_labels_that_are_response_tokens(tmp_path):
    import launch
    import task

    words = task.vocabulary()
    example = task.problem(2, 0)
    text = f"{task.BOS} {example.prompt} " + " ".join(map(str, example.target)) + f" {task.EOS}"
    ids = [words.index(w) for w in text.split()]
    ids += [words.index(task.PAD)] * 5
    input_ids = torch.tensor([ids])
    separator, end = words.index(task.SEPARATOR), words.index(task.EOS)
    mask = launch.response_mask(input_ids, separator, end)[0]
    labels = ids[1:] + [ids[0]]  # megatron's derived labels: the next token
    first_answer = ids.index(separator) + 1
    response = {first_answer - 1 + i for i in range(len(example.target) + 1)}  # and the end
    assert {i for i, m in enumerate(mask.tolist()) if m} == response
    assert [labels[i] for i in sorted(response)][-1] == end


def test_a_separator_the_policy_writes_in_its_response_stays_in_the_response():
    # On the H200 the policy wrote the prompt's separator in a response by step 8, and a mask
    # that took a second separator for a second prompt stopped the run.
    import launch
    import task

    words = task.vocabulary()
    separator, end = words.index(task.SEPARATOR), words.index(task.EOS)
    prompt = [words.index(task.BOS), words.index(task.COMMAND), words.index("2"), separator]
    response = [words.index("4"), separator, words.index("6"), end]
    ids = prompt + response + [words.index(task.PAD)] * 3
    mask = launch.response_mask(torch.tensor([ids]), separator, end)[0].tolist()
    # labels at positions 3..6 are the response's tokens 4, =, 6 and the end token
    assert [i for i, m in enumerate(mask) if m] == [3, 4, 5, 6]


def test_in_a_packed_row_each_trajectory_gets_its_own_response_mask():
    # --rl-use-sequence-packing puts several trajectories in one row: each one's prompt stays
    # out, with or without the begin token, and a trajectory that ran to the length limit
    # without its end token is masked to its own end, not into the next one's prompt.
    import launch
    import task

    words = task.vocabulary()
    separator, end = words.index(task.SEPARATOR), words.index(task.EOS)
    starts = (words.index(task.BOS), words.index(task.COMMAND))

    def ids(text: str) -> list[int]:
        return [words.index(w) for w in text.split()]

    first = ids("<bos> count 2 3 = 5 7 <eos>")  # labels 5, 7, <eos> at positions 4..6
    unended = ids("count 9 = 11 = 13")  # no begin token, a separator in its response, no end
    third = ids("<bos> count 1 = 3 <eos>")
    row = first + unended + third + ids("<pad> <pad>")
    mask = launch.response_mask(torch.tensor([row]), separator, end, starts)[0].tolist()
    second, last = len(first), len(first) + len(unended)
    # the unended one's last label (at second + 5) is the next trajectory's begin token
    expected = [4, 5, 6] + [second + i for i in (2, 3, 4, 5)] + [last + 3, last + 4]
    assert [i for i, m in enumerate(mask) if m] == expected
    alone = launch.response_mask(torch.tensor([first]), separator, end, starts)[0].tolist()
    assert alone == mask[: len(first)]


def test_the_launcher_refuses_drafting_with_rotary_positions_before_train_rl_runs():
    import launch

    with pytest.raises(SystemExit, match="--position-embedding-type none"):
        launch.refuse_drafting_past_the_rotary_table(
            ["--position-embedding-type", "rope", "--num-speculative-tokens", "2"]
        )
    for fine in (
        ["--position-embedding-type", "rope", "--num-speculative-tokens", "0"],
        ["--position-embedding-type", "none", "--num-speculative-tokens", "2"],
        ["--position-embedding-type", "rope"],
    ):
        launch.refuse_drafting_past_the_rotary_table(fine)


def test_the_launcher_refuses_packing_rows_longer_than_a_rollout_before_train_rl_runs():
    import launch

    packed = ["--rl-use-sequence-packing", "--seq-length", "2048"]
    with pytest.raises(SystemExit, match=r"run without packing \(PACK=0\)"):
        launch.refuse_packing_that_truncates([*packed, "--inference-max-seq-length", "128"])
    for fine in (
        [*packed, "--inference-max-seq-length", "2048"],
        ["--seq-length", "128", "--inference-max-seq-length", "128"],
        ["--seq-length", "2048", "--inference-max-seq-length", "128"],  # unpacked: rows pad
    ):
        launch.refuse_packing_that_truncates(fine)


def test_the_launcher_refuses_several_rows_a_forward_without_packing_before_train_rl_runs():
    import launch

    with pytest.raises(SystemExit, match=r"run with MICRO_BATCH=1, or pack \(PACK=1\)"):
        launch.refuse_unpacked_micro_batches(["--micro-batch-size", "8", "--seq-length", "128"])
    for fine in (
        ["--micro-batch-size", "1"],
        [],
        ["--micro-batch-size", "8", "--rl-use-sequence-packing", "--seq-length", "128"],
    ):
        launch.refuse_unpacked_micro_batches(fine)


def test_the_launcher_ends_the_process_with_code_1_when_train_rl_raises(capsys):
    import launch

    codes: list[int] = []

    def fails() -> None:
        raise RuntimeError("the trainer stopped")

    launch.run_or_exit(fails, exit=codes.append)
    assert codes == [1] and "the trainer stopped" in capsys.readouterr().err
    launch.run_or_exit(lambda: sys.exit(3), exit=codes.append)
    assert codes == [1, 1]
    with pytest.raises(SystemExit):  # a clean exit stays one
        launch.run_or_exit(lambda: sys.exit(0), exit=codes.append)
    launch.run_or_exit(lambda: None, exit=codes.append)
    assert codes == [1, 1]


def test_the_launcher_splits_its_own_options_from_train_rls():
    import launch

    own, rest = launch.parse(["--megatron-lm", "d", "--arm", "A", "--record", "r", "--", "--x"])
    assert (own.megatron_lm, own.arm, own.record, own.no_mask, rest) == (
        "d",
        "A",
        "r",
        False,
        ["--x"],
    )


def set_up_arm(arm: str, tmp_path) -> dict:
    """``launch.set_up_mtp_hooks`` for ``arm`` with the task's tokenizer; auto-attach left off
    afterwards. Returns the recorder's callbacks."""
    pytest.importorskip("tokenizers")
    import launch
    import tokenizer

    if not has_detach_field():
        pytest.skip("the arms clip MTP apart, which needs megatron-core 0.19's grad-norm groups")
    directory = tokenizer.write(str(tmp_path))
    own, _ = launch.parse(["--megatron-lm", "d", "--arm", arm, "--record", "r", "--"])
    try:
        return launch.set_up_mtp_hooks(own, ["--tokenizer-model", directory])
    finally:
        mtp_hooks.auto_attach(False)


def test_arm_a_registers_its_controller_at_the_first_rollouts_and_skips_mtp_once_good(tmp_path):
    callbacks = set_up_arm("A", tmp_path)
    names = {info.name for info in mtp_hooks.plugins.list_plugins()}
    assert "response-only" in names and "acceptance-controller" not in names
    assert mtp_hooks.decide(None, "train").run  # before any figures: train the drafter
    good = {"proposed": [100, 100], "accepted": [90, 80], "accepted_length": 1.7}
    callbacks["on_rollouts"](good)  # the target is 0.95 x this first step's 1.7
    assert not mtp_hooks.decide(None, "train").run
    callbacks["on_rollouts"]({"proposed": [100, 100], "accepted": [50, 20], "accepted_length": 0.7})
    assert mtp_hooks.decide(None, "train").run
    assert not mtp_hooks.decide(None, "eval").run  # the log-prob passes


def test_arm_a_on_a_stale_drafter_reports_it_and_advises_no_drafting_until_refreshed(tmp_path):
    import launch

    own, _ = launch.parse(
        ["--megatron-lm", "d", "--arm", "A", "--record", "r", "--stale-steps", "2",
         "--step-cost", "0.5", "--"]
    )  # fmt: skip
    mtp_hooks.configure(launch.POLICIES["S"])  # what set_up_mtp_hooks does for a stale start
    on_rollouts = launch.controlled(own)

    def counts(first: int, second: int) -> dict:
        return {"proposed": [100, 100], "accepted": [first, second]}

    found = [on_rollouts({**counts(90, 80), "accepted_length": 1.7})]  # step 1: the target
    assert not mtp_hooks.decide(None, "train").run  # S's policy still holds
    found.append(on_rollouts(counts(1, 0)))  # step 2: a drafter that worked accepts nothing
    found.append(on_rollouts(counts(20, 5)))  # step 3: the controller takes over, trains MTP
    assert mtp_hooks.decide(None, "train").run and not mtp_hooks.decide(None, "eval").run
    found.append(on_rollouts(counts(95, 90)))  # step 4: refreshed
    assert [f["advised_k"] for f in found] == [2, 0, 0, 2]
    assert [f["dead"] for f in found] == [False, True, False, False]
    assert [len(f["warnings"]) for f in found] == [0, 1, 0, 0]
    assert [f["trains_mtp"] for f in found] == [False, True, True, False]


def test_arm_k_trains_mtp_detached_toward_the_policy_on_the_response_only(tmp_path):
    set_up_arm("K", tmp_path)
    assert "response-only" in {info.name for info in mtp_hooks.plugins.list_plugins()}
    train = mtp_hooks.decide(None, "train")
    assert (
        train.run
        and train.options.detach
        and train.options.objective == "kl"
        and train.options.temperature == 1.0
    )
    assert not mtp_hooks.decide(None, "eval").run  # the log-prob passes


def test_the_recorder_tells_a_grpo_steps_phases_apart_on_a_real_model(build, batch, tmp_path):
    import steps

    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        pytest.skip("InferenceMode exists from megatron-core 0.18")
    record = tmp_path / "steps.jsonl"
    model = build()
    recorder = steps.StepRecorder(str(record))
    steps.install(recorder)
    for _ in range(2):  # two GRPO steps
        model.eval()
        with torch.no_grad(), InferenceMode.active():
            for _ in range(3):  # the engine's forwards (the first call only finds the model)
                try:
                    model(*batch.args(), runtime_gather_output=True)
                except Exception:  # a CPU inference pass may fail later; the hook ran first
                    pass
        steps.note_rollout(0.5, 10)
        model.train()
        with torch.no_grad():
            for _ in range(4):  # old and reference log-probs
                model(*batch.args(), labels=batch.labels)
        for _ in range(2):  # the policy-loss microbatches
            model(*batch.args(), labels=batch.labels).sum().backward()
    model.eval()
    with torch.no_grad(), InferenceMode.active():
        try:
            model(*batch.args(), runtime_gather_output=True)  # the next step's rollouts begin
        except Exception:
            pass
    recorder.hook.remove()
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    records = [r for r in lines if "rollout_s" in r]
    trains = [r for r in lines if "train_s" in r]
    assert [r["step"] for r in records] == [1, 2] and [r["step"] for r in trains] == [1, 2]
    assert all(r["logprob_forwards"] == 4 and r["rollouts"] == 1 for r in records)
    assert records[0]["reward"] == 0.5 and records[0]["output_tokens"] == 10
    assert all(r["mtp_trained"] for r in records)  # megatron's default with MTP layers
    assert all(r["rollout_s"] > 0 for r in records) and all(t["train_s"] > 0 for t in trains)


def test_engine_counter_differences_give_the_chained_acceptance_of_one_step():
    import steps

    before = {"proposed": [10, 10], "accepted": [6, 3], "verify_steps": 10}
    now = {"proposed": [30, 30], "accepted": [21, 13], "verify_steps": 30}
    spec = steps.difference(now, before)
    assert spec["proposed"] == [20, 20] and spec["accepted"] == [15, 10]
    assert spec["chain_acceptance"] == [0.75, 0.5] and spec["accepted_length"] == 1.25
    assert steps.difference(None, before)["accepted_length"] is None
    assert steps.difference(now, None)["verify_steps"] == 30


@pytest.mark.skipif("MEGATRON_LM" not in os.environ, reason="needs a Megatron-LM checkout")
def test_the_agent_draws_the_same_prompts_in_order_and_rewards_steps_of_two():
    sys.path.insert(0, os.environ["MEGATRON_LM"])
    try:
        import agent
        import task
    finally:
        sys.path.remove(os.environ["MEGATRON_LM"])
    one, two = agent.CountAgent(seed=4), agent.CountAgent(seed=4)
    first = [asyncio.run(one.get_prompt()) for _ in range(3)]
    assert first == [asyncio.run(two.get_prompt()) for _ in range(3)]
    assert first[0][0] == task.problem(4, 0).prompt and first[1][0] == task.problem(4, 1).prompt
    prompt, golden = first[0]
    right = " ".join(map(str, task.problem(4, 0).target)) + " <eos>"
    assert asyncio.run(one.get_reward(right, golden, "stop")) == 1.0


@pytest.mark.skipif("MEGATRON_LM" not in os.environ, reason="needs a Megatron-LM checkout")
def test_the_agent_cuts_a_rollout_after_its_first_generated_end_token_and_reports_the_cut():
    sys.path.insert(0, os.environ["MEGATRON_LM"])
    try:
        import agent
        import steps
        from megatron.rl.agent.api import Rollout, TokenRollout
        from megatron.rl.agent.reward_only_agent import RewardOnlyAgent
    finally:
        sys.path.remove(os.environ["MEGATRON_LM"])
    end = agent.END
    prompt = [2, 4, 10, 11, 5]  # <bos> count 6 7 =
    generated = [12, end, 14, 16, end]  # an accepted draft end token, then two more and an end
    rollout = TokenRollout(
        trajectory=[prompt + generated],
        reward=0.5,
        logprobs=[[-0.1, -0.2, -0.3, -0.4, -0.5]],
        generation_mask=[[False] * 5 + [True] * 5],
        policy_epoch=[[(0, 0)]],
        kv_cache_epoch=[[(0, 0)]],
        num_evictions=[0],
    )

    class Megatrons(RewardOnlyAgent):  # the rollout megatron's agent would build
        async def _rollout_from_episode(self, request, episode, golden):
            return rollout

    class Agent(agent.CountAgent, Megatrons):
        pass

    steps._state.update(rewards=[], tokens=0, cut_tokens=0, cut_rollouts=0)
    result = asyncio.run(Agent(seed=4)._rollout_from_episode(None, None, {}))
    assert result.trajectory == [prompt + [12, end]]
    assert result.generation_mask == [[False] * 5 + [True] * 2]
    assert result.logprobs == [[-0.1, -0.2]]
    assert steps._state["cut_tokens"] == 3 and steps._state["cut_rollouts"] == 1
    assert steps._state["tokens"] == 2 and steps._state["rewards"] == [0.5]
    # a text rollout (an interface without tokens) is counted from its response, uncut
    text = Rollout(trajectory=["count 6 7 = 9 11"], reward=0.25, policy_epoch=[[(0, 0)]],
                   kv_cache_epoch=[[(0, 0)]], num_evictions=[0])  # fmt: skip
    episode = SimpleNamespace(responses=[SimpleNamespace(response=SimpleNamespace(content="9 11"))])

    class MegatronsText(RewardOnlyAgent):
        async def _rollout_from_episode(self, request, episode, golden):
            return text

    class TextAgent(agent.CountAgent, MegatronsText):
        pass

    steps._state.update(rewards=[], tokens=0, cut_tokens=0, cut_rollouts=0)
    assert asyncio.run(TextAgent(seed=4)._rollout_from_episode(None, episode, {})) is text
    assert steps._state["tokens"] == 3 and steps._state["cut_tokens"] == 0
    # an end token in the prompt is not a generated one, and a clean rollout is left alone
    tokens, mask = [end, 4, 5, 12, end], [False, False, False, True, True]
    assert agent.cut_after_end(tokens, mask, [-0.1, -0.2]) == 0 and len(tokens) == 5


def test_the_report_joins_each_steps_lines_and_takes_medians_after_the_first_step(tmp_path):
    pytest.importorskip("matplotlib")
    import report

    def arm(name: str, arm: str, lengths: list[float | None]) -> str:
        path = tmp_path / f"{name}.jsonl"
        lines = [{"arm": arm, "policy": None, "mask": True, "megatron_lm": {}, "argv": []}]
        for step, length in enumerate(lengths, 1):
            spec = {"accepted_length": length}
            lines.append({"step": step, "rollout_s": 10.0 * step, "old_logprob_s": 1.0,
                          "ref_logprob_s": 2.0, "reward": 0.1 * step, "tokens_per_s": 100.0,
                          "spec": spec, "mtp_trained": step % 2 == 1})  # fmt: skip
            lines.append({"step": step, "train_s": 3.0})
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return str(path)

    out = tmp_path / "report"
    summaries = report.main(
        [arm("H_k2", "H", [1.5, 1.6, 1.7]), arm("S_k2", "S", [1.5, 1.0, None]), "--out", str(out)]
    )
    h = summaries["H_k2"]
    assert h["steps"] == h["complete_steps"] == 3 and h["mtp_trained_steps"] == 2
    assert h["median_rollout_s"] == 25.0  # steps 2 and 3 only
    assert h["median_step_s"] == 31.0 and h["accepted_length"] == [1.5, 1.6, 1.7]
    assert summaries["S_k2"]["accepted_length"][-1] is None
    assert (out / "megatron_rl.png").stat().st_size > 0
    assert json.loads((out / "summary.json").read_text()) == summaries
    headless = tmp_path / "headless.jsonl"
    headless.write_text(json.dumps({"step": 1, "train_s": 3.0}) + "\n")
    with pytest.raises(SystemExit, match="no header line naming the arm"):
        report.load(str(headless))


def _run(name: str, arm: str, k: int, lengths: list[float], **meta: object) -> dict:
    """One run as report.load gives it: a header, then per step what the goals read."""
    layers = meta.pop("layers", 2)
    argv = ["--num-speculative-tokens", str(k), "--mtp-num-layers", str(layers)]
    if meta.pop("graphs", False):
        argv += ["--cuda-graph-impl", "local"]
    if meta.pop("packed", False):
        argv += ["--rl-use-sequence-packing"]
    header = {"arm": arm, "mask": True, "megatron_lm": {"name": "t", "digest": "d"}, "argv": argv}
    steps = []
    for step, length in enumerate(lengths, 1):
        steps.append(
            {
                "step": step,
                "reward": meta.get("reward", 0.1) * step,
                "spec": {"accepted_length": length} if k else None,
                "mtp_trained": step % int(meta.get("train_every", 1)) == 0,
                "tokens_per_s": meta.get("tokens_per_s", 100.0),
                "rollout_s": 1.0,
                "old_logprob_s": meta.get("logprob_s", 1.0),
                "ref_logprob_s": meta.get("logprob_s", 1.0),
                "train_s": 2.0,
            }
        )
    header.update({key: value for key, value in meta.items() if key in ("mask", "shared_gpu")})
    return {"name": name, "meta": header, "steps": steps}


def test_a_packed_run_is_set_beside_its_unpacked_twin_and_judged_only_with_packed_runs():
    import goals
    import report

    plain = _run("M_k2_s2", "M", 2, [1.5] * 20, logprob_s=4.0)
    packed = _run("M_k2_s2_packed", "M", 2, [1.5] * 25, logprob_s=2.0, packed=True)
    table = report.packing([plain, packed])
    assert table.splitlines()[2].startswith(
        "| M_k2_s2_packed / M_k2_s2 | 2-20 | 1 / 1 (1.00x) | 2 / 4"
    )
    # the step, 1 + 2 + 2 + 2 against 1 + 4 + 4 + 2
    assert "(0.50x)" in table and "7 / 11 (0.64x)" in table
    assert report.packing([plain]) == ""
    h2 = _run("H_k2", "H", 2, [1.5] * 20)
    # the packed M, though the longer run, is not M's record: its timers would read otherwise
    assert goals.goals([h2, plain, packed]) == goals.goals([h2, plain])
    assert all(
        met is None for goal, met, _ in goals.goals([h2, plain], packed=True) if "step" in goal
    )


def test_the_goals_find_their_runs_by_what_they_are_and_judge_only_what_was_measured():
    import goals

    fourteen = [1.0] * 14
    runs = [
        _run("m", "M", 2, fourteen),
        _run("s", "S", 2, [1.0] * 10 + [0.7] * 4),
        _run("h", "H", 2, [1.0] * 10 + [0.95] * 4, tokens_per_s=150.0, logprob_s=0.5),
        _run("a", "A", 2, [1.0] * 10 + [0.8] * 3, train_every=3),
        _run("h0", "H", 0, fourteen, tokens_per_s=100.0, logprob_s=0.5),
        _run("n", "M", 0, fourteen, layers=0, logprob_s=0.495),
        _run("shared", "H", 2, fourteen, tokens_per_s=10.0, shared_gpu=True),
        _run("hg", "H", 2, fourteen, tokens_per_s=90.0, graphs=True),
        _run("hg0", "H", 0, fourteen, tokens_per_s=120.0, graphs=True),
    ]
    judged = goals.goals(runs)

    def verdict(start: str) -> tuple:
        return next((met, numbers) for goal, met, numbers in judged if goal.startswith(start))

    assert verdict("Zero edits")[0] is True
    assert verdict("Freshness: S")[0] is True  # S fell by 0.3
    assert verdict("Freshness: H and A") == (
        False,
        "h/M 0.95-0.95; a/M 0.80-0.80 (stopped after step 13 of 14)",
    )
    assert verdict("A trains MTP")[0] is True  # 4 of 13
    assert verdict("Response-only")[0] is False  # 0.95 < 1.0 at the last step
    # the shared run is left out; 14 steps do not reach the goal's window: read, not judged
    assert verdict("Rollouts") == (
        None,
        "H eager: 150 against 100 tokens/s (1.50x, steps 8-14 only, not judged: a run ended "
        "before step 20); H local graphs: 90 against 120 tokens/s (0.75x, steps 8-14 only, not "
        "judged: a run ended before step 20); needs H with k=2 and k=0, alone, to step 20",
    )
    logprob = verdict("The log-prob passes")
    assert logprob[0] is True and "(h0 against n)" in logprob[1]  # like for like: k=0, eager
    faster = verdict("H's whole GRPO step")
    assert faster[0] is True and "saved 1.00" in faster[1]
    assert verdict("No interference")[0] is None  # no rerun: not measured
    short = goals.goals([_run("m", "M", 2, [1.0] * 8), _run("h", "H", 2, [1.0] * 8)])
    judged = [goal.split(":")[0].split(" (")[0] for goal, met, _ in short if met is not None]
    # nothing past step 10, no k=0 run, no model without MTP: only these three can be judged
    assert judged == ["Zero edits", "Response-only", "H's whole GRPO step is faster than M's"]


def test_a_hybrid_runs_mtp_depths_are_read_from_its_layer_pattern():
    import goals

    hybrid = ["--hybrid-layer-pattern", "MEMEM*EMEMEM*E/*E/*E", "--num-speculative-tokens", "2"]
    assert goals.mtp_depths(hybrid) == 2
    assert goals.mtp_depths(["--hybrid-layer-pattern", "MEMEM*E"]) == 0
    assert goals.mtp_depths(["--mtp-num-layers", "1", *hybrid]) == 1  # the flag, where given
    fast, slow = _run("h", "H", 2, [1.8] * 20), _run("h0", "H", 0, [1.8] * 20)
    for run in (fast, slow):  # as train_rl.py's hybrid runs are written: no --mtp-num-layers
        run["meta"]["argv"] = ["--hybrid-layer-pattern", "M*E/*E/*E", *run["meta"]["argv"][:2]]
    verdict = next(v for v in goals.goals([fast, slow]) if v[0].startswith("Rollouts"))
    assert verdict[1:] == (False, "H eager: 100 against 100 tokens/s (1.00x, steps 20 on)")


def test_the_rollout_goal_is_judged_over_steps_20_on_and_not_over_the_drafters_first_steps():
    import goals

    def pair() -> list[dict]:
        fast = _run("h", "H", 2, [1.8] * 24, tokens_per_s=140.0)
        slow = _run("h0", "H", 0, [1.8] * 24)
        for step in fast["steps"][:19]:  # a drafter still learning: slower than k=0 at first
            step["tokens_per_s"] = 50.0
        return [fast, slow]

    def rollouts(runs: list[dict]) -> tuple:
        return next(v[1:] for v in goals.goals(runs) if v[0].startswith("Rollouts"))

    # the whole run's median (50) would say 0.50x; steps 20-24 say 1.40x
    assert rollouts(pair()) == (True, "H eager: 140 against 100 tokens/s (1.40x, steps 20 on)")
    slow_finish = pair()
    slow_finish[1]["steps"] = slow_finish[1]["steps"][:19]  # k=0 ended at step 19
    met, numbers = rollouts(slow_finish)
    assert met is None and "(0.50x, steps 10-19 only, not judged" in numbers
    assert numbers.endswith("needs H with k=2 and k=0, alone, to step 20")
