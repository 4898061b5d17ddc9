from django.contrib import admin
from django.urls import path

from relay.api import api

admin.site.site_header = "ModelRelay"
admin.site.site_title = "ModelRelay admin"
admin.site.index_title = "Operations"

urlpatterns = [
    path("admin/", api.urls),
    path("django-admin/", admin.site.urls),
]
