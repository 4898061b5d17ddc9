from django.contrib import admin
from django.urls import path, re_path

from relay.pages import dashboard, wizard
from relay.server.admin.api import api

admin.site.site_header = "ModelRelay"
admin.site.site_title = "ModelRelay admin"
admin.site.index_title = "Operations"

urlpatterns = [
    path("admin/", api.urls),
    path("django-admin/", admin.site.urls),
    path("", dashboard.home, name="home"),
    path("dashboard", dashboard.dashboard, name="dashboard"),
    path("dashboard/events", dashboard.events, name="dashboard-events"),
    path(
        "dashboard/workers/<str:worker_id>/<str:action>",
        dashboard.worker_action,
        name="dashboard-worker-action",
    ),
    path("setup", wizard.start, name="setup"),
    path("setup/backend", wizard.backend, name="setup-backend"),
    path("setup/worker", wizard.worker, name="setup-worker"),
    path("setup/status", wizard.status, name="setup-status"),
    path("setup/worker.pyz", wizard.worker_pyz, name="setup-worker-pyz"),
    re_path(
        r"^setup/(?P<filename>modelrelay_worker-[A-Za-z0-9_.+]+-py3-none-any\.whl)$",
        wizard.worker_wheel,
        name="setup-worker-wheel",
    ),
]
