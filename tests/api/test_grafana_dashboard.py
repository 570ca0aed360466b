"""Issue 28: docs/grafana/shuttle.json names only series a live /metrics has, each carrying model_name, and the
per-request series vLLM's dashboards read count one known request exactly."""

import json
import re
from pathlib import Path

import aiohttp

from tests.client import post_completion

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "shuttle.json"

# PromQL words that are not series: functions (also caught by the "(" after them), aggregations, modifiers
PROMQL_WORDS = {"sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile", "by",
                "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless",
                "le", "topk", "bottomk", "quantile", "label_values", "clamp_min", "clamp_max", "abs", "vector"}
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def series_names(expr: str) -> set[str]:
    """The series an expression selects: identifiers left once strings, label matchers, ranges and by/without
    groupings are out, minus function names (followed by "(") and PromQL's own words."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "{}", expr)
    expr = re.sub(r"\[[^\]]*\]", "[]", expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in IDENTIFIER.finditer(expr):
        word, rest = match.group(), expr[match.end():].lstrip()
        if word in PROMQL_WORDS or rest.startswith("(") or re.fullmatch(r"[0-9.e]+", word):
            continue
        names.add(word)
    return names


def test_series_names_tokenizer():
    expr = ('histogram_quantile(0.9, sum by (le) (rate(shuttle:e2e_request_latency_seconds_bucket'
            '{model_name="$model_name", le!="x{y}"}[$__rate_interval]))) / shuttle:kv_cache_usage_perc')
    assert series_names(expr) == {"shuttle:e2e_request_latency_seconds_bucket", "shuttle:kv_cache_usage_perc"}


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_dashboard_shape():
    """Each panel has a unique id and queries the templated data source; each selector filters by the
    $model_name variable, whose own query names a real series."""
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert "model_name" in variables["model_name"]["definition"]
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
    for expr in dashboard_exprs():
        for selector in re.findall(r"shuttle:[A-Za-z0-9_:]*(\{[^}]*\})?", expr):
            assert selector and 'model_name="$model_name"' in selector, expr


def scrape(text: str) -> tuple[dict[str, str], dict[str, list[tuple[dict[str, str], float]]]]:
    """(family -> type, sample name -> [(labels, value)]) of a Prometheus text exposition."""
    types, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            name, _, labels = head.partition("{")
            samples.setdefault(name, []).append((dict(re.findall(r'([A-Za-z_]\w*)="((?:[^"\\]|\\.)*)"', labels)),
                                                 float(value)))
    return types, samples


async def get_metrics(session: aiohttp.ClientSession, url: str):
    async with session.get(f"{url}/metrics") as response:
        assert response.status == 200
        return scrape(await response.text())


def value(samples, name: str, model_name: str, **labels) -> float:
    return sum(v for got, v in samples.get(name, []) if got.get("model_name") == model_name
               and all(got.get(k) == want for k, want in labels.items()))


async def test_dashboard_series_exist_with_model_name(server):
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/v1/models") as response:
            model_name = (await response.json())["data"][0]["id"]
        _, before = await get_metrics(session, server.url)
        prompt = [1, 403, 500]
        status, body = await post_completion(session, server.url, prompt=prompt, max_tokens=5, n=1, ignore_eos=True,
                                             temperature=0)
        assert status == 200 and body["usage"]["completion_tokens"] == 5
        types, after = await get_metrics(session, server.url)

    names = set().union(*(series_names(expr) for expr in dashboard_exprs()))
    assert {"shuttle:time_to_first_token_seconds_bucket", "shuttle:prefix_cache_hits_total"} <= names
    for name in sorted(names):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        family = base if types.get(base) == "histogram" else name
        assert family in types, f"{name}: no such series on /metrics"
        assert after.get(name), f"{name}: no samples"
        assert all(labels.get("model_name") == model_name for labels, _ in after[name]), name
    # every shuttle: series carries the label, not only the dashboard's
    assert all(labels.get("model_name") == model_name for name, rows in after.items() if name.startswith("shuttle:")
               for labels, _ in rows)

    def delta(name: str, **labels) -> float:
        return value(after, name, model_name, **labels) - value(before, name, model_name, **labels)

    assert delta("shuttle:request_params_max_tokens_count") == 1
    assert delta("shuttle:request_params_max_tokens_sum") == 5
    assert delta("shuttle:request_params_n_count") == 1 and delta("shuttle:request_params_n_sum") == 1
    assert delta("shuttle:request_generation_tokens_count") == 1
    assert delta("shuttle:request_generation_tokens_sum") == 5
    assert delta("shuttle:request_generation_tokens_bucket", le="5.0") == 1
    assert delta("shuttle:request_generation_tokens_bucket", le="2.0") == 0
    assert delta("shuttle:request_prompt_tokens_sum") == len(prompt)
    assert delta("shuttle:request_prompt_tokens_bucket", le="5.0") == 1
    assert delta("shuttle:request_inference_time_seconds_count") == 1
    assert delta("shuttle:e2e_request_latency_seconds_count") == 1
    cache_info = [labels for labels, v in after["shuttle:cache_config_info"] if v == 1.0]
    assert len(cache_info) == 1 and int(cache_info[0]["num_gpu_blocks"]) > 0
    assert cache_info[0]["block_size"] == "16" and cache_info[0]["model_name"] == model_name
    assert "process_cpu_seconds_total" in after and "python_gc_collections_total" in after
