"""n-gram speculation in the scheduler without a model: proposing, booking drafts inside the budget and the free
blocks, settling fabricated verification results (rollback of rejected slots, blocks given back, only accepted
blocks committed to the prefix cache), stop conditions inside the gained tokens, and preemption and abort in the
middle of a speculative run; the block pool checked after every step."""

import itertools

import pytest

from shuttle.common.block_hash import ROOT_HASH, block_hash
from shuttle.common.config import SchedulerConfig
from shuttle.common.messages import FinishReason, RequestOutput, SchedulerStats, StepResult, Submit
from shuttle.common.sampling import SamplingParams, StructuredOutput
from shuttle.common.speculative import SpeculativeConfig
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.ngram import propose_ngram
from shuttle.scheduler.pipeline import StepPipeline
from shuttle.scheduler.scheduler import Scheduler

EOS = 2
BLOCK = 4
PHRASE = [10, 11, 12, 13, 14, 15, 16, 17]
_arrival = itertools.count()


def make_scheduler(num_blocks=64, k=4, max_model_len=128, **config) -> Scheduler:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1)
    return Scheduler(SchedulerConfig(speculative_config=spec, **config), KVCacheManager(num_blocks, BLOCK),
                     max_model_len, (EOS,))


def submit(s, rid, prompt, max_tokens=32, **sampling):
    s.add_request(b"c", Submit(request_id=rid, prompt_token_ids=list(prompt), arrival_time=float(next(_arrival)),
                               sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)))


def step_with(s, gains):
    """Plan a step and settle it with fabricated results: `gains[rid]` the tokens a request gains (one for a
    plain sample; for a speculative entry its accepted drafts then the target's token). Returns (step, outputs)."""
    step = s.schedule()
    s.kv.pool.check_invariants()
    ids, tokens = [], []
    for rid in step.sampling_ids:
        gained = gains[rid]
        assert 1 <= len(gained) <= 1 + len(step.scheduled[rid].draft_token_ids)
        ids += [rid] * len(gained)
        tokens += gained
    s.update_from_output(step, StepResult(step_id=step.plan.step_id, request_ids=ids, token_ids=tokens))
    s.kv.pool.check_invariants()
    return step, s.take_outputs().get(b"c", [])


