"""Traces through real servers: one trace from a callback to its row, a batch's span with
one child per chunk (the SDK's in-memory exporter behind nopoll's tracer)."""

from __future__ import annotations

from receiver.queue.enqueue import FETCH_BATCH, FETCH_RESPONSE
from tests.e2e.helpers import jsonl_rows, post, wait_for
from tests.servers import running_api, running_worker
from tests.traces import in_memory_traces, named


async def test_one_trace_from_the_callback_to_the_row(
    make_settings, provider_sim, redis_url, signed_callback, tmp_path
):
    sim = provider_sim(api_key="sk-test-not-a-real-key")
    sim.add_response("resp_traced", text="hello")
    settings = make_settings(sim.base_url, redis_url=redis_url)
    with in_memory_traces() as spans:
        async with (
            running_api(settings, redis_url) as (base, _),
            running_worker(settings, redis_url),
        ):
            assert (await post(base, *signed_callback("resp_traced"))).status_code == 202

            async def finished():
                return named(spans, FETCH_RESPONSE)

            [job] = await wait_for(finished)
        assert [r["key"] for r in jsonl_rows(tmp_path / "results")] == ["resp_traced"]
        [webhook] = named(spans, "webhook")
        [get] = named(spans, "GET")
        [write] = named(spans, "write files")

    trace_id = webhook.context.trace_id
    assert {s.context.trace_id for s in (webhook, job, get, write)} == {trace_id}
    assert webhook.parent is None  # the callback starts the trace
    assert job.parent is not None and job.parent.span_id == webhook.context.span_id
    assert get.parent is not None and get.parent.span_id == job.context.span_id
    assert write.parent is not None and write.parent.span_id == job.context.span_id
    assert webhook.attributes["http.response.status_code"] == 202
    assert get.attributes["http.response.status_code"] == 200
    assert get.attributes["url.path"] == "responses/resp_traced"
    assert write.attributes["nopoll.rows"] == 1


async def test_a_batch_is_a_span_with_a_child_per_chunk(
    make_settings, provider_sim, redis_url, signed_callback, tmp_path
):
    sim = provider_sim(api_key="sk-test-not-a-real-key")
    batch = sim.add_batch("openai", "batch_traced", 250)
    settings = make_settings(sim.base_url, redis_url=redis_url, batch={"chunk_size": 100})
    with in_memory_traces() as spans:
        async with (
            running_api(settings, redis_url) as (base, _),
            running_worker(settings, redis_url),
        ):
            callback = signed_callback(batch.batch_id, event_type="batch.completed")
            assert (await post(base, *callback)).status_code == 202

            async def finished():
                return named(spans, FETCH_BATCH)

            [job] = await wait_for(finished, timeout=60)
        [webhook] = named(spans, "webhook")
        [run] = named(spans, "batch")
        chunks = named(spans, "batch chunk")
        ids = {c.context.span_id for c in chunks}
        writes = [s for s in named(spans, "write files") if s.parent and s.parent.span_id in ids]
    assert len([r for r in jsonl_rows(tmp_path / "results") if r["kind"] == "batch_row"]) == 250

    assert {s.context.trace_id for s in (webhook, job, run, *chunks)} == {webhook.context.trace_id}
    assert job.parent is not None and job.parent.span_id == webhook.context.span_id
    assert run.parent is not None and run.parent.span_id == job.context.span_id
    assert sorted(c.attributes["nopoll.chunk"] for c in chunks) == [0, 1, 2]
    assert all(c.parent is not None and c.parent.span_id == run.context.span_id for c in chunks)
    assert all(c.attributes["nopoll.sink"] == "files" for c in chunks)
    assert sorted(w.attributes["nopoll.rows"] for w in writes) == [50, 100, 100]
