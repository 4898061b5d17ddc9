from django.apps import AppConfig


class KeysConfig(AppConfig):
    name = "keys"
    verbose_name = "API keys"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from keys import signals  # noqa: F401  (connects receivers)