def test_propose_ngram_takes_the_longest_suffix_and_its_earliest_occurrence():
    assert propose_ngram([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [9, 2]  # [1,2,3] at 0 beats [2,3] at 4
    assert propose_ngram([5, 6, 7, 5, 8, 5], 3, 1, 2) == [6, 7, 5]  # only [5] matches: its earliest, at 0
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # the last token never occurred before
    assert propose_ngram([4, 4, 4], 5, 2, 2) == [4]  # as many as follow the occurrence
    assert propose_ngram([1, 2, 1, 2], 3, 3, 3) == []  # shorter than prompt_lookup_min: nothing


def test_drafts_book_their_slots_and_a_rejection_rolls_them_back():
    s = make_scheduler()
    submit(s, "a", PHRASE + PHRASE[:3])  # 11 prompt tokens; its suffix [10, 11, 12] occurred at 0
    step, _ = step_with(s, {"a": [13]})
    assert step.num_scheduled == {"a": 11}
    request = s.requests["a"]
    step, outputs = step_with(s, {"a": [14, 15, 99]})  # drafts [14, 15, 16, 17]: two accepted, 99 at the third
    entry = step.scheduled["a"]
    assert (entry.start, entry.num_new, entry.draft_token_ids) == (11, 5, (14, 15, 16, 17))
    assert step.plan.cached_requests[0].draft_token_ids == [14, 15, 16, 17]
    assert step.plan.cached_requests[0].num_scheduled_tokens == 5
    assert [o.new_token_ids for o in outputs] == [[14, 15, 99]]
    assert request.output_token_ids == [13, 14, 15, 99]
    assert request.num_computed_tokens == 14  # 11 + 3 gained: the last gained token (99) is computed next
    assert len(s.kv.block_tables["a"]) == 4  # 16 slots booked (ceil(16/4)), trimmed to ceil(14/4)
    assert s.kv.pool.num_free == 64 - 4
    stats = s.stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (1, 4, 2)
    assert stats.spec_accepted_per_pos == [1, 1, 0, 0]


def test_a_draft_model_books_draft_slots_every_decode_step_within_max_tokens():
    from shuttle.scheduler.speculation_book import DRAFT_SLOT

    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model="/draft")
    s = Scheduler(SchedulerConfig(speculative_config=spec), KVCacheManager(64, BLOCK), 128, (EOS,))
    submit(s, "a", [5, 6, 7], max_tokens=6)
    submit(s, "b", [8, 9], max_tokens=6, repetition_penalty=1.2)  # penalties: never speculates
    step, _ = step_with(s, {"a": [40], "b": [50]})
    assert step.num_scheduled == {"a": 3, "b": 2}
    step, outputs = step_with(s, {"a": [41, 42], "b": [51]})  # one of three slots accepted, then the target's token
    assert step.scheduled["a"].draft_token_ids == (DRAFT_SLOT,) * 3 and step.scheduled["b"].draft_token_ids == ()
    assert step.plan.cached_requests[0].draft_token_ids == [DRAFT_SLOT] * 3 and step.num_scheduled["a"] == 4
    assert s.requests["a"].num_computed_tokens == 5 and len(s.kv.block_tables["a"]) == 2
    step, outputs = step_with(s, {"a": [43, 44, 45], "b": [52]})  # a has 3 outputs of 6: room for 2 drafts only
    assert step.scheduled["a"].draft_token_ids == (DRAFT_SLOT,) * 2
    assert sorted((o.request_id, o.new_token_ids, o.finish_reason) for o in outputs) == [
        ("a", [43, 44, 45], FinishReason.LENGTH), ("b", [52], None)]
    stats = s.stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (2, 5, 3)
    assert stats.spec_accepted_per_pos == [2, 1, 0]


def test_a_request_whose_drafts_keep_failing_pauses_drafting_with_backoff():
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model="/draft")
    s = Scheduler(SchedulerConfig(speculative_config=spec), KVCacheManager(256, BLOCK), 512, (EOS,))
    submit(s, "a", [5, 6, 7], max_tokens=200)
    step_with(s, {"a": [40]})
    drafted = []
    for turn in range(40):
        step = s.schedule()
        entry = step.scheduled["a"]
        drafted.append(len(entry.draft_token_ids))
        accept = turn == 35  # one run of drafts accepted: the backoff ends
        gained = [41, 42, 43] if accept and entry.draft_token_ids else [41]
        s.update_from_output(step, StepResult(step_id=step.plan.step_id, request_ids=["a"] * len(gained),
                                              token_ids=gained))
        s.kv.pool.check_invariants()
    # two failed runs, pause 2; fail, pause 4; fail, pause 8; fail, pause 16 (the cap) ...
    assert drafted[:19] == [2, 2, 0, 0, 2, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 2]
    assert drafted[19:35] == [0] * 16  # paused MAX_PAUSE steps, then it tries again
    assert drafted[35:] == [2, 2, 2, 0, 0]  # accepted at 35: back to drafting, then two misses pause it for 2
    assert s.requests["a"].spec_misses == 2


def test_only_blocks_of_accepted_tokens_are_committed_to_the_prefix_cache():
    s = make_scheduler()
    submit(s, "a", PHRASE + PHRASE[:3])
    step_with(s, {"a": [13]})
    step_with(s, {"a": [77]})  # every draft rejected: positions 12.. hold rejected drafts' KV
    request = s.requests["a"]
    assert request.num_computed_tokens == 12 and len(s.kv.block_tables["a"]) == 3
    tokens = request.all_token_ids  # 13 known tokens: three full blocks, all computed
    digest, expected = ROOT_HASH, []
    for i in range(3):
        digest = block_hash(digest, tuple(tokens[i * BLOCK:(i + 1) * BLOCK]))
        expected.append(digest)
    assert s.kv._num_committed["a"] == 3
    assert [s.kv.pool.lookup(d, tuple(tokens[i * BLOCK:(i + 1) * BLOCK])) for i, d in enumerate(expected)] \
        == s.kv.block_tables["a"][:3]
    assert s.kv.pool.num_cached == 3  # nothing of the rejected drafts (a fourth block [77, 15, 16, 17]) is findable


