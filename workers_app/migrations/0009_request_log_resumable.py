from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workers_app", "0008_joining"),
    ]

    operations = [
        migrations.AddField(
            model_name="requestlog",
            name="resumable",
            field=models.CharField(blank=True, default="", max_length=16),
        ),
    ]
