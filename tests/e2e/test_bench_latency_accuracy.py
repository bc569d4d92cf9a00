"""``stencil bench latency`` (phases of one request) and ``stencil bench accuracy`` (field-level
scoring): the timeline and the scores on exact inputs, and both commands end to end on the tiny
model (report keys and invariants, never timing values)."""

from __future__ import annotations

import argparse
import json

import pytest

from stencil.benchmarks import accuracy, latency
from stencil.benchmarks.workload import PERSON_SHORT_SCHEMA, WorkItem, person_items


# -- latency: the timeline of one request -----------------------------------------------------------

def _events(t0: float = 100.0, token_ms: float = 50.5, compile_: bool = True) -> list[tuple[str, float, float]]:
    """A made-up request (seconds): arrival 100.010, template 100.012-100.014, compile
    100.015-100.040 (behind the prefill), added 100.016-100.017, a prefill chunk 100.018-100.028,
    an idle step while the grammar compiles, the step with the first token 100.041-100.051,
    then two decodes."""
    at = lambda ms: t0 + ms / 1e3  # noqa: E731
    return [("asgi_in", at(10), at(10)), ("tokenize", at(12), at(14)), ("grammar_spec", at(14), at(14.5)),
            *([("compile", at(15), at(40))] if compile_ else []), ("add_request", at(16), at(17)),
            ("step", at(18), at(28)), ("schedule", at(18), at(18.5)), ("forward", at(19), at(27)),
            ("step", at(30), at(30.2)),  # nothing to run: only a request waiting for its grammar
            ("step", at(41), at(51)), ("forward", at(42), at(50)), ("update", at(50), at(51)),
            ("detokenize", at(50.2), at(50.6)), ("first_token", at(token_ms), at(token_ms)),
            ("step", at(53), at(63)), ("forward", at(53), at(62)),
            ("step", at(65), at(75)), ("forward", at(65), at(74)),
            ("validate_output", at(78), at(79))]


def test_phases_cut_the_request_into_consecutive_spans_that_add_up():
    r = latency.phases(_events(), sent=100.0, received=100.090)
    ph = r["phases"]
    expected = {"http_in": 10, "validate": 2, "template_tokenize": 2, "params": 1, "admit": 2, "queue": 1,
                "prefill": 20, "grammar": 13, "decode": 20, "loop": 4, "deliver": 3, "validate_output": 1,
                "response": 11}
    assert set(ph) == set(latency.PHASES) and ph == pytest.approx(expected)
    assert sum(ph.values()) == pytest.approx(r["total_ms"]) == pytest.approx(90)
    assert r["num_steps"] == 4 and r["decode_step_ms_p50"] == pytest.approx(10)
    assert r["ttft_ms"] == pytest.approx(50.5) and r["compile_ms"] == pytest.approx(25)
    assert r["steps"] == pytest.approx({"schedule": 0.5, "grammar_mask": 0, "forward": 34, "update": 0.6,
                                        "detokenize": 0.4, "propose": 0})


def test_phases_of_an_unconstrained_request_have_no_grammar_time():
    r = latency.phases(_events(token_ms=27.5, compile_=False), sent=100.0, received=100.090)
    ph = r["phases"]
    assert ph["grammar"] == 0 and r["compile_ms"] == 0 and ph["params"] == pytest.approx(2)  # template -> add
    assert ph["prefill"] == pytest.approx(10) and ph["decode"] == pytest.approx(30)
    assert ph["loop"] == pytest.approx(13 + 2 + 2) and sum(ph.values()) == pytest.approx(90)


def test_probes_record_calls_and_put_everything_back():
    class Thing:
        def work(self, x):
            return x + 1

        async def later(self, x):
            return x * 2

    import asyncio

    thing, probes = Thing(), latency.Probes()
    probes.wrap(thing, "work", "w")
    probes.wrap(thing, "later", "l")
    assert thing.work(1) == 2 and asyncio.run(thing.later(3)) == 6
    assert [e[0] for e in probes.take()] == ["w", "l"] and probes.events == []
    probes.restore()
    assert "work" not in vars(thing) and "later" not in vars(thing)