def test_all_accepted_gains_the_bonus_token_and_drafts_stay_inside_the_budget():
    s = make_scheduler(max_num_batched_tokens=14, long_prefill_token_threshold=0)
    submit(s, "a", PHRASE + PHRASE[:3])
    submit(s, "b", [30, 31, 32])
    step, _ = step_with(s, {"a": [13], "b": [33]})
    step, outputs = step_with(s, {"a": [14, 15, 16, 17, 10], "b": [34]})
    assert step.num_scheduled == {"a": 5, "b": 1}  # b's last token never occurred before: a plain decode
    assert s.requests["a"].num_computed_tokens == 16
    submit(s, "c", [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50])  # a prompt that fills the rest of the budget
    step, _ = step_with(s, {"a": [11, 12], "b": [35], "c": [51]})
    assert step.num_scheduled["a"] == 5 and step.num_tokens <= 14
    s2 = make_scheduler(max_num_batched_tokens=3, long_prefill_token_threshold=0)
    submit(s2, "a", PHRASE + PHRASE[:3])
    for _ in range(4):
        step_with(s2, {"a": [13]})
    step, _ = step_with(s2, {"a": [14, 15, 16]})
    assert step.scheduled["a"].draft_token_ids == (14, 15)  # a budget of 3: one token and two drafts


def test_drafts_never_book_past_max_tokens_and_stop_cuts_the_gained_tokens():
    s = make_scheduler()
    submit(s, "a", PHRASE + PHRASE[:3], max_tokens=3)
    step_with(s, {"a": [13]})
    step, outputs = step_with(s, {"a": [14, 15]})
    assert step.scheduled["a"].draft_token_ids == (14,)  # 1 output + 1 draft + the target's token = max_tokens
    assert outputs[-1].finish_reason == FinishReason.LENGTH and outputs[-1].new_token_ids == [14, 15]
    s = make_scheduler()
    submit(s, "b", PHRASE + PHRASE[:3], stop_token_ids=(15,))
    step_with(s, {"b": [13]})
    _, outputs = step_with(s, {"b": [14, 15, 16, 17, 10]})  # a stop token among the accepted drafts
    assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].new_token_ids == [14, 15]
    assert s.kv.pool.num_free == 64 and not s.requests


def test_no_drafts_for_grammars_penalties_or_while_speculation_is_off():
    for sampling in (dict(structured=StructuredOutput(kind="json_object")), dict(presence_penalty=0.5)):
        s = make_scheduler()
        submit(s, "a", PHRASE + PHRASE[:3], **sampling)
        s.grammars.answered = lambda message: ([], [])
        if s.grammars.num_held:
            s.waiting.push(s.requests["a"])
            s.grammars.release(s.requests["a"])
        step_with(s, {"a": [13]})
        step, _ = step_with(s, {"a": [14]})
        assert step.num_scheduled == {"a": 1} and not step.scheduled["a"].draft_token_ids
    plain = Scheduler(SchedulerConfig(), KVCacheManager(64, BLOCK), 128, (EOS,))
    submit(plain, "a", PHRASE + PHRASE[:3])
    step_with(plain, {"a": [13]})
    step, _ = step_with(plain, {"a": [14]})
    assert step.num_scheduled == {"a": 1} and step.plan.cached_requests[0].draft_token_ids == []
    assert plain.stats().spec_num_drafts == 0 and plain.stats().spec_accepted_per_pos == []


def test_drafts_take_only_free_blocks():
    s = make_scheduler(num_blocks=5)
    submit(s, "a", PHRASE + PHRASE[:3], max_tokens=8)  # 3 blocks
    submit(s, "b", [20, 21, 22, 23, 24, 25, 26, 27], max_tokens=8)  # 2 blocks: none is left free
    step_with(s, {"a": [13], "b": [28]})
    step, _ = step_with(s, {"a": [14], "b": [29]})
    assert step.num_scheduled["a"] == 1 and not step.scheduled["a"].draft_token_ids  # no block for its drafts
    assert s.num_preemptions == 1 and "b" not in step.scheduled  # b's own block preempted b, not a's guesses


