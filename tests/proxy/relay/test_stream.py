from proxy.errors import UpstreamError
from proxy.relay.stream_accounting import StreamTally, body_usage

ROLE = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'


def token(i: int) -> bytes:
    return b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i


USAGE = (b'data: {"choices":[],"usage":{"prompt_tokens":12,"total_tokens":17,'
         b'"completion_tokens":5}}\n\n')
DONE = b"data: [DONE]\n\n"


def tally_of(*chunks: bytes) -> StreamTally:
    tally = StreamTally(0.0)
    for chunk in chunks:
        tally.add(chunk, 0.0)
    return tally


def test_usage_read_from_tail_even_when_split() -> None:
    tally = tally_of(ROLE + token(0))
    for i in range(1, 5):
        tally.add(token(i), float(i))
    tally.add(USAGE[:40], 5.0)
    tally.add(USAGE[40:] + DONE[:6], 5.0)
    tally.add(DONE[6:], 5.0)
    assert tally.saw_done
    assert tally.usage(chat=True) == (12, 5)
    assert tally.tpot(5) == 5.0 / 4


def test_estimate_without_usage_and_missing_done() -> None:
    tally = tally_of(ROLE)
    for i in range(10):
        tally.add(token(i), 1.0)
    assert not tally.saw_done
    tally.add(b'data: {"choices":[{"delta":{"content":"t"},"finish_reason":"length"}]}\n\n'
              + DONE, 2.0)
    assert tally.saw_done
    assert tally.usage(chat=True) == (None, 11)
    assert tally_of(token(0) + token(1) + DONE).usage(chat=False) == (None, 2)


def test_error_event_is_an_event_and_the_end() -> None:
    """(The relay sends whole events only, so it follows one: tests/proxy/
    test_fuzz_upstream.py, a stream cut inside an event.)"""
    event = tally_of(b'data: {"choi').error_event(UpstreamError("gone"))
    assert event.startswith(b'data: {"error"') and event.endswith(b"data: [DONE]\n\n")


def test_body_usage() -> None:
    assert body_usage(b'{"usage":{"prompt_tokens":3,"completion_tokens":4}}') == (3, 4)
    assert body_usage(b"not json") == (None, 0)
    assert body_usage(b"[]") == (None, 0)