def test_latency_command_times_both_variants_on_the_tiny_model(tiny_model_dir, tmp_path):
    p = argparse.ArgumentParser()
    latency.add_arguments(p)
    args = p.parse_args(["--json", str(tmp_path / "lat.json"), "--requests", "2", "--max-tokens", "24",
                         "--variants", "json_schema,json_schema_cold,none", "--prompt-tokens", "120",
                         "--serve-args", f"--model {tiny_model_dir} --num-kv-blocks 128 --speculative ngram"])
    assert latency.main(args) == 0
    report = json.loads(args.json.read_text())
    assert report["speculative"] == {"method": "ngram"}
    assert set(report["variants"]) == {"json_schema", "json_schema_cold", "none"}
    for v in report["variants"].values():
        assert len(v["requests"]) == 2 and len(v["texts"]) == 2
        for r in v["requests"]:
            assert sum(r["phases"].values()) == pytest.approx(r["total_ms"], rel=1e-6)
            assert all(x >= 0 for x in r["phases"].values()) and r["num_steps"] >= 1
            assert 0 < r["ttft_ms"] <= r["total_ms"] and r["phases"]["grammar"] >= 0
    v = report["variants"]
    assert v["json_schema"]["cold"]["compile_ms"] > 0
    assert all(r["compile_ms"] > 0 for r in v["json_schema_cold"]["requests"])
    assert all(r["compile_ms"] == r["phases"]["grammar"] == 0 for r in v["none"]["requests"])
    assert report["ttft_cold_over_warm"] > 0 and report["prompt_tokens"] == 120


# -- accuracy: scoring ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, doc", [
    ('{"a": 1}', {"a": 1}),
    ('JSON:\n```json\n{\n  "a": [1, {"b": 2}]\n}\n```\nThat is all.', {"a": [1, {"b": 2}]}),
    ('{broken {"a": "}"} {"z": 0}', {"a": "}"}),
    ("[1, 2] and no object", None),
    ("", None),
])
def test_first_json_object_reads_the_first_object_in_prose_or_a_fence(text, doc):
    assert accuracy.first_json_object(text) == doc


def test_field_matches_is_exact_by_type():
    assert accuracy.field_matches("Ada Lovelace", "Ada Lovelace")
    assert not accuracy.field_matches("ada lovelace", "Ada Lovelace") and not accuracy.field_matches(" Ada", "Ada")
    assert accuracy.field_matches(42.0, 42) and not accuracy.field_matches("42", 42)
    assert not accuracy.field_matches(True, 1) and not accuracy.field_matches(1, True)
    assert accuracy.field_matches(["a", 2], ["a", 2.0]) and not accuracy.field_matches(["a"], ["a", "b"])


def test_scores_count_fields_valid_and_exact_answers():
    item = WorkItem("person", "Ada is 36 and lives in London.", PERSON_SHORT_SCHEMA,
                    {"name": "Ada", "age": 36, "city": "London"}, instruction="x")
    texts = ['{"name": "Ada", "age": 36, "city": "London"}', '{"name": "Ada", "age": 37, "city": "London"}',
             '{"name": "Ada", "age": "36"}', 'Sure! {"name": "Ada", "age": 36, "city": "London"}']
    strict = accuracy.score([item] * 4, texts, parse_loose=False)
    assert [s["valid"] for s in strict] == [True, True, False, False]
    assert [sum(s["fields"].values()) for s in strict] == [3, 2, 1, 0]
    loose = accuracy.score([item] * 4, texts, parse_loose=True)
    assert loose[3] == {"parsed": True, "valid": True, "fields": {"name": True, "age": True, "city": True}}
    s = accuracy.summarize_scores([item] * 4, strict, [{"tokens": 10, "finish_reason": "stop"}] * 4)
    assert s["field_accuracy"] == pytest.approx(6 / 12) and s["exact_fraction"] == pytest.approx(1 / 4)
    assert s["valid_fraction"] == 0.5 and s["parsed_fraction"] == 0.75
    assert s["per_field"] == {"person.age": 0.25, "person.city": 0.5, "person.name": 0.75}


def test_person_items_plant_their_answer_in_the_sentence():
    for it in person_items(12, seed=5):
        assert set(it.answer) == {"name", "age", "city"} and it.schema is PERSON_SHORT_SCHEMA
        assert it.answer["name"].split()[0] in it.document and str(it.answer["age"]) in it.document
        assert it.answer["city"] in it.document
        assert [m["role"] for m in it.messages()] == ["system", "user"]
    assert person_items(3, seed=5)[0].document == person_items(3, seed=5)[0].document


def test_accuracy_command_reports_each_mode_on_the_tiny_model(tiny_model_dir, tmp_path):
    p = argparse.ArgumentParser()
    accuracy.add_arguments(p)
    args = p.parse_args(["--json", str(tmp_path / "acc.json"), "--items", "2", "--max-tokens", "64",
                         "--model", str(tiny_model_dir)])
    assert accuracy.main(args) == 0
    report = json.loads(args.json.read_text())
    assert set(report["stencil"]) == {"compact", "flexible", "unconstrained"}
    for mode, s in report["stencil"].items():
        assert s["items"] == 4 and set(s["by_workload"]) == {"person", "extraction"}
        assert 0 <= s["field_accuracy"] <= 1 and s["by_workload"]["person"]["items"] == 2
        if mode != "unconstrained":  # the grammar closes every answer within its budget
            assert s["valid_fraction"] == 1.0 and s["cut_at_max_tokens"] == 0