def test_preemption_in_the_middle_of_a_speculative_run_resumes_from_the_accepted_tokens():
    s = make_scheduler(num_blocks=8)
    submit(s, "a", list(range(40, 52)), max_tokens=16)  # ranks first: b is the victim
    submit(s, "b", PHRASE + PHRASE[:3], max_tokens=14)
    expected, got = [], []
    fed = itertools.count(100)
    phrase = itertools.islice(itertools.cycle(PHRASE), 3, None)
    preempted_at = None
    for turn in range(60):
        step = s.schedule()
        if not step.scheduled:
            break
        gains = {rid: [next(fed)] for rid in step.sampling_ids}
        if "b" in gains:  # b continues its phrase: its first two drafts accepted, then the target's token
            gains["b"] = [next(phrase) for _ in range(min(len(step.scheduled["b"].draft_token_ids), 2) + 1)]
        if "b" in gains:
            expected += gains["b"]
        s.update_from_output(step, StepResult(step_id=step.plan.step_id, token_ids=[t for r in gains for t in gains[r]],
                                              request_ids=[r for r in gains for _ in gains[r]]))
        s.kv.pool.check_invariants()
        outputs = s.take_outputs().get(b"c", [])
        if s.num_preemptions and preempted_at is None:
            preempted_at = turn
            request = s.requests["b"]
            assert request.num_computed_tokens == 0 and request.num_output_placeholders == 0
            assert "b" not in s.kv.block_tables
            assert s.stats().spec_num_accepted_tokens > 0  # b was preempted after speculative steps
        for out in outputs:
            if out.request_id == "b":
                got += out.new_token_ids
                assert out.finish_reason in (None, FinishReason.LENGTH)
    assert preempted_at is not None and not s.requests and s.kv.pool.num_free == 8
    assert s.stats().spec_num_accepted_tokens > 0
    assert got == expected[:14]  # every gained token of b kept once, across the preemption, cut at max_tokens


def test_abort_while_a_speculative_step_runs_drops_its_result():
    s = make_scheduler()
    submit(s, "a", PHRASE + PHRASE[:3])
    step_with(s, {"a": [13]})
    step = s.schedule()
    assert step.scheduled["a"].draft_token_ids
    s.abort(["a"])
    s.update_from_output(step, StepResult(step_id=step.plan.step_id, request_ids=["a", "a"], token_ids=[14, 15]))
    s.kv.pool.check_invariants()
    assert s.kv.pool.num_free == 64 and s.stats().spec_num_drafts == 0


def test_speculation_turns_overlap_off():
    s = make_scheduler()
    assert StepPipeline(s, max_in_flight=2).max_in_flight == 1
    assert StepPipeline(Scheduler(SchedulerConfig(), KVCacheManager(8, BLOCK), 64, ()), 2).max_in_flight == 2


@pytest.mark.parametrize("k", [1, 3])
def test_num_speculative_tokens_bounds_the_drafts(k):
    s = make_scheduler(k=k)
    submit(s, "a", PHRASE + PHRASE[:3])
    step_with(s, {"a": [13]})
    step, _ = step_with(s, {"a": [14]})
    assert step.scheduled["a"].draft_token_ids == tuple(PHRASE[4:4 + k])


