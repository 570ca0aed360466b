"""LoRA without a model: --lora-modules parsing, adapter_config.json checks (every refusal one line naming the
adapter), the flag rules, the scheduler's adapter slots (LRU among idle slots, loads in the plan, a request for a
busy adapter waiting and never starving, slots given back on preemption), and an unknown adapter's 404."""

import argparse
import itertools
import json

import pytest

from shuttle.common.config import SchedulerConfig
from shuttle.common.errors import ModelDirError
from shuttle.common.lora import LoRAConfig, LoRAModule, lora_config_error, parse_lora_module, read_adapter
from shuttle.common.messages import FinishReason, LoRALoad, StepResult, Submit
from shuttle.common.sampling import SamplingParams
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.lora_slots import LoRASlots, adapter_key
from shuttle.scheduler.scheduler import Scheduler

_arrival = itertools.count()


def test_lora_modules_take_name_equals_path_and_vllms_json():
    assert parse_lora_module("sql=/a/sql") == LoRAModule(name="sql", path="/a/sql")
    assert parse_lora_module('{"name": "fr", "path": "/a/fr", "base_model_name": "b"}') == LoRAModule(
        name="fr", path="/a/fr", base_model_name="b")
    for value, why in [("sql", "expected NAME=PATH or a JSON object"), ("=/a", "needs a name and a path"),
                       ('{"name": "x", "path": "/p", "rank": 8}', "key 'rank' is not implemented"),
                       ("a,b=/p", "without a comma"), ('{"name": " ", "path": "/p"}', "whitespace"),
                       ('{"name": "a\\u0000", "path": "/p"}', "printable")]:
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse_lora_module(value)


def adapter(tmp_path, **config):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                              "target_modules": ["q_proj", "v_proj"], **config}))
    return tmp_path


