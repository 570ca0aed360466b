"""LoRA adapters on the in-process engine: greedy output through an adapter equals transformers' generate on
weights merged by hand (W + scale * B @ A), for Llama (stories260K) and Qwen2, at float32; two adapters and the
base model in one batch each equal their own reference; with fewer slots than adapters every request still
finishes; and an adapter's prefix-cache blocks are never the base model's. Steps without an adapter row run the
compiled decode forward (worker/cpu_compiled_decode.py), which adapters loading and unloading never make compile
again."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from scripts.dev.check_architectures import build_model_dir
from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig
from shuttle.common.lora import TARGET_MODULES, LoRAConfig, LoRAModule, read_adapter
from shuttle.common.messages import Submit
from shuttle.common.model_config import ModelConfig
from shuttle.common.sampling import SamplingParams
from shuttle.scheduler.in_process import drive
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.lora_slots import lora_slots_for
from shuttle.scheduler.scheduler import Scheduler
from shuttle.worker import cpu_compiled_decode
from shuttle.worker.worker import ModelRunner
from tests.server import MODEL_DIR

MAX_TOKENS = 24


@pytest.fixture(autouse=True)
def compiled_steps_never_compile_again(monkeypatch):
    monkeypatch.setattr(cpu_compiled_decode, "SERVING_STANCE", "fail_on_recompile")


def write_adapter(directory, model_dir, targets, rank, alpha, seed, rslora=False, all_linear=False):
    """A PEFT LoRA adapter for `model_dir` with random A and B large enough to change greedy output; `all_linear`
    writes its target_modules as PEFT's "all-linear" (as PEFT saves them: its weights name the modules)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets:
            out_features, in_features = module.weight.shape
            prefix = f"base_model.model.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.2
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
        "target_modules": "all-linear" if all_linear else sorted(targets),
        "use_rslora": rslora, "use_dora": False, "base_model_name_or_path": str(model_dir)}))
    return directory


