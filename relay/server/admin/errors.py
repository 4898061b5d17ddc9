"""JSON answers for every error under the admin JSON API (``/admin/*``).

Django answers an unknown path with its HTML "Not Found" page and django-ninja a
wrong method with a plain-text 405: under ``/admin/`` both become the API's own
``{"detail": ...}`` documents (the ``Allow`` header kept), so scripts calling the
admin API never have to parse HTML. (``/v1/*`` is answered by the fast path.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponseBase, JsonResponse

_DETAILS = {404: "Not found", 405: "Method not allowed"}
Handler = Callable[[HttpRequest], Any]


class AdminJsonErrors:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Handler) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        return self._convert(request, self.get_response(request))

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        response = self.get_response(request)
        assert isinstance(response, Awaitable)
        return self._convert(request, await response)

    @staticmethod
    def _convert(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        detail = _DETAILS.get(response.status_code)
        if (
            detail is None
            or not request.path.startswith("/admin/")
            or response.get("Content-Type", "").startswith("application/json")
        ):
            return response
        converted = JsonResponse({"detail": detail}, status=response.status_code)
        if response.has_header("Allow"):
            converted["Allow"] = response["Allow"]
        return converted
