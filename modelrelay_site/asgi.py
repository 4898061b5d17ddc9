"""ASGI entry point: ``daphne modelrelay_site.asgi:application``.

HTTP: the relay's hot-path routes are answered by :class:`relay.server.http.RelayHttpApp`
before Django is involved (with the old client API, ``/api/chat``); everything else
goes to Django.
WebSocket: ``/v1/worker/connect`` is the worker endpoint; ``/ws`` and
``/v1/worker/legacy`` take nodes of the older broker. They are deliberately not
wrapped in ``AllowedHostsOriginValidator``: workers send no ``Origin`` header.
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "modelrelay_site.settings")

from django.core.asgi import get_asgi_application

django_application = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path, re_path  # noqa: E402

from modelrelay_site import daphne_shim  # noqa: E402
from relay.server.http.app import RelayHttpApp  # noqa: E402
from relay.server.http.join import JoinApp  # noqa: E402
from relay.server.legacy.nodes import LegacyNodeConsumer  # noqa: E402
from relay.server.legacy.oldapi import OldChatApp  # noqa: E402
from relay.server.socket.consumer import WorkerConsumer  # noqa: E402
from relay.server.socket.rejecting import RejectingConsumer  # noqa: E402

daphne_shim.install()

application = ProtocolTypeRouter(
    {
        "http": RelayHttpApp(
            django_application,
            routes={OldChatApp.path: OldChatApp(), JoinApp.path: JoinApp()},
        ),
        "websocket": URLRouter(
            [
                path("v1/worker/connect", WorkerConsumer.as_asgi()),
                path("ws", LegacyNodeConsumer.as_asgi()),
                path("v1/worker/legacy", LegacyNodeConsumer.as_asgi()),
                re_path(r"", RejectingConsumer.as_asgi()),
            ]
        ),
    }
)
