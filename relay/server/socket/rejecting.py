"""WebSocket paths nobody serves: refused at the handshake (HTTP 403)."""

from typing import Any

from channels.generic.websocket import AsyncWebsocketConsumer


class RejectingConsumer(AsyncWebsocketConsumer):
    async def websocket_connect(self, message: dict[str, Any]) -> None:
        await self.close()