def test_speculative_config_parses_ngram_into_the_config_and_refuses_the_rest_by_name(tmp_path, capsys):
    from shuttle.common.config import IpcConfig, ShuttleConfig
    from shuttle.launcher import cli
    from shuttle.launcher.model_args import resolve_model_args
    from tests.server import MODEL_DIR

    args = cli.build_parser().parse_args(["serve", str(MODEL_DIR), "--speculative-config",
                                          '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'])
    resolve_model_args(args)
    config = ShuttleConfig.from_json(ShuttleConfig.from_args(args, IpcConfig.in_directory(str(tmp_path))).to_json())
    assert config.scheduler.speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=4)
    for value, why in [('{"method": "eagle", "model": "m", "num_speculative_tokens": 3}',
                        "method 'eagle' is not implemented (\"ngram\", prompt lookup, or \"draft_model\")"),
                       ('{"method": "draft_model", "num_speculative_tokens": 3}',
                        "draft_model needs \"model\": the draft model's directory"),
                       ('{"model": "m", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}',
                        "draft_tensor_parallel_size other than 1 is not implemented"),
                       ('{"method": "draft_model", "model": "m", "num_speculative_tokens": 3, "prompt_lookup_max": 2}',
                        "key 'prompt_lookup_max' is not implemented (draft_model takes model, num_speculative_tokens, "
                        "draft_tensor_parallel_size)"),
                       ('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4}',
                        "key 'disable_by_batch_size' is not implemented (ngram takes num_speculative_tokens, "
                        "prompt_lookup_max, prompt_lookup_min)"),
                       ('{"method": "ngram", "num_speculative_tokens": 0}',
                        "num_speculative_tokens must be at least 1")]:
        with pytest.raises(SystemExit) as exit_:
            cli.build_parser().parse_args(["serve", str(MODEL_DIR), "--speculative-config", value])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and err[-1] == f"shuttle serve: error: argument --speculative-config: {why}"


def test_spec_decode_counters_reach_metrics_summed_over_groups():
    from shuttle.frontend.engine.router import aggregate_stats
    from shuttle.frontend.observability.metrics import Metrics

    groups = [SchedulerStats(spec_num_drafts=3, spec_num_draft_tokens=9, spec_num_accepted_tokens=4,
                             spec_accepted_per_pos=[3, 1, 0]),
              SchedulerStats(spec_num_drafts=2, spec_num_draft_tokens=5, spec_num_accepted_tokens=2,
                             spec_accepted_per_pos=[1, 1, 0])]
    text = Metrics(lambda: aggregate_stats(groups)).render().decode()
    for line in ("shuttle:spec_decode_num_drafts_total 5.0", "shuttle:spec_decode_num_draft_tokens_total 14.0",
                 "shuttle:spec_decode_num_accepted_tokens_total 6.0",
                 'shuttle:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 4.0',
                 'shuttle:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2.0',
                 'shuttle:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 0.0'):
        assert line in text.splitlines(), line


def test_the_periodic_stats_line_tells_the_windows_acceptance_rate(caplog):
    from shuttle.scheduler.stats import StepStats

    stats = StepStats(log_interval=0.0)
    stats.on_step(1, 5, 0, 3)
    with caplog.at_level("INFO", logger="shuttle.scheduler"):
        stats.maybe_log(SchedulerStats(num_running=1, spec_num_drafts=4, spec_num_draft_tokens=10,
                                       spec_num_accepted_tokens=6))
        stats.on_step(1, 5, 0, 3)
        stats.maybe_log(SchedulerStats(num_running=1, spec_num_drafts=6, spec_num_draft_tokens=20,
                                       spec_num_accepted_tokens=7))
        stats.on_step(1, 1, 0, 1)
        stats.maybe_log(SchedulerStats(num_running=1, spec_num_drafts=6, spec_num_draft_tokens=20,
                                       spec_num_accepted_tokens=7))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].endswith(", preemptions 0, draft acceptance rate 60.0% (6 of 10), mean acceptance length 2.50")
    assert lines[1].endswith(", draft acceptance rate 10.0% (1 of 10), mean acceptance length 1.50")
    assert lines[2].endswith(", preemptions 0")  # no drafts in that window


