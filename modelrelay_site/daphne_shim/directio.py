"""Twisted's socket I/O at asyncio's cost.

A write to a TCP connection with nothing buffered goes to the socket at the end of the
loop turn, as asyncio's transports do; Twisted would buffer it, register the socket for
writability, send on the next loop iteration and unregister it again: two
``epoll_ctl`` calls and a loop turn for every streamed chunk. Whatever the socket does
not take is buffered the usual way (and a broken connection is left for Twisted's own
write path to report). And readiness callbacks call the reactor directly, without
Twisted's legacy log context around each one (a dictionary copy and a context push per
event), which nothing here reads; a failure is still logged.
"""

from __future__ import annotations

import errno
from typing import Any

from modelrelay_site.daphne_shim.probe import Patch


def apply() -> None:
    from twisted.internet import abstract, asyncioreactor, tcp

    descriptor: Any = abstract.FileDescriptor
    buffered_write = descriptor.write
    buffered_sequence = descriptor.writeSequence
    connection: Any = tcp.Connection

    def flush(self: Any) -> None:
        """End of the loop turn in which ``self`` was first written to: send."""
        self._relay_flush_due = False
        if not self.connected or self.reactor._writers.get(self) is not None:
            return  # gone, or its buffer went the usual way meanwhile
        parts = self._tempDataBuffer
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self._tempDataBuffer = []
        self._tempDataLen = 0
        sent = self.writeSomeData(data)
        if type(sent) is not int:  # the connection is lost
            self.dataBuffer, self.offset = data, 0
            self.reactor._disconnectSelectable(self, sent, False)
        elif sent < len(data):  # the socket took part of it: the rest when writable
            self.dataBuffer, self.offset = data, sent
            self.startWriting()
        elif self.producer is not None and (not self.streamingProducer or self.producerPaused):
            self.producerPaused = False  # as doWrite does once the buffer is empty
            self.producer.resumeProducing()

    def fast_write(self: Any, data: bytes) -> bool:
        """Queue ``data`` to be sent at the end of this loop turn, without waiting for
        writability; False when the usual path must take it (not a TCP connection,
        closing, or data still waiting for the socket to drain)."""
        if (
            not isinstance(self, connection)
            or not self.connected
            or self.disconnecting
            or self._writeDisconnected
            or self._writeDisconnecting
        ):
            return False
        if not self._relay_flush_due:
            if self._tempDataLen or self.offset < len(self.dataBuffer):
                return False  # already waiting for the socket to drain
            self._relay_flush_due = True
            self.reactor._asyncioEventloop.call_soon(flush, self)
        self._tempDataBuffer.append(data)
        self._tempDataLen += len(data)
        self._maybePauseProducer()
        return True

    def write(self: Any, data: bytes) -> None:
        if not (type(data) is bytes and data and fast_write(self, data)):
            buffered_write(self, data)

    def write_sequence(self: Any, iovec: Any) -> None:
        try:
            data = b"".join(iovec)
        except TypeError:  # not all bytes: Twisted's own path says what is wrong
            buffered_sequence(self, iovec)
            return
        write(self, data)

    descriptor._relay_flush_due = False
    descriptor.write = write
    descriptor.writeSequence = write_sequence

    reactor_class: Any = asyncioreactor.AsyncioSelectorReactor

    def on_ready(self: Any, selectable: Any, read: bool) -> None:
        try:
            self._readOrWrite(selectable, read)
        except Exception:
            self._log.failure("I/O callback of {selectable!r} failed", selectable=selectable)

    def add_reader(self: Any, reader: Any) -> None:
        if reader in self._readers or reader in self._continuousPolling._readers:
            return
        fd = reader.fileno()
        try:
            self._asyncioEventloop.add_reader(fd, on_ready, self, reader, True)
            self._readers[reader] = fd
        except OSError as exc:
            self._unregisterFDInAsyncio(fd)
            if exc.errno != errno.EPERM:
                raise
            self._continuousPolling.addReader(reader)  # epoll refuses regular files

    def add_writer(self: Any, writer: Any) -> None:
        if writer in self._writers or writer in self._continuousPolling._writers:
            return
        fd = writer.fileno()
        try:
            self._asyncioEventloop.add_writer(fd, on_ready, self, writer, False)
            self._writers[writer] = fd
        except PermissionError:
            self._unregisterFDInAsyncio(fd)
            self._continuousPolling.addWriter(writer)
        except BrokenPipeError:
            self._unregisterFDInAsyncio(fd)
        except BaseException:
            self._unregisterFDInAsyncio(fd)
            raise

    reactor_class.addReader = add_reader
    reactor_class.addWriter = add_writer


PATCH = Patch(
    "direct socket I/O",
    ("twisted",),
    (
        "twisted.internet.abstract:FileDescriptor.write",
        "twisted.internet.abstract:FileDescriptor.writeSequence",
        "twisted.internet.abstract:FileDescriptor._tempDataBuffer",
        "twisted.internet.abstract:FileDescriptor._tempDataLen",
        "twisted.internet.abstract:FileDescriptor.dataBuffer",
        "twisted.internet.abstract:FileDescriptor.offset",
        "twisted.internet.abstract:FileDescriptor._maybePauseProducer",
        "twisted.internet.abstract:FileDescriptor.startWriting",
        "twisted.internet.tcp:Connection.writeSomeData",
        "twisted.internet.tcp:Connection._writeDisconnected",
        "twisted.internet.tcp:Connection._writeDisconnecting",
        "twisted.internet.asyncioreactor:AsyncioSelectorReactor.addReader",
        "twisted.internet.asyncioreactor:AsyncioSelectorReactor.addWriter",
        "twisted.internet.asyncioreactor:AsyncioSelectorReactor._readOrWrite",
        "twisted.internet.asyncioreactor:AsyncioSelectorReactor._readers",
        "twisted.internet.asyncioreactor:AsyncioSelectorReactor._writers",
        "twisted.internet.asyncioreactor:AsyncioSelectorReactor._continuousPolling",
        "twisted.internet.asyncioreactor:AsyncioSelectorReactor._asyncioEventloop",
        "twisted.internet.asyncioreactor:AsyncioSelectorReactor._unregisterFDInAsyncio",
        "twisted.internet.asyncioreactor:AsyncioSelectorReactor._disconnectSelectable",
    ),
    apply,
)
