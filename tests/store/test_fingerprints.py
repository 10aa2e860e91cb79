"""A batch lists the distinct system_fingerprints of its responses as they are written: sorted, each once, several
where differently configured workers answered; error results add none."""

from __future__ import annotations

from store_test_utils import chat, failed, ok, submit
from test_leases import claim, write
from test_views import view


def answered(request_id: int, fingerprint: str):
    result = ok(request_id)
    result.response["system_fingerprint"] = fingerprint
    return result


def test_the_batch_lists_its_responses_distinct_fingerprints(sessions):
    batch, work = submit(sessions, [chat("a"), chat("b"), chat("c"), chat("d"), chat("e")])
    a, b, c, d, e = work.request_ids
    assert view(sessions, batch.id)["system_fingerprints"] == []
    claim(sessions, [a, b], "w1")
    write(sessions, [answered(a, "fp_bbbbbbbbbbbb"), answered(b, "fp_bbbbbbbbbbbb")], "w1")
    assert view(sessions, batch.id)["system_fingerprints"] == ["fp_bbbbbbbbbbbb"]
    claim(sessions, [c, d, e], "w2")
    write(sessions, [answered(c, "fp_aaaaaaaaaaaa"), answered(d, "fp_bbbbbbbbbbbb"), failed(e, 5)], "w2")
    write(sessions, [answered(c, "fp_cccccccccccc")], "w2")  # written again: ignored, as its result is
    done = view(sessions, batch.id)
    assert done["status"] == "completed"
    assert done["system_fingerprints"] == ["fp_aaaaaaaaaaaa", "fp_bbbbbbbbbbbb"]