def test_a_draft_model_is_checked_at_start_up_and_its_path_made_absolute(tmp_path, monkeypatch):
    import json
    import shutil

    from shuttle.common.config import IpcConfig, ShuttleConfig
    from shuttle.common.errors import ModelDirError
    from shuttle.launcher import cli
    from shuttle.launcher.model_args import resolve_model_args
    from tests.server import MODEL_DIR

    def config_with(draft: str):
        args = cli.build_parser().parse_args(["serve", str(MODEL_DIR), "--speculative-config",
                                              json.dumps({"model": draft, "num_speculative_tokens": 2})])
        resolve_model_args(args)
        return ShuttleConfig.from_args(args, IpcConfig.in_directory(str(tmp_path)))

    draft = tmp_path / "draft"
    shutil.copytree(MODEL_DIR, draft)
    monkeypatch.chdir(tmp_path)
    assert config_with("draft").scheduler.speculative_config == SpeculativeConfig(
        method="draft_model", num_speculative_tokens=2, model=str(draft))
    with pytest.raises(ModelDirError, match=r"^--speculative-config's draft model: model directory 'nowhere' does "
                                            r"not exist$"):
        config_with("nowhere")
    hf_config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**hf_config, "vocab_size": 1024}))
    with pytest.raises(ModelDirError, match=r"^--speculative-config's draft model draft has a vocabulary of 1024 "
                                            r"tokens, the served model 512: a draft model must share"):
        config_with("draft")


def test_speculation_under_tensor_parallel_is_refused_before_anything_starts():
    import dataclasses

    from shuttle.common.config import IpcConfig, ParallelConfig, ShuttleConfig
    from shuttle.common.devices import DeviceError, resolve_config
    from shuttle.common.model_config import ModelConfig
    from tests.server import MODEL_DIR

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1)
    config = ShuttleConfig(model=ModelConfig.from_dir(MODEL_DIR), ipc=IpcConfig.in_directory("/x"),
                           scheduler=SchedulerConfig(speculative_config=spec), parallel=ParallelConfig(2))
    with pytest.raises(DeviceError, match=r"^--speculative-config runs without tensor parallel only \(-tp 1\), "
                                          r"not -tp 2$"):
        resolve_config(config, 1, cuda_devices=2)
    single = dataclasses.replace(config, parallel=ParallelConfig(1))
    assert resolve_config(single, 1, cuda_devices=0).scheduler.speculative_config == spec


def test_drafts_and_the_spec_decode_counters_travel_on_the_wire():
    import msgspec

    from shuttle.common.messages import CachedRequestData, StepPlan

    cached = CachedRequestData(request_id="a", new_block_ids=[3], num_computed_tokens=11, num_scheduled_tokens=5,
                               draft_token_ids=[14, 15, 16, 17])
    plan = StepPlan(step_id=7, new_requests=[], cached_requests=[cached])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan) == plan
    stats = SchedulerStats(spec_num_drafts=2, spec_num_draft_tokens=6, spec_num_accepted_tokens=3,
                           spec_accepted_per_pos=[2, 1, 0])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=SchedulerStats) == stats


def test_several_tokens_in_one_output_count_and_stop_as_they_would_one_by_one():
    from shuttle.frontend.generation import TextGeneration
    from shuttle.frontend.tokenizer import TextTokenizer
    from tests.conftest import hf_greedy
    from tests.server import MODEL_DIR

    tokenizer = TextTokenizer(MODEL_DIR)
    story = hf_greedy([1], 30)
    stop = tokenizer.decode(story[8:10])  # completed by the tenth token

    def generate(chunks):
        generation = TextGeneration(engine=None, tokenizer=tokenizer, stop=[stop],  # type: ignore[arg-type]
                                    request=Submit(request_id="r", prompt_token_ids=[1], arrival_time=0.0,
                                                   sampling=SamplingParams(max_tokens=30)))
        generation.begin()
        texts, ids = [], []
        for chunk in chunks:
            delta = generation.advance(RequestOutput(request_id="r", new_token_ids=chunk))
            if delta is not None:
                texts.append(delta.text)
                ids += delta.token_ids
            if generation.finish_reason is not None:
                break
        return "".join(texts), ids, generation.num_output_tokens, generation.finish_reason

    one_by_one = generate([[t] for t in story])
    assert one_by_one[2:] == (10, "stop")
    assert generate([story[:3], story[3:8], story[8:13], story[13:]]) == one_by_one