def merged_greedy(model_dir, adapter_dir, prompts):
    """transformers' greedy generate on the base weights with the adapter merged in by hand."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    if adapter_dir is not None:
        spec = read_adapter(adapter_dir, 64)
        from safetensors.torch import load_file
        tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
        with torch.no_grad():
            for name, module in model.named_modules():
                a = tensors.get(f"base_model.model.{name}.lora_A.weight")
                if a is not None:
                    b = tensors[f"base_model.model.{name}.lora_B.weight"]
                    module.weight += spec.scale * b @ a
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def serve(model_dir, lora: LoRAConfig, jobs, num_blocks=256, before=None, errors=None):
    """Every job's (prompt, adapter name) greedy output, all submitted at once, and the scheduler. `before` runs
    once the runner is built; `errors`, when given, collects each request that ends in error (id -> output)
    instead of failing."""
    model = ModelConfig.from_dir(model_dir, max_model_len=128)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"), cache=CacheConfig(4, num_blocks),
                           scheduler=SchedulerConfig(), lora=lora)
    runner = ModelRunner(config)
    if before is not None:
        before()
    scheduler = Scheduler(config.scheduler, KVCacheManager(num_blocks, 4, True), model.max_model_len, (),
                          lora=lora_slots_for(lora))
    outputs = {str(i): [] for i in range(len(jobs))}
    paths = {m.name: m.path for m in lora.lora_modules}
    for i, (prompt, adapter) in enumerate(jobs):
        scheduler.add_request(b"c", Submit(request_id=str(i), prompt_token_ids=prompt, arrival_time=float(i),
                                           lora_name=adapter, lora_path=paths.get(adapter, ""), sampling=SamplingParams(
                                               max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)))

    def collect(batch):
        for out in batch:
            if errors is not None and out.error_status:
                assert out.request_id not in errors
                errors[out.request_id] = out
                continue
            assert out.error_status == 0, out.error_message
            outputs[out.request_id] += out.new_token_ids

    drive(scheduler, runner, collect, check_blocks=True)
    return [outputs[str(i)] for i in range(len(jobs))], scheduler


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2")
    build_model_dir("qwen2", directory)
    return directory


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_two_adapters_and_the_base_in_one_batch_each_equal_merged_weights(architecture, qwen2, tmp_path):
    model_dir = MODEL_DIR if architecture == "llama" else qwen2
    first = write_adapter(tmp_path / "first", model_dir, {"q_proj", "v_proj", "down_proj"}, rank=4, alpha=8, seed=1)
    second = write_adapter(tmp_path / "second", model_dir, TARGET_MODULES, rank=8, alpha=16, seed=2, rslora=True,
                           all_linear=True)
    prompts = [[1, 15, 27, 99, 300, 41, 7], [1, 400, 23, 8, 91], [1, 5, 6, 7, 8, 9, 10, 11]]
    want = {name: merged_greedy(model_dir, adapter, prompts)
            for name, adapter in (("", None), ("first", first), ("second", second))}
    assert want["first"] != want[""] and want["second"] != want[""]  # the adapters change the output
    lora = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8,
                      lora_modules=(LoRAModule(name="first", path=str(first)),
                                    LoRAModule(name="second", path=str(second))))
    jobs = [(p, name) for p in prompts for name in ("first", "", "second")]
    got, scheduler = serve(model_dir, lora, jobs)
    for (prompt, name), out in zip(jobs, got):
        assert out == want[name][prompts.index(prompt)], (name, prompt)
    assert scheduler.lora.running_names == []


def test_more_adapters_than_slots_all_finish_and_keep_their_own_prefix_cache(tmp_path):
    adapters = {f"a{i}": write_adapter(tmp_path / f"a{i}", MODEL_DIR, {"q_proj", "up_proj"}, rank=2, alpha=4,
                                       seed=10 + i) for i in range(3)}
    prompt = [1, 15, 27, 99, 300, 41, 7, 8, 9, 10]  # two full blocks of 4: cached after the first request
    want = {name: merged_greedy(MODEL_DIR, path, [prompt])[0] for name, path in [("", None), *adapters.items()]}
    lora = LoRAConfig(enable_lora=True, max_loras=1, max_lora_rank=4,
                      lora_modules=tuple(LoRAModule(name=n, path=str(p)) for n, p in adapters.items()))
    jobs = [(prompt, name) for name in ("a0", "", "a1", "a0", "a2", "", "a1")]
    got, scheduler = serve(MODEL_DIR, lora, jobs)
    assert got == [want[name] for _, name in jobs]
    # each (adapter, prompt) computed its prompt once: the repeats found their own blocks, never another's
    assert scheduler.kv.prefix_hits == 3 * 8


def test_an_adapter_the_model_cannot_take_is_refused_when_the_worker_starts(tmp_path):
    from shuttle.common.errors import ModelDirError

    bad = write_adapter(tmp_path / "bad", MODEL_DIR, {"q_proj"}, rank=2, alpha=2, seed=3)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))  # its tensors have rank 2
    lora = LoRAConfig(enable_lora=True, lora_modules=(LoRAModule(name="bad", path=str(bad)),))
    with pytest.raises(ModelDirError, match=r"model.layers.0.self_attn.q_proj has A \(2, 64\) and B "
                                                    r"\(64, 2\), the layer needs A \[4, 64\] and B \[64, 4\]"):
        serve(MODEL_DIR, lora, [])


def test_the_offline_llm_generates_through_an_adapter_per_prompt(tmp_path):
    from shuttle import LLM, SamplingParams
    from shuttle.offline import LoRARequest

    first = write_adapter(tmp_path / "first", MODEL_DIR, {"q_proj", "up_proj"}, rank=4, alpha=8, seed=5)
    prompts = [[1, 15, 27, 99, 300], [1, 400, 23, 8, 91]]
    want = merged_greedy(MODEL_DIR, first, prompts[:1]) + merged_greedy(MODEL_DIR, None, prompts[1:])
    llm = LLM(str(MODEL_DIR), enable_lora=True, max_lora_rank=4, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_request=[LoRARequest("first", 1, str(first)), None])
    assert [list(o.outputs[0].token_ids) for o in outputs] == want
    with pytest.raises(ValueError, match="rank 8 exceeds --max-lora-rank 4"):
        wide = write_adapter(tmp_path / "wide", MODEL_DIR, {"q_proj"}, rank=8, alpha=8, seed=6)
        llm.generate("Once", params, use_tqdm=False, lora_request=LoRARequest("wide", 2, str(wide)))
    with pytest.raises(ValueError, match=r"lora_request needs LLM\(..., enable_lora=True\)"):
        LLM(str(MODEL_DIR), max_model_len=128).generate("Once", params, use_tqdm=False,
                                                        lora_request=LoRARequest("first", 1, str(first)))


def test_an_adapter_that_cannot_be_loaded_fails_its_own_requests_alone(tmp_path):
    """The adapter's files vanish after start-up: when a request first needs it, loading it into a slot fails, and
    that adapter's requests end with one 500 each while the base model's and another adapter's, in the same steps,
    finish exactly."""
    good = write_adapter(tmp_path / "good", MODEL_DIR, {"q_proj", "v_proj"}, rank=4, alpha=8, seed=1)
    gone = write_adapter(tmp_path / "gone", MODEL_DIR, {"q_proj"}, rank=4, alpha=8, seed=2)
    prompts = [[1, 15, 27, 99, 300, 41, 7], [1, 400, 23, 8, 91]]
    want = {name: merged_greedy(MODEL_DIR, adapter, prompts) for name, adapter in (("", None), ("good", good))}
    lora = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8,
                      lora_modules=(LoRAModule(name="good", path=str(good)), LoRAModule(name="gone", path=str(gone))))
    jobs = [(p, name) for p in prompts for name in ("good", "gone", "")]
    errors: dict = {}
    got, scheduler = serve(MODEL_DIR, lora, jobs, before=lambda: shutil.rmtree(gone), errors=errors)
    failed = sorted(i for i, (_, name) in enumerate(jobs) if name == "gone")
    assert sorted(int(i) for i in errors) == failed
    for out in errors.values():
        assert out.error_status == 500 and "LoRA adapter gone could not be loaded" in out.error_message
    for i, (prompt, name) in enumerate(jobs):
        if name != "gone":
            assert got[i] == want[name][prompts.index(prompt)], (i, name)
    assert not scheduler.requests
