"""The one signature record format (collectives/_signature.py) and the nccl abort notice."""

from __future__ import annotations

import numpy as np
import pytest

from collectives import ReduceOp
from collectives._signature import (
    SIG_BYTES,
    SIG_MAGIC,
    Signature,
    describe_record,
    mismatch_text,
    record,
    record_bytes,
    record_nbytes,
    same_p2p_call,
    template,
)
from collectives.backends.nccl._peers import AbortNotice

F32 = np.dtype(np.float32)


def test_a_record_holds_the_call_word_by_word() -> None:
    sig = Signature("reduce", F32, (4, 5), 2, ReduceOp.MAX)
    rec = record(sig, 9)
    assert rec.dtype == np.int64 and rec.nbytes == SIG_BYTES
    assert rec[0] == 9 and rec[4] == 2 and rec[5] == 2 and list(rec[6:8]) == [4, 5]
    assert rec[15] == SIG_MAGIC
    assert record_bytes(sig, 9) == rec.tobytes()  # the two encodings are one format
    assert not template(sig).flags.writeable and template(sig)[0] == 0
    assert record_nbytes(rec) == 4 * 5 * 4
    assert describe_record(rec) == "reduce #9(dtype=float32, shape=(4, 5), root=2, op=MAX)"
    assert describe_record(rec.tobytes()) == describe_record(rec)


def test_deep_shapes_differ_by_their_checksum() -> None:
    a = record(Signature("all_reduce", F32, (1,) * 9 + (2,)), 1)
    b = record(Signature("all_reduce", F32, (1,) * 9 + (3,)), 1)
    assert a.tobytes() != b.tobytes() and record_nbytes(a) == -1


def test_mismatch_text_groups_ranks_by_call() -> None:
    same = np.stack([record(Signature("all_reduce", F32, (8,), -1, ReduceOp.SUM), 3)] * 3)
    assert mismatch_text(same, (0, 1, 2)) is None
    other = record(Signature("broadcast", F32, (8,), 0), 3)
    text = mismatch_text(np.stack([same[0], other, same[0]]), (4, 5, 6))
    assert text == (
        "ranks [4, 6] called all_reduce #3(dtype=float32, shape=(8,), op=SUM); "
        "ranks [5] called broadcast #3(dtype=float32, shape=(8,), root=0)"
    )


def test_a_send_matches_its_receive_but_not_another_message() -> None:
    sent = record(Signature("send", F32, (3,), 1), 2)
    assert same_p2p_call(sent, record(Signature("recv", F32, (3,), 0), 2))
    assert not same_p2p_call(sent, record(Signature("recv", F32, (4,), 0), 2))
    assert not same_p2p_call(sent, record(Signature("recv", F32, (3,), 0), 3))


@pytest.mark.parametrize("kind", ["timeout", "mismatch", "failed"])
def test_abort_notice_round_trip(kind: str) -> None:
    notice = AbortNotice(kind, 3, "all_reduce #2: it | went wrong")
    back = AbortNotice.decode(notice.encode())
    assert back == notice
    verb = "timed out" if kind == "timeout" else "failed"
    assert back.describe() == f"rank 3 {verb}: all_reduce #2: it | went wrong"


@pytest.mark.parametrize(
    "raw",
    [b"timeout|1|old format", b"\xff\xfe", b'{"kind": "exploded", "rank": 1, "message": "m"}',
     b'{"kind": "timeout", "rank": "1", "message": "m"}', b"[1, 2]"],
)  # fmt: skip
def test_a_malformed_abort_notice_is_still_a_failure(raw: bytes) -> None:
    notice = AbortNotice.decode(raw)
    assert notice.kind == "failed" and notice.rank == -1
    assert notice.describe().startswith("a rank failed: ")
