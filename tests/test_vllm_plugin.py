"""The vLLM plugin's parts, without vLLM: slots, acceptance, records, the draft policy, telemetry, settings."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_drafter

from specd.cli.main import main
from specd.core.records import TrajectoryRecord, validate_record
from specd.drafter.base import DraftBatch
from specd.drafter.traffic_table import TrafficTable
from specd.serving.vllm.shared.budget import DraftBudget, LearnedDrafterSwitch, ShadowBook
from specd.serving.vllm.shared.launch import PROPOSER_CLASS, WORKER_EXTENSION, PluginSettings, vllm_command
from specd.serving.vllm.shared.policy import Candidates, DraftPolicy
from specd.serving.vllm.shared.telemetry import Telemetry
from specd.serving.vllm.shared.tracking import SlotTable, StepTracker, stop_index
from specd.testing import tiny_target
from specd.transport.bus import BusCounters


class LabelledSlots:
    """A drafter stand-in whose slots hold labels, so moves and starts can be checked."""

    def __init__(self, capacity: int) -> None:
        self.content: list[str | None] = [None] * capacity
        self.starts = 0

    def start(self, slot: int) -> None:
        self.content[slot] = None
        self.starts += 1

    def move(self, src: int, dst: int) -> None:
        self.content[dst] = self.content[src]


def step(table: SlotTable, drafter: LabelledSlots, request_ids: list[str]) -> None:
    table.arrange(request_ids, drafter)
    for row, request_id in enumerate(request_ids):
        assert drafter.content[row] in (None, request_id), f"row {row} holds another request's state"
        drafter.content[row] = request_id  # drafting fills the slot with this request's state


def test_slot_table_keeps_each_request_state_through_compaction_preemption_and_return() -> None:
    table, drafter = SlotTable(rows=3, parked=3), LabelledSlots(6)
    step(table, drafter, ["a", "b", "c"])
    assert drafter.starts == 3
    step(table, drafter, ["a", "c"])            # b finished or preempted: vLLM moved c up
    step(table, drafter, ["c", "b", "a"])       # b is back, everything permuted
    assert drafter.starts == 3                  # nobody lost their state
    table.release("b")
    step(table, drafter, ["d", "c", "a"])
    assert drafter.starts == 4                  # only the new request started fresh


def test_slot_table_evicts_the_least_recently_seen_parked_request() -> None:
    table, drafter = SlotTable(rows=2, parked=1), LabelledSlots(3)
    step(table, drafter, ["a", "b"])
    step(table, drafter, ["b"])                 # a parked
    step(table, drafter, ["c"])                 # b must park too: a (seen earlier) is evicted
    step(table, drafter, ["b", "a"])
    assert drafter.starts == 4                  # a, b, c, and a again; b came back from parking
    with pytest.raises(ValueError, match="bound for 2"):
        table.arrange(["x", "y", "z"], drafter)


def test_token_drafter_drafts_the_same_whatever_row_its_request_occupies() -> None:
    """Slots moved by the table must carry exact caches: compare with one drafter per request."""
    target = tiny_target()
    rng = random.Random(0)
    sequences = {name: [rng.randrange(96) for _ in range(5 + i)] for i, name in enumerate("abcd")}
    shared = tiny_drafter(target)
    shared.bind(8, 128, torch.device("cpu"))
    table = SlotTable(rows=4, parked=4)
    alone = {name: tiny_drafter(target) for name in sequences}
    for drafter in alone.values():
        drafter.bind(1, 128, torch.device("cpu"))
    schedules = [["a", "b", "c"], ["a", "c"], ["c", "a", "b"], ["d", "b"], ["b", "d", "a", "c"], ["c", "a"]]
    for names in schedules:
        table.arrange(names, shared)
        proposal = shared.propose(batch_of([sequences[n] for n in names], names), 3)
        for row, name in enumerate(names):
            reference = alone[name].propose(batch_of([sequences[name]], [name]), 3)
            assert proposal.drafts[row].tolist() == reference.drafts[0].tolist(), f"{name} in row {row}"
            alone[name].commit(torch.tensor([1]))
        shared.commit(torch.tensor([1] * len(names)))
        for row, name in enumerate(names):  # the first draft was accepted, then one new token
            sequences[name] += [int(proposal.drafts[row, 0]), rng.randrange(96)]


def batch_of(sequences: list[list[int]], names: list[str]) -> DraftBatch:
    tokens = torch.zeros(len(sequences), 128, dtype=torch.long)
    for row, seq in enumerate(sequences):
        tokens[row, :len(seq)] = torch.tensor(seq)
    return DraftBatch(tokens, torch.tensor([len(s) for s in sequences]), [2] * len(sequences), names,
                      torch.zeros(len(sequences)), torch.ones(len(sequences)), [])


def rows_of(sequences: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.zeros((len(sequences), 64), dtype=np.int32)
    for row, seq in enumerate(sequences):
        tokens[row, :len(seq)] = seq
    return tokens, np.array([len(s) for s in sequences])


def test_step_tracker_infers_accepted_counts_and_voids_drafts_that_were_never_verified() -> None:
    tracker = StepTracker("vllm-test", domain="code")
    prompt_a, prompt_b = [1, 2, 3], [4, 5]
    tokens, lengths = rows_of([[*prompt_a, 10], [*prompt_b, 20]])
    assert tracker.observe(["a", "b"], [[10], [20]], lengths, np.array([3, 2]), tokens, 1) == []
    tracker.remember(["a", "b"], [[11, 12, 13], [21, 22]], lengths, 1)
    # a accepted 2 drafts (+ a correction); b left the batch (preempted): its drafts are void
    tokens, lengths = rows_of([[*prompt_a, 10, 11, 12, 99]])
    assert tracker.observe(["a"], [[11, 12, 99]], lengths, np.array([3]), tokens, 1) == [2, 0]
    tracker.remember(["a"], [[7]], lengths, 2)
    tokens, lengths = rows_of([[*prompt_b, 20, 30], [*prompt_a, 10, 11, 12, 99, 8]])
    assert tracker.observe(["b", "a"], [[30], [8]], lengths, np.array([2, 3]), tokens, 2) == [0]
    record = tracker.finish("a", keep_output=4, sampling={"temperature": 0.0, "top_p": 1.0})
    assert record is not None and record.prompt_ids == prompt_a and record.output_ids == [10, 11, 12, 99]
    assert [(s.position, s.drafts, s.num_accepted, s.version) for s in record.steps] == [(4, [11, 12, 13], 2, 1)]
    validate_record(json.loads(json.dumps(record.to_dict())), vocab_size=100)
    report = tracker.report().to_dict()
    # per version: the learned drafter's own verified drafts and the passes that verified them
    assert report["versions"]["1"] == {"drafts": 3, "accepted": 2, "passes": 1, "emitted": 3}
    assert report["versions"]["2"] == {"drafts": 1, "accepted": 0, "passes": 1, "emitted": 1}
    # a pass that verified no drafts counts for no drafter: under the source "none"
    assert report["sources"] == {"learned": {"drafts": 4, "accepted": 2, "passes": 2, "emitted": 4},
                                 "none": {"drafts": 0, "accepted": 0, "passes": 3, "emitted": 3}}
    assert tracker.finish("a") is None and tracker.is_finished("a")


def test_a_request_that_leaves_vllm_is_recorded_with_its_own_sampling_not_as_greedy() -> None:
    from types import SimpleNamespace

    from specd.serving.vllm.shared.tracking import Trajectory
    from specd.serving.vllm.shared.worker_loop import RequestBook

    book = RequestBook(PluginSettings(), max_model_len=100)
    for request_id in ("sampled", "unseen"):
        book.tracker.live[request_id] = Trajectory(prompt_ids=[1, 2], tokens=[1, 2, 3, 4], created=0.0)
    params = SimpleNamespace(temperature=0.8, top_p=0.9, stop_token_ids=[], eos_token_id=None, max_tokens=50)
    waiting = {request_id: SimpleNamespace(sampling_params=params) for request_id in ("sampled", "unseen")}
    assert book.close_finished(waiting, ["sampled"], [[4]]) == []  # "unseen" has no row in this step
    # a stop string (or an abort) takes both out of vLLM's map: each ends as "gone"
    assert sorted(book.close_finished({}, [], [])) == ["sampled", "unseen"]
    record = book.telemetry._finished.get_nowait()
    assert (record.temperature, record.top_p, record.output_ids) == (0.8, 0.9, [3, 4])
    assert book.telemetry._finished.empty()  # "unseen" never showed its sampling: no record claims it greedy


def test_a_fault_in_specds_part_of_a_step_leaves_vllms_own_drafts_and_is_counted(caplog) -> None:
    from specd.serving.vllm.custom.proposer import SpecdProposer
    from specd.serving.vllm.eagle3.companion import Eagle3Companion
    from specd.serving.vllm.shared.worker_loop import RequestBook, StepFaults

    def broken_companion(after_vllm: bool) -> Eagle3Companion:
        companion = object.__new__(Eagle3Companion)  # the parts propose touches on a fault, no vLLM
        companion.faults, companion.book = StepFaults(), RequestBook(PluginSettings(), 100)
        companion.book.tracker.previous_rows = ["r1"]

        def fails(runner, vllm_propose, *args):
            if after_vllm:
                companion._vllm_answer = vllm_propose(runner, *args)
            raise KeyError("a bug in specd's step")

        companion._propose = fails  # type: ignore[method-assign]
        return companion

    def vllm_propose(runner, scheduler_output, sampled):
        calls.append(sampled)
        return [[7, 8]]

    for after_vllm in (False, True):
        calls: list = []
        companion = broken_companion(after_vllm)
        assert companion.propose(None, vllm_propose, None, [[5]]) == [[7, 8]]
        assert len(calls) == 1  # vLLM drafts once: its answer is kept when it already made it
        assert companion.faults.status()["step_faults"] == 1 and companion.book.tracker.previous_rows == []
    proposer = object.__new__(SpecdProposer)
    proposer.faults, proposer.book = StepFaults(), RequestBook(PluginSettings(), 100)
    proposer._propose = lambda *args: 1 / 0  # type: ignore[method-assign]
    assert proposer.propose([[1], [2]], np.zeros(2), np.zeros((2, 4))) == [[], []]  # no drafts, the step goes on
    assert proposer.faults.status()["last_step_fault"].startswith("ZeroDivisionError")
    assert "the step goes on without it" in caplog.text


def test_stop_index_mirrors_vllms_stop_rules() -> None:
    assert stop_index([5, 6, 2, 7], max_tokens=10, stop_ids={2}, room=100) == 3   # stop token kept
    assert stop_index([5, 6, 7], max_tokens=2, stop_ids=set(), room=100) == 2       # max_tokens
    assert stop_index([5, 6, 7], max_tokens=None, stop_ids=set(), room=3) == 3      # context full
    assert stop_index([5, 6], max_tokens=10, stop_ids={2}, room=100) is None        # still running


def test_plugin_settings_round_trip_and_refuse_bad_values() -> None:
    settings = PluginSettings(broker="mqtt://127.0.0.1:1884", learner_url="http://127.0.0.1:8100", version=3,
                              domain="code", drafter_kind="learned", route="custom", eagle_k="full", eagle_max=4,
                              eagle_min_chance=0.25, confidence=True, drafter_gemm="bfloat16")
    assert PluginSettings.from_env(settings.to_env()) == settings
    assert PluginSettings.from_env({}).drafter_gemm == "auto"
    with pytest.raises(ValueError, match="SPECD_DRAFTER_GEMM"):
        PluginSettings.from_env({"SPECD_DRAFTER_GEMM": "fp8"})
    assert PluginSettings.from_env({}).eagle_k == "adaptive"
    with pytest.raises(ValueError, match="SPECD_EAGLE_K"):
        PluginSettings.from_env({"SPECD_EAGLE_K": "sometimes"})
    with pytest.raises(ValueError, match="SPECD_VERSION"):
        PluginSettings.from_env({"SPECD_VERSION": "three"})
    with pytest.raises(ValueError, match="SPECD_CONFIDENCE"):
        PluginSettings.from_env({"SPECD_CONFIDENCE": "maybe"})
    with pytest.raises(ValueError, match="SPECD_EAGLE_MIN_CHANCE"):
        PluginSettings.from_env({"SPECD_EAGLE_MIN_CHANCE": "1.5"})
    with pytest.raises(ValueError, match="SPECD_DRAFTER"):
        PluginSettings.from_env({"SPECD_DRAFTER": "magic"})
    with pytest.raises(ValueError, match="broker URL"):
        PluginSettings.from_env({"SPECD_BROKER": "http://127.0.0.1"})


def test_vllm_command_runs_specds_proposer_extension_and_metrics(capsys) -> None:
    env, argv = vllm_command("/models/t", PluginSettings(broker="mqtt://127.0.0.1:1883", route="custom"), k=5)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": 5}
    assert argv[argv.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert env["SPECD_BROKER"] == "mqtt://127.0.0.1:1883" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert main(["vllm", "--print", "--json", "--store", "/tmp/store", "-k", "3", "--kv-cache-gib", "1",
                 "--route", "custom"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["env"]["SPECD_STORE"] == "/tmp/store" and "1073741824" in printed["argv"]
    # the default route exports the shipped pretrained drafter for vLLM's EAGLE-3 proposer first
    assert main(["vllm", "--print", "--json", "--store", "/tmp/store", "-k", "3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    spec = json.loads(printed["argv"][printed["argv"].index("--speculative-config") + 1])
    assert spec["method"] == "eagle3" and (Path(spec["model"]) / "config.json").is_file()
    assert printed["env"]["SPECD_ROUTE"] == "eagle3"
    assert main(["vllm", "--print"]) == 2
    assert "needs --broker" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # argparse refuses it before anything is exported
        main(["vllm", "--print", "--store", "/s", "-k", "0"])
    assert refused.value.code == 2 and "at least 1" in capsys.readouterr().err


def test_context_k_lets_context_rows_reach_further_than_eagle3s_drafts(capsys) -> None:
    assert main(["vllm", "--print", "--json", "--store", "/tmp/store", "-k", "4", "--context-k", "8"]) == 0
    printed = json.loads(capsys.readouterr().out)
    spec = json.loads(printed["argv"][printed["argv"].index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == 8 and printed["env"]["SPECD_EAGLE_MAX"] == "4"
    assert PluginSettings.from_env(printed["env"]).eagle_max == 4
    assert main(["vllm", "--print", "--json", "--store", "/tmp/store", "-k", "4"]) == 0
    assert "SPECD_EAGLE_MAX" not in json.loads(capsys.readouterr().out)["env"]   # no reach beyond k: no cap
    assert main(["vllm", "--print", "--store", "/s", "--context-k", "8", "--route", "custom"]) == 2
    assert "eagle3 route" in capsys.readouterr().err


def test_vllms_own_draft_count_per_batch_size_is_passed_through(capsys) -> None:
    assert main(["vllm", "--print", "--json", "--store", "/tmp/store", "-k", "4", "--route", "custom",
                 "--drafts-per-batch", "1-2:4,3-8:2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    spec = json.loads(printed["argv"][printed["argv"].index("--speculative-config") + 1])
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 2, 4], [3, 8, 2]]
    for bad in ("1-2", "2-1:4", "1-8:5", "a:1"):
        assert main(["vllm", "--print", "--store", "/s", "--drafts-per-batch", bad]) == 2
        assert "drafts per batch size" in capsys.readouterr().err


def test_draft_budget_withholds_drafts_that_cost_more_verification_than_they_return() -> None:
    budget = DraftBudget(k=4, explore_every=0)
    assert budget.keep("table", 4) == 4                    # nothing measured yet: send everything
    for step in range(200):                                # 10 ms per step plus 5 ms per verified token
        verified = 8 + step % 5
        budget.observe_step(0.010 + 0.005 * verified, verified, emitted_tokens=9)
    assert budget.step_time.slope == pytest.approx(0.005, rel=1e-3)
    assert 0.65 < budget.bar < 0.85                        # 5 ms x ~150 tokens/s
    for _ in range(100):
        budget.observe_drafts("context", drafted=4, accepted=4)   # context matches: always right
        budget.observe_drafts("table", drafted=4, accepted=0)     # the table: always wrong
    assert budget.keep("context", 4) == 4 and budget.keep("table", 4) == 0
    assert budget.alpha("table")[0] < 0.05 and budget.alpha("table")[1] == pytest.approx(0.5)  # never reached


def test_draft_budget_explores_so_an_estimate_can_recover() -> None:
    budget = DraftBudget(k=2, explore_every=4)
    for step in range(40):
        budget.observe_step(0.01 + 0.01 * (1 + step % 3), 1 + step % 3, emitted_tokens=1)
        budget.observe_drafts("learned", drafted=2, accepted=0)
    decisions = []
    for _ in range(4):
        budget.observe_step(0.02, 2, 1)
        decisions.append(budget.keep("learned", 2))
    assert sorted(decisions) == [0, 0, 0, 2]               # one step in four sends them anyway


def test_draft_budget_explores_less_often_the_more_rows_a_step_verifies() -> None:
    budget = DraftBudget(k=2, explore_every=4)
    for step in range(40):
        budget.observe_step(0.01 + 0.01 * (1 + step % 3), 1 + step % 3, emitted_tokens=1, rows=2)
        budget.observe_drafts("learned", drafted=2, accepted=0)
    decisions = []
    for step in range(16):
        budget.observe_step(0.01 + 0.01 * (1 + step % 3), 1 + step % 3, emitted_tokens=1, rows=2)
        decisions.append(budget.keep("learned", 2))
    assert sorted(decisions) == [0] * 14 + [2, 2]          # one step in eight: every row's drafts, twice the work


def test_stop_index_skips_tokens_already_checked() -> None:
    assert stop_index([2, 5, 6], max_tokens=10, stop_ids={2}, room=100, checked=1) is None
    assert stop_index([2, 5, 2], max_tokens=10, stop_ids={2}, room=100, checked=1) == 3


def test_shadow_book_scores_held_back_drafts_against_what_the_target_produced() -> None:
    book = ShadowBook()
    book.add("a", "learned", position=3, drafts=[7, 8, 9])
    book.add("a", "table", position=4, drafts=[1])             # one pending score per request
    assert book.score("a", [0, 1, 2, 7]) is None               # right so far, the rest not produced yet
    assert book.score("a", [0, 1, 2, 7, 8, 5]) == ("learned", 3, 2, ())
    assert book.score("a", [0, 1, 2, 7, 8, 5]) is None         # scored once
    book.add("b", "context", position=2, drafts=[4, 4], confidences=[0.9, 0.2])
    assert book.score("b", [0, 1, 3]) == ("context", 2, 0, [0.9, 0.2])


def test_learned_gate_switches_off_a_drafter_not_worth_its_time_and_probes_it_rarely() -> None:
    gate = LearnedDrafterSwitch(probe_share=0.01, min_period=16)
    assert gate.decide()                                       # unmeasured: it runs
    gate.observe(expected_tokens=0.1, tokens_emitted=8, learned_seconds=0.01, step_seconds=0.05)
    assert gate.probe_period == 20                             # 20% of a step: a probe every 20 steps is 1%
    runs = sum(gate.decide() for _ in range(100))
    assert runs == 5
    gate.observe(expected_tokens=8.0, tokens_emitted=8, learned_seconds=0.01, step_seconds=0.05)
    gate.observe(expected_tokens=8.0, tokens_emitted=8, learned_seconds=0.01, step_seconds=0.05)
    assert gate.decide() and gate.decide()                     # a version that pays runs every step


def test_draft_budget_prices_a_token_per_batch_size() -> None:
    budget = DraftBudget(k=2, explore_every=0)
    for step in range(100):  # batch 1: a verified token costs 1 ms; batch 8: 8 ms (compute-bound)
        budget.observe_step(0.040 + 0.001 * (step % 3), 1 + step % 3, emitted_tokens=1, rows=1)
        budget.observe_step(0.060 + 0.008 * (step % 3), 8 + step % 3, emitted_tokens=8, rows=8)
    budget.rows = 1
    cheap = budget.bar
    budget.rows = 8
    assert cheap < 0.05 and budget.bar > 0.5


def priced(budget: DraftBudget, rows: int) -> DraftBudget:
    """A budget that has measured the price of a token at this batch size: a bar near 0.75."""
    for step in range(200):  # 10 ms per step plus 5 ms per verified token, about 150 tokens/s
        verified = 8 + step % 5
        budget.observe_step(0.010 + 0.005 * verified, verified, emitted_tokens=9, rows=rows)
    return budget


def test_draft_policy_holds_back_drafts_below_the_bar_and_scores_them_later_from_the_targets_tokens() -> None:
    budget = priced(DraftBudget(k=3, explore_every=0), rows=2)
    for _ in range(100):
        budget.observe_drafts("table2", drafted=3, accepted=0)     # the table has been wrong
        budget.observe_drafts("context4", drafted=3, accepted=3)   # context matches have been right
    policy, tracker = DraftPolicy(budget, max_model_len=64), StepTracker("vllm-test")
    sequences = {"a": [1, 2, 3], "b": [4, 5]}
    offers = Candidates([[11, 12, 13], [21, 22, 23]], [3, 3], ["table2", "context4"])
    # per step, what vLLM sampled for a and b: the prefill's token, then b's three drafts and a bonus
    steps = [([10], [20]), ([11], [21, 22, 23, 30]), ([12], [31]), ([99], [32])]
    table_alpha = []
    for now, sampled in enumerate(steps):
        sequences["a"] += sampled[0]
        sequences["b"] += sampled[1]
        tokens, lengths = rows_of([sequences["a"], sequences["b"]])
        tracker.observe(["a", "b"], list(sampled), lengths, np.array([3, 2]), tokens, 1)
        policy.observe(["a", "b"], list(sampled), tracker, now=0.06 * now)
        table_alpha.append(budget.alpha("table2")[0])
        drafts = policy.choose(["a", "b"], offers, lengths, list(sampled))
        assert drafts[0] == [], "the table's drafts cost more verification than they return"
        if now == 0:
            assert drafts[1] == [21, 22, 23], "context matches have paid: sent in full"
        tracker.remember(["a", "b"], drafts, lengths, 1)
    # a's first held-back drafts [11, 12, 13] at position 4 settle when the target writes 99 for 13
    assert table_alpha[0] == table_alpha[1] == table_alpha[2], "unsettled while the target agrees so far"
    assert table_alpha[3] > table_alpha[2], "two of three held-back drafts were right: the estimate rises"
    assert policy.drafts_withheld == 4 * 3                          # a's three drafts, every step
    assert policy.status()["acceptance_by_source"]["table2"][0] == round(table_alpha[3], 3)


def test_draft_policy_sends_every_draft_on_exploring_steps() -> None:
    budget = priced(DraftBudget(k=3, explore_every=4), rows=1)
    for _ in range(100):
        budget.observe_drafts("learned", drafted=3, accepted=0)
    policy = DraftPolicy(budget, max_model_len=64)
    sent = []
    for _ in range(8):
        budget.observe_step(0.060, 10, emitted_tokens=9, rows=1)
        sent.append(len(policy.choose(["a"], Candidates([[7, 8, 9]], [3], ["learned"]), np.array([5]), [[1]])[0]))
    assert sorted(sent) == [0, 0, 0, 0, 0, 0, 3, 3]     # one step in four sends them to keep the fit honest
    assert policy.drafts_sent == 6 and policy.drafts_withheld == 18


def test_draft_policy_caps_drafts_at_the_room_left_before_max_model_len() -> None:
    policy = DraftPolicy(DraftBudget(k=3), max_model_len=10)    # unmeasured: no bar, everything usable goes
    offers = Candidates([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [3, 3, 2], ["learned"] * 3)
    drafts = policy.choose(["a", "b", "c"], offers, np.array([7, 9, 4]), [[1], [1], [1]])
    assert drafts == [[1, 2], [], [7, 8]]               # room 2, none, and the drafter's own limit of 2
    assert policy.drafts_sent == 4 and policy.drafts_withheld == 0


def test_draft_policy_gives_no_drafts_to_rows_that_just_prefilled() -> None:
    policy = DraftPolicy(DraftBudget(k=2), max_model_len=64)
    offers = Candidates([[1, 2], [3, 4]], [2, 2], ["context3", "context3"])
    assert policy.choose(["a", "b"], offers, np.array([5, 7]), [[9], []]) == [[1, 2], []]
    assert policy.drafts_sent == 2 and policy.drafts_withheld == 0   # nothing to verify against yet


def test_draft_policy_switches_off_a_learned_drafter_that_costs_more_than_it_adds() -> None:
    policy, tracker = DraftPolicy(DraftBudget(k=3, explore_every=0), max_model_len=64), StepTracker("vllm-test")
    sequence = [1, 2, 3]
    decisions = []
    for now in range(6):
        sequence.append(40 + now)                       # every draft rejected: one new token per step
        tokens, lengths = rows_of([sequence])
        tracker.observe(["a"], [[sequence[-1]]], lengths, np.array([3]), tokens, 1)
        policy.observe(["a"], [[sequence[-1]]], tracker, now=0.05 * now)
        decisions.append(policy.use_learned())
        if decisions[-1]:  # the learned drafter takes 98% of each 50 ms step
            offers = Candidates([[7, 8, 9]], [3], ["learned"], learned_seconds=0.049)
        else:              # switched off, it offers nothing (a hybrid drafter's "none" rows)
            offers = Candidates([[0, 0, 0]], [0], ["none"])
        tracker.remember(["a"], policy.choose(["a"], offers, lengths, [[sequence[-1]]]), lengths, 1)
    assert decisions == [True, True, False, False, False, False]
    assert policy.learned_steps == 2
    status = policy.status()
    assert status["learned_cost"] == pytest.approx(0.98) and status["learned_gain"] < status["learned_cost"]


class RecordingPublisher:
    """A publisher stand-in: keeps what it was handed and on which thread, and signals arrivals."""

    def __init__(self) -> None:
        self.connected = threading.Event()
        self.counters = BusCounters()
        self.records: list[tuple[str, dict]] = []
        self.last_report: dict | None = None
        self.reports_shed, self.backlog = 0, 0
        self.record_arrived, self.report_arrived = threading.Event(), threading.Event()

    def publish(self, record: dict) -> None:
        self.records.append((threading.current_thread().name, record))
        self.counters.published += 1
        self.record_arrived.set()

    def report(self, report: dict) -> None:
        self.last_report = report
        self.report_arrived.set()


def finished_record(tracker: StepTracker) -> TrajectoryRecord:
    prompt = [1, 2, 3]
    tokens, lengths = rows_of([[*prompt, 10]])
    tracker.observe(["a"], [[10]], lengths, np.array([3]), tokens, 1)
    tracker.remember(["a"], [[11, 12]], lengths, 1)
    tokens, lengths = rows_of([[*prompt, 10, 11, 12, 13]])
    tracker.observe(["a"], [[11, 12, 13]], lengths, np.array([3]), tokens, 1)
    record = tracker.finish("a")
    assert record is not None
    return record


def test_telemetry_hands_a_finished_record_to_the_publisher_the_recent_records_and_the_table_off_thread() -> None:
    tracker, publisher = StepTracker("vllm-test"), RecordingPublisher()
    table = TrafficTable(min_n=2, max_n=2, min_count=1)
    telemetry = Telemetry(tracker, report_seconds=3600).start(publisher, table)
    record = finished_record(tracker)
    telemetry.finish(record)
    assert publisher.record_arrived.wait(timeout=10), "the record thread never published the record"
    assert publisher.records == [("specd-vllm-records", record.to_dict())]
    assert list(telemetry.recent) == [record.to_dict()]
    assert len(table) > 0 and table.draft([1, 2, 3, 10], 2) == [11, 12]   # the table learned its tokens
    status = telemetry.status()
    assert status["records_published"] == 1 and status["live_requests"] == 0 and status["records_failed"] == 0
    assert status["totals"]["1"] == {"drafts": 2, "accepted": 2, "passes": 1, "emitted": 3}
    assert status["totals_by_source"]["none"] == {"drafts": 0, "accepted": 0, "passes": 1, "emitted": 1}


def test_a_record_that_fails_to_publish_is_counted_and_the_record_thread_goes_on() -> None:
    class TableFailingOnce:
        def __init__(self) -> None:
            self.calls = 0

        def add(self, tokens: list[int]) -> None:
            self.calls += 1
            if self.calls == 1:
                raise IndexError("a bug in the traffic table")

        def __len__(self) -> int:
            return self.calls

    tracker, publisher = StepTracker("vllm-test"), RecordingPublisher()
    telemetry = Telemetry(tracker, report_seconds=3600).start(publisher, TableFailingOnce())  # type: ignore[arg-type]
    telemetry.finish(finished_record(tracker))
    telemetry.finish(finished_record(StepTracker("vllm-test")))  # the next request's
    assert publisher.record_arrived.wait(timeout=10), "the record thread ended on the broken record"
    assert len(publisher.records) == 1 and telemetry.status()["records_failed"] == 1


def test_telemetry_reports_acceptance_totals_on_its_own_thread() -> None:
    tracker, publisher = StepTracker("vllm-test"), RecordingPublisher()
    Telemetry(tracker, report_seconds=0.1).start(publisher, None)
    finished_record(tracker)
    assert publisher.report_arrived.wait(timeout=10), "the report thread never sent a report"
    assert publisher.last_report is not None
    assert publisher.last_report["versions"] == {"1": {"drafts": 2, "accepted": 2, "passes": 1, "emitted": 3}}


def test_draft_budget_reports_the_bar_of_every_batch_size_it_measured_and_keeps_its_current_one() -> None:
    budget = priced(priced(DraftBudget(k=4, explore_every=0), rows=8), rows=1)
    one = budget.bar
    budget.rows = 8
    eight = budget.bar
    bars = budget.bars_by_batch()
    assert set(bars) == {1, 8} and budget.rows == 8
    assert bars[1]["draft_bar"] == pytest.approx(one, abs=1e-4)
    assert bars[8]["draft_bar"] == pytest.approx(eight, abs=1e-4)
    assert bars[1]["draft_bar"] > 0 and bars[8]["drafting_bar"] == 0.0   # drafting unpriced at either size


def test_a_batch_size_not_yet_priced_borrows_the_nearest_measured_one() -> None:
    budget = priced(DraftBudget(k=4, explore_every=0), rows=7)
    for step in range(200):  # at batch 2 a verified token costs 1 ms, not 5
        budget.observe_step(0.010 + 0.001 * (8 + step % 5), 8 + step % 5, emitted_tokens=9, rows=2)
    budget.rows = 7
    seven = budget.bar
    for rows in (8, 6):   # 8: seen, but every step verified the same count (no slope); 6: never seen
        for _ in range(50):
            budget.observe_step(0.2, 40, emitted_tokens=9, rows=rows)
        budget.rows = rows
        assert budget.bar == pytest.approx(seven), "an unmeasured price is not free: it is the nearest one's"
    budget.rows = 2
    two = budget.bar
    budget.rows = 3
    assert budget.bar == pytest.approx(two) and two < seven - 0.2   # 2 is nearer than 7: its cheaper price
    assert DraftBudget(k=4).bar == 0.0            # nothing measured anywhere: everything goes


def test_verification_is_priced_without_the_drafters_own_passes() -> None:
    budget = DraftBudget(k=4, explore_every=0)
    for step in range(200):
        # 20 ms a step plus 2 ms a verified token; the drafter stands down (no passes) on the steps
        # where context drafts fill the batch, which verify the most tokens
        verified = 8 + 4 * (step % 3)
        drafting = 0.0 if step % 3 == 2 else 0.030
        budget.observe_step(0.020 + 0.002 * verified + drafting, verified, emitted_tokens=9, rows=8,
                            drafting_seconds=drafting)
    assert budget.step_time.slope == pytest.approx(0.002, rel=1e-3)
    confounded = DraftBudget(k=4, explore_every=0)
    for step in range(200):
        verified, drafting = 8 + 4 * (step % 3), (0.0 if step % 3 == 2 else 0.030)
        confounded.observe_step(0.020 + 0.002 * verified + drafting, verified, emitted_tokens=9, rows=8)
    assert confounded.step_time.slope < 0.001, "what the fit said before: a verified token nearly free"


def test_draft_budget_prices_a_drafters_own_passes_after_the_first() -> None:
    budget = priced(DraftBudget(k=4, explore_every=0), rows=1)   # bar near 0.75 at about 150 tokens/s
    for _ in range(100):
        budget.observe_drafts("learned", drafted=4, accepted=4)   # always right: a chance of ~1 everywhere
    assert budget.drafting_bar == 0.0 and budget.keep("learned", 4, drafting=True) == 4  # unmeasured: free
    for _ in range(60):  # a drafter that always drafts 4: one count of passes, no slope to fit
        budget.observe_drafting(3, 0.014)
    assert budget.drafting_bar == 0.0
    for step in range(60):  # steps where it stood down (the feeding pass alone) give the fit its slope:
        passes = 3 * (step % 2)  # a drafting pass costs 4 ms, 0.6 of a token at about 150 tokens/s
        budget.observe_drafting(passes, 0.002 + 0.004 * passes)
    assert budget.drafting_bar == pytest.approx(0.004 * budget.tokens_per_second, rel=1e-3)
    assert budget.keep("learned", 4) == 4                         # verification alone: all four pay
    assert budget.keep("learned", 4, drafting=True) == 1          # the first is free, the others are not
    one = budget.drafting_bar
    budget.rows = 8                          # unmeasured at batch 8: batch 1's price, the only one measured
    assert budget.drafting_bar == pytest.approx(one) and one > 0


def test_a_taken_port_is_refused_before_vllm_starts(tmp_path, capsys, monkeypatch) -> None:
    import os
    import socket

    def never(*_args) -> None:   # had the check missed it, vLLM would replace this test's process
        raise AssertionError("vLLM was started")

    monkeypatch.setattr(os, "execvpe", never)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["vllm", "--route", "custom", "--store", str(tmp_path / "store"), "--port", str(port)])
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_a_pin_that_is_not_a_version_is_refused_naming_what_was_given() -> None:
    from specd.serving.vllm.shared.extension import SpecdWorkerExtension

    with pytest.raises(ValueError, match="got 'abc'"):
        SpecdWorkerExtension.specd_force_version(object(), "abc")   # type: ignore[arg-type]
