from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workers_app", "0006_request_log_cached_tokens"),
    ]

    operations = [
        migrations.AddField(
            model_name="requestlog",
            name="tokens_estimated",
            field=models.BooleanField(default=False),
        ),
    ]
