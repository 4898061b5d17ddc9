"""The setup wizard (SPEC §9): connect a new GPU box, step by step.

1. ``/setup``: platform and backend (public);
2. ``/setup/backend``: how to start that backend (public);
3. ``/setup/worker``: staff mint a join token for an existing provider (needs the
   permission to add join tokens; SPEC §22), shown once with the two commands the box
   needs (``pip install`` of the worker's wheel from this relay, then
   ``modelrelay-worker --proxy-url … --join-token …``); or choose a new provider
   (needs the permission to add providers) or rotate an existing one's secret (to
   change them), optionally disconnecting the workers already connected with the old
   one; the secret is created here, shown once (never stored in clear, page not cached)
   together with the worker's install-and-run command for the platform and a systemd
   env file;
4. the same page follows ``/setup/status`` until a worker of that provider registers
   after the secret was issued, then shows a ``curl`` test for its first model.

``/setup/worker.pyz`` serves the worker as a zipapp (:mod:`relay.pages.bundle`),
``/setup/modelrelay_worker-<version>-py3-none-any.whl`` as a wheel
(:mod:`relay.pages.wheel`).
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlencode, urlsplit

from django import forms
from django.conf import settings
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
    JsonResponse,
)
from django.shortcuts import render
from django.views.decorators.cache import never_cache

from relay.core import snapshot
from relay.pages import bundle, recipes, wheel
from relay.pages.dashboard import forbidden, staff_user
from relay.server import runtime
from workers_app.joining import mint_token
from workers_app.models import Provider, split_models, validate_provider_name
from workers_app.services import rotate_secret

STEPS = ("Platform & backend", "Start the backend", "Run the worker", "Confirm")
#: Minting a join token (mode "join"), creating a provider (mode "new") and rotating a
#: secret (mode "rotate") need what the Django admin would ask for the same change.
MODE_PERMISSIONS = {
    "join": "workers_app.add_jointoken",
    "new": "workers_app.add_provider",
    "rotate": "workers_app.change_provider",
}


def public_url(request: HttpRequest) -> str:
    """This server as GPU boxes reach it: PUBLIC_URL, else what the browser used."""
    configured = str(settings.PUBLIC_URL).strip().rstrip("/")
    return configured or f"{request.scheme}://{request.get_host()}"


def _choice(request: HttpRequest) -> tuple[str, str] | None:
    platform = request.GET.get("platform", "")
    backend = request.GET.get("backend", "")
    if platform in recipes.PLATFORMS and backend in recipes.BACKENDS:
        return platform, backend
    return None


def _context(step: int, **extra: Any) -> dict[str, Any]:
    return {"nav": "setup", "steps": list(enumerate(STEPS, start=1)), "step": step, **extra}


def start(request: HttpRequest) -> HttpResponse:
    """Step 1: choose the platform and the backend."""
    context = _context(
        1,
        platforms=recipes.PLATFORMS,
        backends=recipes.BACKENDS.values(),
        platform=request.GET.get("platform", ""),
        backend=request.GET.get("backend", "llama"),
    )
    return render(request, "relay/setup_start.html", context)


def backend(request: HttpRequest) -> HttpResponse:
    """Step 2: how to start the chosen backend on the chosen platform."""
    choice = _choice(request)
    if choice is None:
        return HttpResponseRedirect("/setup")
    platform, key = choice
    recipe = recipes.BACKENDS[key]
    context = _context(
        2,
        platform=platform,
        platform_label=recipes.PLATFORMS[platform],
        recipe=recipe,
        recipe_steps=recipe.steps_for(platform),
        query=urlencode({"platform": platform, "backend": key}),
    )
    return render(request, "relay/setup_backend.html", context)


def _http_url(value: str) -> str:
    value = value.strip().rstrip("/")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValidationError("Enter the backend's base URL, like http://127.0.0.1:8000.")
    return value


class WorkerForm(forms.Form):
    """Step 3: which provider the new worker joins, and how it reaches its backend."""

    platform = forms.ChoiceField(choices=list(recipes.PLATFORMS.items()))
    backend = forms.ChoiceField(choices=[(b.key, b.label) for b in recipes.BACKENDS.values()])
    mode = forms.ChoiceField(
        choices=[
            ("join", "Join with a token"),
            ("new", "Create a new provider"),
            ("rotate", "Rotate an existing provider"),
        ],
        initial="join",
        widget=forms.RadioSelect,
    )
    name = forms.CharField(required=False, max_length=64, strip=True)
    provider = forms.ModelChoiceField(
        queryset=Provider.objects.all(), required=False, to_field_name="name"
    )
    disconnect = forms.BooleanField(required=False)
    #: Empty: the worker finds its backend on the box's usual ports.
    backend_url = forms.CharField(max_length=500, required=False)
    models = forms.CharField(required=False, max_length=2000)
    max_concurrent = forms.IntegerField(required=False, min_value=1, max_value=10_000)

    def clean_backend_url(self) -> str:
        value = self.cleaned_data.get("backend_url") or ""
        return _http_url(value) if value.strip() else ""

    def clean_models(self) -> list[str]:
        return split_models(self.cleaned_data.get("models") or "")

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if data.get("mode") == "new":
            name = data.get("name") or ""
            if not name:
                self.add_error("name", "Name the new provider.")
            else:
                try:
                    validate_provider_name(name)
                except ValidationError as exc:
                    self.add_error("name", exc)
                else:
                    if Provider.objects.filter(name=name).exists():
                        self.add_error(
                            "name",
                            f"A provider named '{name}' exists: rotate its secret instead.",
                        )
        elif data.get("mode") == "rotate" and data.get("provider") is None:
            self.add_error("provider", "Choose the provider whose secret to rotate.")
        elif data.get("mode") == "join" and data.get("provider") is None:
            self.add_error("provider", "Choose the provider the worker joins.")
        return data


def _issue_secret(data: dict[str, Any]) -> tuple[Provider, str, str]:
    """Create the provider or rotate its secret; the clear secret is returned, never stored.

    Also returns what happened to workers already connected (rotation only).
    """
    if data["mode"] == "new":
        with transaction.atomic():
            provider = Provider(name=data["name"])
            secret = provider.rotate_secret()
            provider.save()
        return provider, secret, ""
    rotation = rotate_secret(data["provider"], disconnect=bool(data.get("disconnect")))
    return rotation.provider, rotation.secret, rotation.outcome()


def _allowed_modes(request: HttpRequest) -> set[str]:
    return {mode for mode, perm in MODE_PERMISSIONS.items() if request.user.has_perm(perm)}


@never_cache
@staff_member_required
def worker(request: HttpRequest) -> HttpResponse:
    """Step 3 (staff): the provider form; on POST, the one-time secret and the commands."""
    allowed = _allowed_modes(request)
    if not allowed:
        raise PermissionDenied("you may not create providers or rotate their secrets")
    if request.method == "POST":
        # Checked before the form so that nothing is created or rotated without it.
        if request.POST.get("mode") not in allowed:
            raise PermissionDenied("you may not do this to providers")
        form = WorkerForm(request.POST)
        if form.is_valid():
            if form.cleaned_data["mode"] == "join":
                return _joining(request, form.cleaned_data)
            return _issued(request, form.cleaned_data)
    else:
        choice = _choice(request) or ("linux", "llama")
        recipe = recipes.BACKENDS[choice[1]]
        form = WorkerForm(
            initial={
                "platform": choice[0],
                "backend": choice[1],
                "mode": next(m for m in MODE_PERMISSIONS if m in allowed),
                "provider": settings.PROVIDER_NAME,
                "max_concurrent": recipe.max_concurrent,
            }
        )
    platform = form["platform"].value() or "linux"
    may_rotate = "rotate" in allowed
    may_join = "join" in allowed
    context = _context(
        3,
        form=form,
        may_join=may_join,
        may_create="new" in allowed,
        may_rotate=may_rotate,
        providers=list(Provider.objects.values_list("name", flat=True))
        if may_rotate or may_join
        else [],
        backend_placeholder=recipes.BACKENDS.get(
            str(form["backend"].value()), recipes.BACKENDS["llama"]
        ).backend_url,
        platform_label=recipes.PLATFORMS.get(str(platform), ""),
        back_query=urlencode(
            {"platform": form["platform"].value(), "backend": form["backend"].value()}
        ),
    )
    return render(request, "relay/setup_worker.html", context)


def _issued(request: HttpRequest, data: dict[str, Any]) -> HttpResponse:
    issued_at = time.time()
    provider, secret, outcome = _issue_secret(data)
    setup = recipes.WorkerSetup(
        public_url=public_url(request),
        provider=provider.name,
        secret=secret,
        backend_url=data["backend_url"],
        models=tuple(data["models"]),
        max_concurrent=data.get("max_concurrent"),
    )
    requirements = bundle.worker_requirements()
    commands = [recipes.worker_command(p, setup, requirements) for p in recipes.PLATFORMS]
    context = _context(
        3,
        provider=provider,
        rotated=data["mode"] == "rotate",
        disconnected=bool(data.get("disconnect")) and data["mode"] == "rotate",
        outcome=outcome,
        env_file=recipes.env_file(setup),
        # serve puts WORKER_SECRET back on its provider at every start.
        env_secret=bool(settings.WORKER_SECRET) and provider.name == settings.PROVIDER_NAME,
        secret=secret,
        setup=setup,
        platform=data["platform"],
        commands=commands,
        wheel_url=f"{setup.public_url}/setup/{wheel.wheel_filename()}",
        status_url="/setup/status?"
        + urlencode({"provider": provider.name, "since": f"{issued_at:.3f}"}),
    )
    return render(request, "relay/setup_ready.html", context)


def _joining(request: HttpRequest, data: dict[str, Any]) -> HttpResponse:
    """Step 3, joining: a fresh join token (single use, JOIN_TOKEN_TTL_SECS) and the two
    commands; step 4 follows the same way."""
    issued_at = time.time()
    provider: Provider = data["provider"]
    made = mint_token(provider, created_by=f"setup: {request.user.get_username()}")
    setup = recipes.JoinSetup(
        public_url=public_url(request),
        token=made.secret,
        wheel=wheel.wheel_filename(),
        backend_url=data["backend_url"],
        models=tuple(data["models"]),
        max_concurrent=data.get("max_concurrent"),
    )
    commands = [
        (command, recipes.install_line(command))
        for command in (recipes.join_commands(p, setup) for p in recipes.PLATFORMS)
    ]
    context = _context(
        3,
        provider=provider,
        join=True,
        token=made.token,
        secret=made.secret,
        setup=setup,
        platform=data["platform"],
        commands=commands,
        bundle_url=f"{setup.public_url}/setup/worker.pyz",
        status_url="/setup/status?"
        + urlencode({"provider": provider.name, "since": f"{issued_at:.3f}"}),
    )
    return render(request, "relay/setup_join.html", context)


async def status(request: HttpRequest) -> HttpResponse:
    """Step 4 (staff, JSON): workers of ``provider`` connected since ``since``, and a test call."""
    if await staff_user(request) is None:
        return forbidden()
    name = request.GET.get("provider", "")
    try:
        since = float(request.GET.get("since", "0"))
    except ValueError:
        return JsonResponse({"detail": "'since' must be a number (epoch seconds)"}, status=400)
    workers = snapshot.connected_after(await runtime.current().workers(), name, since)
    body: dict[str, Any] = {"provider": name, "ready": bool(workers), "workers": workers}
    if workers:
        model = next((m for w in workers for m in w["models"]), "")
        url = public_url(request)
        keys = bool(settings.MODELRELAY_REQUIRE_API_KEYS)
        body["model"] = model
        body["curl"] = recipes.curl_test(url, model or "<model>", api_key=keys)
        body["powershell"] = recipes.powershell_test(url, model or "<model>", api_key=keys)
        body["api_key_required"] = keys
    return JsonResponse(body, headers={"Cache-Control": "no-store"})


def worker_pyz(request: HttpRequest) -> HttpResponse:
    """``/setup/worker.pyz``: the worker zipapp (public; it holds no secret)."""
    built = bundle.worker_bundle()
    return HttpResponse(
        built.data,
        content_type="application/octet-stream",
        headers={
            "Content-Disposition": 'attachment; filename="worker.pyz"',
            "ETag": f'"{built.sha256[:32]}"',
            "Cache-Control": "no-cache",
        },
    )


def worker_wheel(request: HttpRequest, filename: str) -> HttpResponse:
    """``/setup/modelrelay_worker-<version>-py3-none-any.whl``: the worker's wheel (public;
    it holds no secret). Another file name (an older version) is a 404."""
    built = wheel.worker_wheel()
    if filename != built.filename:
        raise Http404(f"this relay serves {built.filename}")
    return HttpResponse(
        built.data,
        content_type="application/octet-stream",
        headers={
            "Content-Disposition": f'attachment; filename="{built.filename}"',
            "ETag": f'"{built.sha256[:32]}"',
            "Cache-Control": "no-cache",
        },
    )
