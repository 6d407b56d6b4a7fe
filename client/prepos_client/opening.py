"""Opening: what the next request of a session must carry to open its Triton sequence, and what the server said of
the last request that tried."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PreposError


@dataclass
class Opening:
    """The opening state of one session.

    The next request carries START while ``needs_start``, with the ``resume`` input while ``resume``. Each
    transition below is one outcome, named for it, so that the session's sending and settling code reads which
    outcome it records rather than which flags it sets.
    """

    resume: bool
    """Until a request has opened the session, START goes with ``resume`` (a session opened elsewhere, or before)."""
    needs_start: bool = True
    unknown: bool = False
    """An opening request's answer was lost with its stream: it may have opened the session, or not."""
    reopening: bool = False
    """The server said it does not hold the session: START and ``resume`` reopen it from its journal."""
    held_elsewhere: bool = False
    """The opening was refused as already open: the sequence is another client's."""
    cut: bool = False
    """The opening was cancelled before its answer came (:meth:`cancelled`)."""
    confirmed: bool = False
    """A request that opened (or reopened) the session was answered: the server held it for this client (it may
    have ended it since, a drain keeping its journal)."""

    def nothing_to_end(self, num_requests: int) -> bool:
        """Whether no sequence of this client's is open: nothing was sent on a session that is not resumed, or the
        opening was refused as held by another client (an END with START would end that client's sequence)."""
        return self.needs_start and (self.held_elsewhere or (num_requests == 0 and not self.resume))

    def sent(self) -> None:
        """A request was queued: the ones after it go without START (its outcome may restore it)."""
        self.needs_start = False

    def opened(self) -> None:
        """A request that carried START was answered: the session is open here."""
        self.resume = self.unknown = self.reopening = self.held_elsewhere = self.cut = False
        self.confirmed = True

    def reopen(self) -> None:
        """The server does not hold the session: the next request carries START and ``resume``."""
        self.needs_start = self.resume = self.reopening = True

    def send_again(self, opened_the_session: bool) -> None:
        """A refused request goes again on a new stream: with START, and with ``resume`` unless it was the opening
        itself (the server may have lost the session's sequence)."""
        if not opened_the_session:
            self.resume = self.reopening = True
        self.needs_start = True

    def cancelled(self) -> None:
        """The opening was cancelled before its answer came: the server may have opened the session or not (and
        closes again one whose log it left empty). The next request carries START, with ``resume`` as before; an
        "already open" refusal then means the opening did open it. An END goes without START (``cut``): the
        sequence the opening began may still be running on the server, and a START next to it would be refused
        as already open; an END alone reaches it either way."""
        self.needs_start = self.unknown = self.cut = True

    def stream_lost(self) -> None:
        """The session's stream ended: an open session is resumed on the next one (the server still holds it or
        reopens it from its journal)."""
        if not self.needs_start:
            self.needs_start = self.resume = True

    def refused(self, error: PreposError) -> PreposError | None:
        """A request that carried START was refused (or its stream lost, ``error.status`` set): the next one
        carries START again, unless this START met the session opened by an earlier opening whose answer was lost.
        Returns the error to raise in place of ``error``, if another."""
        self.needs_start = True
        replaced = None
        already_open = error.field == "START" and "already open" in error.message
        if self.unknown and already_open:
            # The opening whose answer was lost had opened the session after all: this START changed nothing, and
            # the next request goes on without one.
            self.needs_start = False
            self.confirmed = True
            replaced = error.reworded(f"{error.message}: the request that was to open it, whose answer was lost "
                                      "with its stream, had opened it; the next call continues the session")
        else:
            self.held_elsewhere = already_open
        self.unknown = error.status is not None  # a lost stream tells nothing of the opening
        return replaced
