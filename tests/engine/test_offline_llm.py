"""The offline LLM (offline/): vLLM's `LLM(model, **engine_args).generate / .chat` on stories260K in this process,
against transformers' greedy generate, with vLLM's output shapes and its refusals."""

import random
import re

import pytest

from shuttle.common.errors import ModelDirError
from shuttle.offline import LLM, SamplingParams
from tests.conftest import CHAT_TEMPLATE, hf_greedy, hf_tokenizer
from tests.server import MODEL_DIR, REPO

EOS = 2  # stories260K's end-of-sequence id


@pytest.fixture(scope="module")
def llm():
    return LLM(str(MODEL_DIR), num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, device="cpu",
               chat_template=str(REPO / CHAT_TEMPLATE))


def test_generate_is_transformers_greedy_in_input_order(llm):
    rng = random.Random(3)
    token_prompts = [[1] + [rng.randrange(3, 512) for _ in range(n)] for n in (90, 5, 150, 30, 1, 60)]
    texts = ["Once upon a time", "Lily and Tom"]
    max_tokens = [40, 7, 25, 60, 33, 18, 50, 12]
    prompts = [{"prompt_token_ids": ids} for ids in token_prompts] + texts
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)  # more prompts than max_num_seqs, chunked prefills
    text_ids = [hf_tokenizer()(t).input_ids for t in texts]
    assert [o.request_id for o in outputs] == [str(i) for i in range(8)]
    for output, ids, text, m in zip(outputs, token_prompts + text_ids, [None] * 6 + texts, max_tokens):
        expected = hf_greedy(ids, m)
        (completion,) = output.outputs
        assert (output.prompt, output.prompt_token_ids, output.finished) == (text, ids, True)
        assert completion.token_ids == expected
        decode = hf_tokenizer().decode  # the text continues the prompt's (a leading space included)
        assert decode(ids, skip_special_tokens=True) + completion.text == decode(ids + expected,
                                                                                skip_special_tokens=True)
        assert completion.finish_reason == ("stop" if expected[-1] == EOS else "length")
        assert (completion.index, completion.stop_reason, completion.logprobs, completion.cumulative_logprob) == \
            (0, None, None, None)
    # request ids count on over the LLM's life
    assert llm.generate("Once", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].request_id == "8"


def test_one_prompt_and_the_default_sampling_params(llm):
    (output,) = llm.generate({"prompt": "Once upon a time"}, use_tqdm=False)
    # stories260K has no generation_config.json: vLLM's defaults, 16 tokens sampled at temperature 1
    assert llm.get_default_sampling_params() == SamplingParams()
    assert len(output.outputs[0].token_ids) <= 16 and output.prompt == "Once upon a time"


def test_stop_strings_stop_tokens_and_logprobs(llm):
    prompt_ids = hf_tokenizer()("Once upon a time").input_ids
    greedy = hf_greedy(prompt_ids, 30)
    decode = hf_tokenizer().decode
    full_text = decode(prompt_ids + greedy, skip_special_tokens=True)[len(decode(prompt_ids,
                                                                                 skip_special_tokens=True)):]
    (stopped,) = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30, stop=["Lily"],
                                                                 logprobs=2), use_tqdm=False)
    out = stopped.outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full_text[:full_text.index("Lily")], "stop", "Lily")
    assert out.token_ids == greedy[:len(out.token_ids)] and len(out.logprobs) == len(out.token_ids)
    for token, position in zip(out.token_ids, out.logprobs):
        assert len(position) == 2 and position[token].rank == 1  # greedy: the sampled token is the most likely
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)))
    stop_id = greedy[5]
    (by_token,) = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30,
                                                                  stop_token_ids=[stop_id]), use_tqdm=False)
    assert by_token.outputs[0].token_ids == greedy[:6]
    assert (by_token.outputs[0].finish_reason, by_token.outputs[0].stop_reason) == ("stop", stop_id)


def test_n_seeded_samples_and_prompt_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, prompt_logprobs=1, ignore_eos=True)
    (first,) = llm.generate("Once upon a time", params, use_tqdm=False)
    (again,) = llm.generate("Once upon a time", params, use_tqdm=False)
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1 and all(len(o.token_ids) == 12 for o in first.outputs)
    ids = first.prompt_token_ids
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(ids)
    assert all(token in position for token, position in zip(ids[1:], first.prompt_logprobs[1:]))


def test_every_logprob_has_its_rank(llm):
    """A prompt token or a sampled one outside the top-k keeps its rank in the vocabulary (vLLM's Logprob.rank is an
    int); a fresh-clone trial found rank None for both."""
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    (out,) = llm.generate("Once upon a time the dog", params, use_tqdm=False)
    prompt_ranks = [p[t].rank for t, p in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
    sampled_ranks = [p[t].rank for t, p in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
    for ranks in (prompt_ranks, sampled_ranks):
        assert all(isinstance(r, int) and r >= 1 for r in ranks) and max(ranks) > 1, ranks
    for position in out.outputs[0].logprobs:  # the top-1 entry is rank 1; a token less likely ranks after it
        ranked = sorted(position.values(), key=lambda lp: lp.rank)
        assert ranked[0].rank == 1 and all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))


