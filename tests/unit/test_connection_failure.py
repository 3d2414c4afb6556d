"""Telling a service's own UNAVAILABLE from a failed connection to it (gateway and coordinator
resubmit/wait only for the latter)."""

from __future__ import annotations

import grpc

from splitserve.errors import ANSWERED_KEY, connection_failure


class FakeError:
    def __init__(self, details: str, trailing=()):
        self._details, self._trailing = details, trailing

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


class FakeChannel:
    def __init__(self, state):
        self.state = state

    def get_state(self, try_to_connect=False):
        return self.state


READY, DOWN = FakeChannel(grpc.ChannelConnectivity.READY), FakeChannel(grpc.ChannelConnectivity.TRANSIENT_FAILURE)


def test_an_answer_quoting_a_connection_error_further_down_is_an_answer():
    quoted = FakeError("request could not be placed after 8 attempts: failed to connect to all addresses",
                       ((ANSWERED_KEY, "1"),))
    assert not connection_failure(quoted, READY) and not connection_failure(quoted, DOWN)


def test_a_failed_connection_is_one_by_its_text_or_the_channel_state():
    assert connection_failure(FakeError("Socket closed"), READY)
    assert connection_failure(FakeError("failed to connect to all addresses; connection refused"), READY)
    assert connection_failure(FakeError("something else"), DOWN)
    assert not connection_failure(FakeError("no eligible worker"), READY)
