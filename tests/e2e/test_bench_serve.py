"""``stencil bench serve`` against a live Stencil on the tiny model: the report's keys and values,
two servers with their ratio, and the refusal of addresses that are not loopback."""

from __future__ import annotations

import argparse
import json

import pytest

from stencil.benchmarks import serve
from service_live import tiny_live_server


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with tiny_live_server(tiny_model_dir, num_kv_blocks=256) as live:
        yield live


def _args(tmp_path, urls, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    argv = [x for u in urls for x in ("--base-url", u)] + ["--json", str(tmp_path / "serve.json"),
                                                           "--requests", "4", "--concurrency", "1,2",
                                                           "--max-tokens", "48"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


def test_reports_the_throughput_keys_for_two_servers(server, tmp_path):
    args = _args(tmp_path, [server.url, server.url + "/v1"])
    assert serve.main(args) == 0
    report = json.loads(args.json.read_text())
    assert report["models"] == ["tiny", "tiny"] and [r["concurrency"] for r in report["throughput"]] == [1, 2]
    for row in report["throughput"]:
        assert set(row["results"]) == {server.url, server.url + "/v1"} and row["ratio_output_tokens_per_s"] > 0
        assert row["ratio_requests_per_s"] > 0
        for s in row["results"].values():
            assert {"output_tokens_per_s", "requests_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50",
                    "itl_ms_p99", "valid_fraction", "errors", "latency_ms_p50", "latency_ms_p99"} <= set(s)
            assert s["latency_ms_p99"] >= s["latency_ms_p50"] >= s["ttft_ms_p50"] > 0
            assert s["requests"] == 4 and s["errors"] == 0
            # a random model is often cut at max_tokens, but a finished answer is always valid
            assert 0 < s["output_tokens"] <= 4 * 48 and s["output_tokens_per_s"] > 0
            assert s["ttft_ms_p50"] > 0 and s["itl_ms_p50"] >= 0
    assert args.json.with_suffix(".png").stat().st_size > 0


def test_person_workload_sends_the_short_name_age_city_chats(server, tmp_path):
    args = _args(tmp_path, [server.url], workload="person", concurrency="2")
    assert serve.main(args) == 0
    report = json.loads(args.json.read_text())
    assert report["workload"] == "stencil.benchmarks.workload.person_items(seed=1)"
    jobs, _ = serve.workload_jobs("person", 4)
    assert [set(j.schema["properties"]) for j in jobs] == [{"name", "age", "city"}] * 4
    assert all(j.messages[0]["role"] == "system" and len(j.messages) == 2 for j in jobs)
    assert report["throughput"][0]["results"][server.url]["errors"] == 0


def test_counts_each_token_of_a_chunk(server):
    job = serve.Job([{"role": "user", "content": "hi"}], {"type": "object", "properties": {
        "a": {"enum": ["xxxxxxxxxxxx yyyyyyyyyy zzzzzzzzzz"]}}, "required": ["a"]})
    import asyncio

    async def go():
        import httpx

        async with httpx.AsyncClient(timeout=60) as http:
            return await serve.one_request(http, serve.v1_root(server.url), serve.request_body(job, "tiny", 40))

    trace, usage, err = asyncio.run(go())
    assert err is None and json.loads(trace.text) == {"a": "xxxxxxxxxxxx yyyyyyyyyy zzzzzzzzzz"}
    # the grammar forces the whole answer: tokens arrive several per chunk, and all are counted
    assert len(trace.token_ids) == usage and len(set(trace.token_times)) < usage


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://example.com", "ftp://127.0.0.1:21"])
def test_refuses_addresses_that_are_not_loopback(tmp_path, url, capsys):
    assert serve.main(_args(tmp_path, [url])) == 2
    assert "loopback" in capsys.readouterr().out
    for ok in ("http://127.0.0.1:9", "http://localhost:9/v1", "http://[::1]:9"):
        assert serve.v1_root(ok).endswith("/v1")


def test_completions_api_sends_text_prompts_and_scores_fields(server, tmp_path):
    args = _args(tmp_path, [server.url], workload="person", concurrency="2", api="completions")
    assert serve.main(args) == 0
    report = json.loads(args.json.read_text())
    assert report["api"] == "completions" and report["llama_cpp"] == [False]
    s = report["throughput"][0]["results"][server.url]
    assert s["errors"] == 0 and s["requests"] == 4 and s["output_tokens"] > 0
    # a random model gets names wrong, but the score is a fraction of the 12 known fields
    assert s["field_accuracy"] is not None and 0 <= s["field_accuracy"] * 12 <= 12
    assert float(s["field_accuracy"] * 12).is_integer()


def test_request_bodies_per_dialect():
    job = serve.workload_jobs("person", 1)[0][0]
    assert job.prompt.endswith("JSON:") and job.messages[1]["content"] in job.prompt
    chat = serve.request_body(job, "m", 8)
    assert chat["messages"] == job.messages and chat["response_format"]["json_schema"]["schema"] == job.schema
    oai = serve.request_body(job, "m", 8, dialect=serve.Dialect("completions"))
    assert oai["prompt"] == job.prompt and "messages" not in oai and "json_schema" not in oai
    assert oai["response_format"]["json_schema"]["schema"] == job.schema and "logprobs" not in oai
    llama = serve.request_body(job, "m", 8, dialect=serve.Dialect("completions", llama_cpp=True))
    assert llama["json_schema"] == job.schema and "response_format" not in llama
    tagged = serve.tagged(job, "[run c=8]")
    assert tagged.prompt == "[run c=8] " + job.prompt and tagged.answer == job.answer


def test_field_accuracy_counts_fields_of_parsed_answers():
    from stencil.benchmarks.common import Trace

    jobs = [serve.Job([], {}, {"name": "Ana Ruiz", "age": 30}), serve.Job([], {}, {"name": "Bo", "age": 41}),
            serve.Job([], {}, None)]
    traces = [Trace(submit=0.0), Trace(submit=0.0), Trace(submit=0.0)]
    traces[0].text = '{"name": "Ana Ruiz", "age": 30.0}'
    traces[1].text = '{"name": "Bo", "age": "41"'  # cut short: no fields
    traces[2].text = '{}'
    assert serve.field_accuracy(jobs, traces) == 2 / 4
    assert serve.field_accuracy(jobs[2:], traces[2:]) is None


def test_dialect_of_a_server_without_props_is_openai(server):
    assert serve.server_dialect(serve.v1_root(server.url), "completions", "none") == serve.Dialect("completions")