def test_max_tokens_past_max_model_len_ends_there_and_none_means_all_of_it():
    small = LLM(str(MODEL_DIR), max_model_len=40, num_kv_blocks=16, device="cpu")
    prompt = [1] + [300] * 29
    out_capped, out_none = small.generate([{"prompt_token_ids": prompt}] * 2,
                                          [SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                                           SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)],
                                          use_tqdm=False)
    for out in (out_capped, out_none):
        assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"the prompt \(length 40\) plus at least one output token is longer than "
                                         r"the maximum model length of 40"):
        small.generate({"prompt_token_ids": [1] * 40}, use_tqdm=False)
    assert small.generate({"prompt_token_ids": [1] * 39}, SamplingParams(max_tokens=5), use_tqdm=False)[0] \
        .outputs[0].finish_reason in ("length", "stop")


def test_chat_renders_the_template_and_matches_generate(llm):
    conversation = [{"role": "user", "content": "Once upon a time"}, {"role": "user", "content": "there was"}]
    chats = llm.chat([conversation, conversation[:1]], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert chats[0].prompt == "<s>Once upon a time there was"
    assert chats[0].prompt_token_ids == hf_tokenizer()("Once upon a time there was").input_ids
    assert chats[0].outputs[0].token_ids == hf_greedy(chats[0].prompt_token_ids, 20)
    (single,) = llm.chat(conversation[:1], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert single.outputs[0].token_ids == chats[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"content": "no role"}], use_tqdm=False)


def test_progress_bar_counts_finished_prompts(llm):
    bars = []

    class Bar:
        def __init__(self, **kwargs):
            self.kwargs, self.updates, self.closed = kwargs, 0, False
            bars.append(self)

        def update(self, count):
            self.updates += count

        def close(self):
            self.closed = True

    llm.generate(["Once", "Lily"], SamplingParams(n=2, max_tokens=3), use_tqdm=Bar)
    assert (bars[0].kwargs["total"], bars[0].updates, bars[0].closed) == (2, 2, True)


@pytest.mark.parametrize("prompts, error, message", [
    ({"prompt_token_ids": []}, ValueError, "the prompt is empty"),
    ({"prompt_token_ids": [1, 512]}, ValueError, r"prompt token id 512 is outside the vocabulary \[0, 512\)"),
    ([1, 2, 3], TypeError, "a prompt must be a string, a TextPrompt or a TokensPrompt"),
    ({"prompt": "x", "multi_modal_data": {}}, ValueError, "multi_modal_data: shuttle does not implement it"),
])
def test_bad_prompts_are_refused_before_anything_runs(llm, prompts, error, message):
    with pytest.raises(error, match=message):
        llm.generate(prompts, use_tqdm=False)


