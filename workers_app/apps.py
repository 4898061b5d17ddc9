from django.apps import AppConfig


class WorkersAppConfig(AppConfig):
    name = "workers_app"
    verbose_name = "Workers and providers"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from workers_app import signals  # noqa: F401  (connects receivers)