def test_adapter_configs_are_read_with_their_scale_and_refused_by_name(tmp_path):
    assert read_adapter(adapter(tmp_path / "a"), 16).scale == 2.0
    assert read_adapter(adapter(tmp_path / "b", use_rslora=True), 16).scale == pytest.approx(16 / 8 ** 0.5)
    for config, why in [({"r": 32}, "rank 32 exceeds --max-lora-rank 16"),
                        ({"use_dora": True}, "use_dora = true is not implemented"),
                        ({"target_modules": ["q_proj", "lm_head"]}, "target module 'lm_head' is not one shuttle"),
                        ({"target_modules": "q_proj|v_proj"}, "as a regular expression is not implemented"),
                        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                        ({"bias": "all"}, "bias"), ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA")]:
        with pytest.raises(ModelDirError, match=why):
            read_adapter(adapter(tmp_path / "c", **config), 16)
    with pytest.raises(ModelDirError, match="target module 'down_proj' is not in the served model"):
        read_adapter(adapter(tmp_path / "d", target_modules=["down_proj"]), 16, frozenset({"q_proj", "v_proj"}))
    with pytest.raises(ModelDirError, match="no adapter_config.json"):
        read_adapter(tmp_path / "nowhere", 16)
    for config, why in [({"lora_alpha": "16"}, "lora_alpha must be a finite number, got '16'"),
                        ({"lora_alpha": float("inf")}, "lora_alpha must be a finite number, got inf"),
                        ({"lora_alpha": float("nan")}, "lora_alpha must be a finite number"),
                        ({"lora_alpha": True}, "lora_alpha must be a finite number, got True"),
                        ({"r": True}, "r must be a positive integer, got True"),
                        ({"use_rslora": "yes"}, "use_rslora must be true or false")]:
        with pytest.raises(ModelDirError, match=why):  # json.dumps writes inf and nan as JSON's readers take them
            read_adapter(adapter(tmp_path / "e", **config), 16)


KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_"


def test_all_linear_targets_are_the_modules_the_weights_adapt(tmp_path):
    """PEFT's target_modules "all-linear" is a word, not a pattern: the adapter adapts the modules its weights name."""
    import torch
    from safetensors.torch import save_file

    weights = {f"base_model.model.model.layers.{layer}.{block}.{module}.lora_{part}.weight": torch.zeros(2, 2)
               for layer in (0, 1) for block, module in [("self_attn", "q_proj"), ("self_attn", "o_proj"),
                                                         ("mlp", "down_proj")] for part in "AB"}
    save_file(weights, str(adapter(tmp_path / "a", target_modules="all-linear") / "adapter_model.safetensors"))
    assert read_adapter(tmp_path / "a", 16).target_modules == ("down_proj", "o_proj", "q_proj")
    with pytest.raises(ModelDirError, match="target module 'down_proj' is not in the served model"):
        read_adapter(tmp_path / "a", 16, frozenset({"q_proj", "o_proj"}))
    save_file({"unrelated.weight": torch.zeros(2)}, str(adapter(tmp_path / "b", target_modules="all-linear")
                                                        / "adapter_model.safetensors"))
    with pytest.raises(ModelDirError, match="all-linear.*adapt no module"):
        read_adapter(tmp_path / "b", 16)
    with pytest.raises(ModelDirError, match="adapter_model.safetensors: "):  # (the empty file `adapter` writes)
        read_adapter(adapter(tmp_path / "c", target_modules="all-linear"), 16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_adapter_weights_must_be_whole_and_finite_also_once_scaled(tmp_path, dtype):
    import torch
    from safetensors.torch import save_file

    from shuttle.common.adapter_weights import check_adapter_weights

    a, b = torch.randn(4, 8).to(getattr(torch, dtype)), torch.randn(8, 4).to(getattr(torch, dtype))
    weights = tmp_path / "adapter_model.safetensors"
    save_file({KEY + "A.weight": a, KEY + "B.weight": b}, str(weights))
    check_adapter_weights(tmp_path, 4, 2.0)
    with pytest.raises(ModelDirError, match="overflows float32"):
        check_adapter_weights(tmp_path, 4, 1e38)
    for bad in (float("nan"), float("inf"), -float("inf")):
        poisoned = b.clone()
        poisoned[3, 1] = bad
        save_file({KEY + "A.weight": a, KEY + "B.weight": poisoned}, str(weights))
        with pytest.raises(ModelDirError, match="'base_model.+lora_B.weight' holds NaN or infinite values"):
            check_adapter_weights(tmp_path, 4, 2.0)
    save_file({KEY + "A.weight": a, KEY + "B.weight": b}, str(weights))
    weights.write_bytes(weights.read_bytes()[:-10])  # cut short
    with pytest.raises(ModelDirError, match="is not a valid safetensors file"):
        check_adapter_weights(tmp_path, 4, 2.0)


def test_the_flag_rules():
    module = LoRAModule(name="a", path="/a")
    assert lora_config_error(LoRAConfig(lora_modules=(module,)), 1) == "--lora-modules needs --enable-lora"
    assert lora_config_error(LoRAConfig(enable_lora=True), 2) is None  # tensor parallel shards the adapters too
    assert "names adapter 'a' twice" in lora_config_error(LoRAConfig(enable_lora=True, lora_modules=(module, module)),
                                                          1)
    assert lora_config_error(LoRAConfig(enable_lora=True, max_loras=4, max_cpu_loras=2), 1) == (
        "--max-cpu-loras 2 is below --max-loras 4")
    assert lora_config_error(LoRAConfig(enable_lora=True, lora_modules=(module,)), 1) is None


def test_slots_keep_idle_adapters_and_evict_the_least_recently_used():
    slots = LoRASlots(2)
    a, b, c = (adapter_key(n, f"/{n}", "") for n in "abc")  # no load id: --lora-modules
    assert slots.take(a) == 0 and slots.take(b) == 1 and slots.take(a) == 0
    assert slots.take_loads() == [LoRALoad(slot=0, name="a", path="/a"), LoRALoad(slot=1, name="b", path="/b")]
    assert not slots.can_take(c) and slots.can_take(a)
    slots.give_back(1)  # b idle
    assert slots.running_names == ["a"] and slots.can_take(c)
    assert slots.take(c) == 1 and slots.take_loads() == [LoRALoad(slot=1, name="c", path="/c")]
    slots.give_back(0)
    slots.give_back(0)
    slots.give_back(1)
    assert slots.take(b) == 0  # a was used longer ago than c
    assert slots.take(c) == 1 and slots.take_loads() == [LoRALoad(slot=0, name="b", path="/b")]
    slots.give_back(0)
    assert slots.take(adapter_key("b", "/elsewhere", "")) == 0  # same name, another directory: loaded again
    assert slots.take_loads() == [LoRALoad(slot=0, name="b", path="/elsewhere")]


def make_scheduler(num_slots=1, num_blocks=64):
    return Scheduler(SchedulerConfig(), KVCacheManager(num_blocks, 4), 256, (2,), lora=LoRASlots(num_slots))


def submit(s, rid, adapter, prompt=(5, 6, 7, 8, 9), max_tokens=3, path=None):
    s.add_request(b"c", Submit(request_id=rid, prompt_token_ids=list(prompt), arrival_time=float(next(_arrival)),
                               lora_name=adapter, lora_path=f"/{adapter}" if path is None and adapter else path or "",
                               sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


def settle(s):
    step = s.schedule()
    ids = step.sampling_ids
    s.update_from_output(step, StepResult(step_id=step.plan.step_id, request_ids=ids, token_ids=[11] * len(ids)))
    s.kv.pool.check_invariants()
    return step


def test_a_request_for_a_busy_slot_waits_and_holds_back_later_adapter_requests():
    s = make_scheduler()
    submit(s, "a1", "a")
    submit(s, "b1", "b")  # the one slot is a's while a1 runs
    submit(s, "base", "")
    submit(s, "a2", "a")
    step = settle(s)
    assert list(step.scheduled) == ["a1"]  # b1 waits for the slot; nobody overtakes it
    assert (s.stats().lora_running, s.stats().lora_waiting) == (["a"], ["a", "b"])
    assert step.plan.lora_loads == [LoRALoad(slot=0, name="a", path="/a")]
    assert step.plan.new_requests[0].lora_slot == 0
    finished, loads = {}, []
    for _ in range(12):
        step = settle(s)
        for out in s.take_outputs().get(b"c", []):
            if out.finish_reason is not None:
                finished[out.request_id] = step.plan.step_id
        loads += [(load.name, list(step.scheduled)[0]) for load in step.plan.lora_loads]
    assert loads == [("b", "b1"), ("a", "a2")]  # each load comes with the request that needed it
    assert sorted(finished) == ["a1", "a2", "b1", "base"] and finished["b1"] < finished["a2"]
    assert s.lora.holders == [0]


def test_preemption_gives_the_slot_back_and_an_adapter_without_its_directory_is_404():
    s = make_scheduler(num_slots=2, num_blocks=4)
    submit(s, "a1", "a", prompt=range(5, 13), max_tokens=8)
    submit(s, "b1", "b", prompt=range(5, 13), max_tokens=8)
    for _ in range(4):
        settle(s)
    assert s.num_preemptions > 0
    assert sum(s.lora.holders) == len(s.running)
    submit(s, "x", "nope", path="")
    [out] = [o for o in s.take_outputs()[b"c"] if o.request_id == "x"]
    assert (out.finish_reason, out.error_status, out.error_message) == (
        FinishReason.ERROR, 404, "LoRA adapter 'nope' is not served")


def test_a_slot_whose_load_failed_fails_the_steps_that_use_it(tmp_path):
    import torch
    from safetensors.torch import save_file

    from shuttle.worker.lora import LoRAAdapters

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(4, 4, bias=False)

    model = torch.nn.Module()
    model.block = Block()
    adapters = LoRAAdapters(model, num_slots=2, max_rank=2)
    path = adapter(tmp_path / "a", r=2, lora_alpha=2, target_modules=["q_proj"])
    weights = str(path / "adapter_model.safetensors")
    save_file({"base_model.model.block.q_proj.lora_A.weight": torch.ones(2, 4),
               "base_model.model.block.q_proj.lora_B.weight": torch.ones(4, 2)}, weights)
    adapters.load(1, "a", str(path))
    x = torch.ones(1, 2, 4)
    adapters.begin_step(torch.tensor([1, -1]))
    delta = model.block.q_proj(x) - model.block.q_proj.base(x)
    # scale 1 * B @ A @ x on the adapter's row (up to the rounding of (y + delta) - y), nothing on the base row
    assert delta[0, 0].tolist() == pytest.approx([8.0] * 4, abs=1e-5) and delta[0, 1].tolist() == [0.0] * 4
    save_file({"base_model.model.block.q_proj.lora_A.weight": torch.ones(3, 4)}, weights)
    with pytest.raises(Exception, match="lora_A or lora_B without the other"):
        adapters.load(1, "a", str(path))
    adapters.begin_step(torch.tensor([-1, -1]))  # base rows still run
    with pytest.raises(RuntimeError, match="LoRA adapter a could not be loaded"):
        adapters.begin_step(torch.tensor([1, -1]))


def test_lora_requests_info_is_vllms_gauge_over_every_group():
    from shuttle.common.config import IpcConfig, ShuttleConfig
    from shuttle.common.messages import SchedulerStats
    from shuttle.common.model_config import ModelConfig
    from shuttle.frontend.engine.router import aggregate_stats
    from shuttle.frontend.observability.metrics import Metrics
    from tests.server import MODEL_DIR

    groups = [SchedulerStats(lora_running=["sql"], lora_waiting=["fr"]), SchedulerStats(lora_running=["fr", "sql"])]
    config = ShuttleConfig(model=ModelConfig.from_dir(MODEL_DIR), ipc=IpcConfig.in_directory("/x"),
                           lora=LoRAConfig(enable_lora=True, max_loras=3))
    text = Metrics(lambda: aggregate_stats(groups), None, config).render().decode()
    [line] = [line for line in text.splitlines() if line.startswith("shuttle:lora_requests_info{")]
    assert 'max_lora="3"' in line and 'running_lora_adapters="fr,sql"' in line and 'waiting_lora_adapters="fr"' in line
    plain = ShuttleConfig(model=ModelConfig.from_dir(MODEL_DIR), ipc=IpcConfig.in_directory("/x"))
    assert "lora_requests_info" not in Metrics(lambda: SchedulerStats(), None, plain).render().decode()
