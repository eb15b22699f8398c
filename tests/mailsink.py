"""A real SMTP server on 127.0.0.1 for the notification tests (aiosmtpd): it accepts every
mail, without TLS or auth, and keeps each as a parsed ``email.message.Message``.

Started by a test or fixture and stopped at its end (``close``).
"""

from __future__ import annotations

import email
import email.message
import email.policy
import threading
from typing import Any, List

from tests.httpsink import closed_port


class MailSink:
    def __init__(self) -> None:
        from aiosmtpd.controller import Controller  # a dev dependency, asked for by the tests

        self.mails: List[email.message.EmailMessage] = []
        self.envelopes: List[Any] = []
        self.lock = threading.Lock()
        sink = self

        class Handler:
            async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
                msg = email.message_from_bytes(envelope.content, policy=email.policy.default)
                with sink.lock:
                    sink.mails.append(msg)
                    sink.envelopes.append(envelope)
                return "250 OK"

        # aiosmtpd's Controller checks the port it was given by connecting to it: port 0
        # cannot be checked, so a free port is taken first.
        self.port = closed_port()
        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port)
        self.controller.start()

    def received(self) -> List[email.message.EmailMessage]:
        with self.lock:
            return list(self.mails)

    def close(self) -> None:
        self.controller.stop()