def test_sampling_params_refusals():
    with pytest.raises(ValueError, match="logits_processors: shuttle does not implement it"):
        SamplingParams(logits_processors=[print])
    with pytest.raises(ValueError, match="best_of: shuttle does not implement it"):
        SamplingParams(n=1, best_of=3)
    with pytest.raises(ValueError, match=re.escape("top_p must be in (0, 1]")):
        SamplingParams(top_p=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'use_beam_search'"):
        SamplingParams(use_beam_search=True)


def test_sampling_params_out_of_range_for_the_model(llm):
    with pytest.raises(ValueError, match=re.escape("stop_token_ids must be token ids in [0, 512)")):
        llm.generate("Once", SamplingParams(stop_token_ids=[600]), use_tqdm=False)
    with pytest.raises(ValueError, match=re.escape("logprobs must be in [0, 20]")):
        llm.generate("Once", SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate("Once", [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_prompt_logprobs_minus_one_is_the_whole_vocabulary_within_max_logprobs(llm):
    # 512 tokens are over the fixture's max_logprobs of 20: -1 is refused then, with the range that is taken
    message = "prompt_logprobs must be in [0, 20] (max_logprobs 20; -1, the whole vocabulary of 512 tokens, is over it)"
    for value in (-1, 21):
        with pytest.raises(ValueError, match=re.escape(f"{message}, got {value}")):
            llm.generate("Once", SamplingParams(max_tokens=1, prompt_logprobs=value), use_tqdm=False)
    with pytest.raises(ValueError, match=re.escape("prompt_logprobs must be -1 (the whole vocabulary) or in [0, ")):
        SamplingParams(prompt_logprobs=-2)
    for cap in (512, -1):  # -1: no cap (vLLM's), the vocabulary bounds it
        whole = LLM(str(MODEL_DIR), num_kv_blocks=16, device="cpu", max_logprobs=cap)
        (output,) = whole.generate("Once upon", SamplingParams(max_tokens=1, prompt_logprobs=-1), use_tqdm=False)
        assert len(output.prompt_logprobs) == len(output.prompt_token_ids) >= 2 and output.prompt_logprobs[0] is None
        assert all(len(position) == 512 for position in output.prompt_logprobs[1:])


@pytest.mark.parametrize("engine_args, error, message", [
    ({"max_model_lenght": 64}, TypeError, "unexpected keyword argument 'max_model_lenght'"),
    ({"tensor_parallel_size": 2}, ValueError, "tensor_parallel_size=2: the offline engine runs in this process"),
    ({"port": 8000}, ValueError, "port: an option of shuttle serve for the HTTP server, which the offline LLM does "
                                 "not have"),
    ({"ssl_keyfile": "k.pem"}, ValueError, "--ssl-keyfile: shuttle does not implement it"),
    ({"dtype": "float64"}, ValueError, "argument --dtype: invalid choice"),
    ({"max_num_seqs": 0}, ValueError, "argument --max-num-seqs"),
    ({"enable_prefix_caching": "yes"}, ValueError, "enable_prefix_caching must be True or False"),
])
def test_engine_args_refused_by_name(engine_args, error, message):
    with pytest.raises(error, match=message):
        LLM(str(MODEL_DIR), **engine_args)


def test_a_bad_model_path_is_one_clear_error(tmp_path):
    with pytest.raises(ModelDirError, match=str(tmp_path / "missing")):
        LLM(str(tmp_path / "missing"))


def test_engine_args_take_vllm_spellings():
    import torch

    assert LLM(str(MODEL_DIR), dtype=torch.bfloat16, num_kv_blocks=16, device="cpu").config.model.dtype == "bfloat16"
    llm = LLM(str(MODEL_DIR), dtype="float", max_model_len="128", enable_prefix_caching=False, num_kv_blocks=16,
              device="cpu", tensor_parallel_size=1, swap_space=4, disable_log_stats=True, seed=3)
    assert (llm.config.model.dtype, llm.config.model.max_model_len, llm.config.cache.enable_prefix_caching,
            llm.config.model.seed) == ("float32", 128, False, 3)


def test_the_docs_example_runs_as_written(monkeypatch, capsys):
    """docs/offline.md's example, exactly as the page shows it, from the repository root (its model path)."""
    page = (REPO / "docs" / "offline.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", page, re.S)
    monkeypatch.chdir(REPO)
    exec(compile(example, "docs/offline.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    # greedy, cut at the first ".": transformers' greedy continuations of the two prompts, up to it
    assert lines[:2] == ["Once upon a time -> , there was a little girl named Lily (stop)",
                         "The little dog ->  was a little girl named Lily (stop)"]
    samples = eval(lines[2])
    assert len(samples) == 3 and len(set(samples)) > 1
    assert lines[3] == "<s>Once upon a time  -> , there was a little girl named Lily"
    assert len(lines) == 4


def test_an_engine_refusal_raises_and_an_interrupted_call_leaves_the_llm_usable():
    small = LLM(str(MODEL_DIR), num_kv_blocks=4, device="cpu")  # 64 tokens of KV cache
    greedy = SamplingParams(temperature=0, max_tokens=5)
    expected = small.generate("Once", greedy, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"needs 105 tokens of KV cache; the whole cache holds 64"):
        small.generate([{"prompt_token_ids": [1] * 100}, "Once"], greedy, use_tqdm=False)

    class Interrupting:
        def __init__(self, **kwargs):
            pass

        def update(self, count):
            raise KeyboardInterrupt  # Ctrl-C while sequences are in flight

        def close(self):
            pass

    with pytest.raises(KeyboardInterrupt):
        small.generate(["Once", "Lily", "Tom"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=Interrupting)
    # nothing of the interrupted call runs on or holds a block
    assert not small._scheduler.has_work and small._scheduler.kv.pool.num_free == 4
    assert small.generate("Once", greedy, use_tqdm=False)[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("fields, words", [
    ({"logprobs": True}, "Expected `int | null`, got `bool` - at `$.logprobs`"),
    ({"prompt_logprobs": True}, "Expected `int | null`, got `bool` - at `$.prompt_logprobs`"),
    ({"max_tokens": 2.5}, "Expected `int | null`, got `float` - at `$.max_tokens`"),
    ({"n": True}, "Expected `int`, got `bool` - at `$.n`"),
    ({"ignore_eos": "yes"}, "Expected `bool`, got `str` - at `$.ignore_eos`"),
    ({"stop": [""]}, "stop must be a non-empty string or a list of at most 16 of them"),
    ({"stop": ["a"] * 17}, "stop must be a non-empty string or a list of at most 16 of them"),
])
def test_sampling_params_are_typed_as_the_servers_request_fields(fields, words):
    """A trial: logprobs=True reached the worker's topk mid-batch (a TypeError, the batch's other outputs lost);
    max_tokens=2.5 ran 3 tokens; stop=[""] ended every output at once."""
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(**fields)


def test_sampling_params_and_lora_request_of_another_kind_are_type_errors(llm):
    for bad in ({"max_tokens": 2}, "notsp", [SamplingParams(), {"max_tokens": 2}]):
        count = 2 if isinstance(bad, list) else 1
        with pytest.raises(TypeError, match="sampling_params must be"):
            llm.generate(["Once"] * count, bad, use_tqdm=False)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest or a list of them, not object"):
        llm.generate("Once", SamplingParams(max_tokens=1), use_tqdm=False, lora_request=object())
